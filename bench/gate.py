"""Gate throughput and latency for a 20-tool task (targets: >= 50k decisions/s, p99 <= 100 us).

Run: `python bench/gate.py [--calls N]`. The mix cycles through every tool, with one or two workspace paths
per file call (some through `..`), plus undeclared and outside-workspace calls, with the stop switch
checked on every decision as in a real run. Prints one JSON line per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from proctor.mechanisms.policy.gate import Gate
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask, Effect, ToolCall
from proctor.mechanisms.policy.trusted import Ceilings, Policy

EFFECTS = [Effect.read, Effect.write, Effect.delete, Effect.none, Effect.shell, Effect.network, Effect.send]


def make_task(workspace: Path) -> AgentTask:
    tools = [{"name": f"tool{i:02d}", "effect": EFFECTS[i % len(EFFECTS)], "online": i % 9 == 0} for i in range(20)]
    perms = {"workspace": str(workspace), "read_files": True, "write_files": True, "shell": True, "network": True}
    return AgentTask.model_validate({"goal": "bench", "tools": tools, "permissions": perms})


def make_calls(task: AgentTask, n: int) -> list[ToolCall]:
    calls = []
    for i in range(n):
        tool = task.tools[i % len(task.tools)]
        paths: tuple[str, ...] = ()
        if tool.effect in (Effect.read, Effect.write, Effect.delete):
            paths = (f"src/pkg/mod{i % 7}.py",) if i % 3 else ("src/pkg/../pkg/a.py", "docs/readme.md")
        name = tool.name
        if i % 50 == 49:
            name = "undeclared"
        if i % 50 == 48:
            paths = ("../../etc/passwd",)
        calls.append(ToolCall(tool=name, paths=paths, call_id=f"c{i}"))
    return calls


def measure(calls: list[ToolCall], task: AgentTask, policy: Policy, stop) -> dict[str, float]:
    gate = Gate(task, policy=policy, dry_run=True, stop=stop)
    timings = []
    perf = time.perf_counter_ns
    decide = gate.decide
    cpu0 = time.process_time()
    start = perf()
    for call in calls:
        t0 = perf()
        decide(call)
        timings.append(perf() - t0)
    total_s = (perf() - start) / 1e9
    cpu_s = time.process_time() - cpu0
    timings.sort()
    return {
        "decisions": len(calls),
        "decisions_per_s": round(len(calls) / total_s),
        # CPU time excludes time this process spent waiting for a core, so it is stable on a shared machine.
        "decisions_per_cpu_s": round(len(calls) / cpu_s),
        "p50_us": round(timings[len(timings) // 2] / 1e3, 2),
        "p99_us": round(timings[int(len(timings) * 0.99)] / 1e3, 2),
        "max_us": round(timings[-1] / 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        ws = Path(tmp) / "ws"
        (ws / "src" / "pkg").mkdir(parents=True)
        (ws / "docs").mkdir()
        for i in range(7):
            (ws / "src" / "pkg" / f"mod{i}.py").write_text("x = 1\n")
        os.environ["PROCTOR_HOME"] = str(home)
        task = make_task(ws)
        policy = Policy(ceilings=Ceilings(max_tool_calls=10**9), forbidden_paths=(".git", "secrets/*"))
        calls = make_calls(task, args.calls)
        measure(calls[:5_000], task, policy, StopSwitch(home).reason)  # warm up
        for label, stop in (("with stop switch", StopSwitch(home).reason), ("without stop switch", lambda: None)):
            print(json.dumps({"scenario": f"20-tool task, {label}", **measure(calls, task, policy, stop)}))


if __name__ == "__main__":
    main()
