"""Measure (not a test): what proctor's gate adds to one tool call of a CLI agent.

A CLI runs its hook as a fresh process for every tool call. Timed here, per call and interleaved (one of each
in turn, so a load that comes and goes on a shared machine hits all alike): a bare `true` hook (the
irreducible spawn), the hook client's interpreter starting and exiting (`python3 -I -S -c pass`), and the
whole gated hook as a job runs it — `GateService.hook_command()` (the compiled client), a request to the
job's gate service on its Unix socket, the gate's decision, the `gate.call` ledger row (SQLite, WAL, chained,
head swapped) and the answer in claude's dialect. Each call is granted (a `Write` inside the worktree, the
trusted tool-call ceiling raised for the run; with the default ceiling of 50 most calls measured a
TOOL_LIMIT refusal). Also timed: the gate service alone, asked by a client inside this process (no spawn).
Target (issue 25): gated hook p50 <= 15 ms, p99 <= 40 ms.
Run: .venv/bin/python bench/hook.py [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proctor.mechanisms.gatekeeper.claude import ClaudeDialect
from proctor.mechanisms.gatekeeper.service import GateService
from proctor.mechanisms.gatekeeper.task import default_task
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.trusted import Ceilings, Policy


def timed(argv: list[str], stdin: bytes) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, input=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return (time.perf_counter() - t0) * 1000


def asked(sock_path: str, payload: bytes) -> tuple[float, dict]:
    """One request as the hook client sends it, from this process: the service's share of a call."""
    t0 = time.perf_counter()
    req = json.dumps({"cli": "claude", "event": "PreToolUse", "payload": payload.decode()}) + "\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock_path)
        s.sendall(req.encode())
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while b := s.recv(65536):
            chunks.append(b)
    return (time.perf_counter() - t0) * 1000, json.loads(b"".join(chunks))


def line(name: str, ms: list[float], base: float | None = None) -> str:
    ms = sorted(ms)
    p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    ratio = f"  ({p50 / base:.1f}x the bare spawn)" if base else ""
    return f"{name:<40} p50 {p50:6.1f} ms   p99 {p99:6.1f} ms{ratio}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    n = ap.parse_args().calls
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        work = root / "work"
        work.mkdir()
        os.environ.setdefault("PROCTOR_HOME", str(root / "home"))
        ledger = Ledger(root / "ledger.sqlite3")
        task = default_task("bench", work, False, ClaudeDialect.tools)
        gate = GateService(ClaudeDialect(), task, Policy(ceilings=Ceilings(max_tool_calls=10 * n + 10)), ledger,
                           "bench", root / "gate", stop=lambda: None, worktree=work).start()

        def payload(i: int) -> bytes:
            return json.dumps({"hook_event_name": "PreToolUse", "tool_name": "Write", "tool_use_id": f"toolu_{i}",
                               "tool_input": {"file_path": str(work / "a.txt"), "content": "x"}}).encode()

        try:
            bare, interp, calls, service = [], [], [], []
            hook = [*gate.hook_command(), "PreToolUse"]
            python = [os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"]
            for i in range(n):
                bare.append(timed(["true"], b""))
                interp.append(timed(python, b""))
                calls.append(timed(hook, payload(i)))
                ms, answer = asked(str(gate.socket_path), payload(n + i))
                service.append(ms)
            assert '"allow"' in answer["stdout"], answer
            granted = sum(1 for r in ledger.rows(kind="gate.call") if r.payload.get("verdict") == "run")
        finally:
            gate.stop()
            ledger.close()
    base = statistics.median(bare)
    print(line("bare `true` hook", bare))
    print(line("the client's interpreter (-I -S)", interp, base))
    print(line("gated hook (decision + ledger row)", calls, base))
    print(line("the gate service alone (no spawn)", service))
    print(f"granted calls with a ledger row: {granted} of {2 * n}; added by proctor over the interpreter alone: "
          f"p50 {statistics.median(calls) - statistics.median(interp):.1f} ms; "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
