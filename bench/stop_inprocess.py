"""Measure (not a test): how long the stop switch takes to end an in-process run (policy.runtime.run_agent).

Moved here from tests/test_stop.py, whose `< 2 s` assertions were a loaded machine's clock (issue 24): the
tests keep the correctness (the run ends STOPPED with the operator's reason, an adapter's child is killed),
this keeps the number. Two adapters, as in the tests:
- a looping adapter that yields a step every 20 ms (the runtime reads the switch between steps);
- a one-step adapter that runs a child process and polls `stop` every 100 ms, killing the child when told.
For each: median and max of N runs, from the engage (at a random moment once the adapter runs) to
run_agent's return, and the max's ratio to the floor no implementation can beat in the worst case (the
adapter's own step or poll interval: the switch is read only that often).
The claim under test was "within 2 s"; exit 1 when the max passes it.
Run: .venv/bin/python bench/stop_inprocess.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TARGET_S = 2.0


class Looping:
    name = "looping"
    floor_s = 0.02

    def __init__(self) -> None:
        self.running = threading.Event()

    def available(self):  # type: ignore[no-untyped-def]
        from proctor.mechanisms.policy.runtime import Availability

        return Availability(available=True)

    def run(self, task: Any, *, gate: Any, usage: Any, stop: Callable[[], str | None]) -> Iterator[Any]:
        from proctor.mechanisms.policy.runtime import StepEvent

        while True:
            time.sleep(self.floor_s)
            self.running.set()
            yield StepEvent()


class Subprocess:
    name = "subprocess"
    floor_s = 0.1

    def __init__(self) -> None:
        self.running = threading.Event()

    def available(self):  # type: ignore[no-untyped-def]
        from proctor.mechanisms.policy.runtime import Availability

        return Availability(available=True)

    def run(self, task: Any, *, gate: Any, usage: Any, stop: Callable[[], str | None]) -> Iterator[Any]:
        from proctor.mechanisms.policy.runtime import FinishedEvent

        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        self.running.set()
        while proc.poll() is None:
            if stop() is not None:
                proc.kill()
                proc.wait()
                break
            time.sleep(self.floor_s)
        yield FinishedEvent(output="exit", claimed_status="completed")


def once(make: Callable[[], Looping | Subprocess], root: Path) -> float:
    """Seconds from the engage to run_agent's STOPPED return, in a fresh $PROCTOR_HOME under `root`."""
    from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger
    from proctor.mechanisms.policy.breaker import Breaker
    from proctor.mechanisms.policy.runtime import RunCode, run_agent
    from proctor.mechanisms.policy.stop import StopSwitch
    from proctor.mechanisms.policy.task import AgentTask
    from proctor.mechanisms.policy.trusted import Ceilings, Policy

    home = root / "home"
    ws = root / "ws"
    ws.mkdir(parents=True)
    os.environ["PROCTOR_HOME"] = str(home)
    adapter = make()
    task = AgentTask.model_validate({"goal": "g", "permissions": {"workspace": str(ws)}})
    engaged: list[float] = []

    def stop_once_running() -> None:
        adapter.running.wait(60)
        time.sleep(random.uniform(0, 0.5))  # any phase of the adapter's poll, not just after its first one
        engaged.append(time.perf_counter())
        StopSwitch().engage("bench")

    with Ledger(root / LEDGER_FILE) as ledger:
        th = threading.Thread(target=stop_once_running, daemon=True)
        th.start()
        out = run_agent(adapter, task, policy=Policy(ceilings=Ceilings(max_steps=10**6)), breaker=Breaker(ledger),
                        ledger=ledger)
        took = time.perf_counter() - engaged[0]
        th.join(10)
    if out.code is not RunCode.STOPPED:
        raise SystemExit(f"{adapter.name}: ended {out.code}, not STOPPED")
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    n = ap.parse_args().runs
    missed = False
    for make in (Looping, Subprocess):
        with tempfile.TemporaryDirectory() as d:
            times = [once(make, Path(d) / str(i)) for i in range(n)]
        med, worst = statistics.median(times), max(times)
        floor = make.floor_s
        print(f"{make.name:10s} stop -> STOPPED: median {med * 1000:.0f} ms, max {worst * 1000:.0f} ms; "
              f"floor {floor * 1000:.0f} ms (its poll interval): max {worst / floor:.2f}x the floor "
              f"[{'ok' if worst < TARGET_S else 'MISSED'} < {TARGET_S:.0f} s]")
        missed |= worst >= TARGET_S
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
