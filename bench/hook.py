"""Measure (not a test): what proctor's gate adds to one tool call of a CLI agent.

A CLI runs its hook as a fresh process for every tool call. Timed here, per call: a bare `true` hook (the
irreducible spawn), the hook client's interpreter starting and exiting (`python3 -I -S -c pass`), and the
whole gated hook — spawn of `hook_client.py`, a request to the job's gate service on its Unix socket, the
gate's decision, the `gate.call` ledger row (SQLite, WAL) and the answer in claude's dialect. Target:
p50 <= 30 ms, p99 <= 80 ms for the gated hook.
Run: .venv/bin/python bench/hook.py [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proctor.job.gatekeeper import ClaudeDialect, GateService, default_task
from proctor.ledger import Ledger
from proctor.policy.trusted import Policy


def timed(argv: list[str], stdin: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, input=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def line(name: str, ms: list[float], base: float | None = None) -> str:
    ms = sorted(ms)
    p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    ratio = f"  ({p50 / base:.1f}x the bare spawn)" if base else ""
    return f"{name:<38} p50 {p50:6.1f} ms   p99 {p99:6.1f} ms{ratio}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    n = ap.parse_args().calls
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        work = root / "work"
        work.mkdir()
        os.environ.setdefault("PROCTOR_HOME", str(root / "home"))
        ledger = Ledger(root / "ledger.sqlite3")
        task = default_task("bench", work, False, ClaudeDialect.tools)
        task = task.model_copy(update={"limits": task.limits.model_copy(update={"max_tool_calls": 10 * n + 10})})
        gate = GateService(ClaudeDialect(), task, Policy(), ledger, "bench", root / "gate",
                           stop=lambda: None, worktree=work).start()
        try:
            bare = timed(["true"], b"", n)
            interp = timed([os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"], b"", n)
            hook = [*gate.hook_command(), "PreToolUse"]
            calls = []
            for i in range(n):
                payload = json.dumps({"hook_event_name": "PreToolUse", "tool_name": "Write",
                                      "tool_use_id": f"toolu_{i}",
                                      "tool_input": {"file_path": str(work / "a.txt"), "content": "x"}}).encode()
                calls += timed(hook, payload, 1)
            rows = sum(1 for r in ledger.rows() if r.kind == "gate.call")
        finally:
            gate.stop()
            ledger.close()
    base = statistics.median(bare)
    print(line("bare `true` hook", bare))
    print(line("the client's interpreter (-I -S)", interp, base))
    print(line("gated hook (decision + ledger row)", calls, base))
    print(f"ledger rows written: {rows} of {n}; added by proctor over the interpreter alone: "
          f"p50 {statistics.median(calls) - statistics.median(interp):.1f} ms")


if __name__ == "__main__":
    main()
