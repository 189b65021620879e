"""The stop switch: a file under $PROCTOR_HOME that stops runs, and its engage/release. How soon a run stops
is measured by bench/stop.py (a CLI agent) and bench/stop_inprocess.py (these in-process adapters), never
asserted here: a test's clock is the machine's load (issue 24)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger
from proctor.mechanisms.policy.breaker import Breaker
from proctor.mechanisms.policy.gate import Gate
from proctor.mechanisms.policy.runtime import Availability, FinishedEvent, RunCode, StepEvent, Usage, run_agent
from proctor.mechanisms.policy.stop import DEFAULT_REASON, STOP_FILE, StopSwitch
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Ceilings, Policy


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    return fresh_home


def test_engage_reason_release(home):
    s = StopSwitch()
    assert s.path == home / STOP_FILE and s.reason() is None
    s.engage("  deploy freeze \n")
    assert s.reason() == "deploy freeze"
    assert StopSwitch(home).reason() == "deploy freeze"  # every process sees it
    s.release()
    assert s.reason() is None
    s.release()  # releasing twice is fine


def test_empty_reason_still_stops(home):
    StopSwitch().engage("")
    assert StopSwitch().reason() == DEFAULT_REASON


def test_engage_leaves_no_temp_files(home):
    StopSwitch().engage("x")
    assert sorted(p.name for p in home.iterdir()) == [STOP_FILE]


def test_explicit_home_is_independent(tmp_path, home):
    other = StopSwitch(tmp_path / "elsewhere")
    other.engage("only there")
    assert StopSwitch().reason() is None and other.reason() == "only there"


def test_unreadable_stop_file_fails_closed(home):
    (home / STOP_FILE).mkdir(parents=True)
    assert StopSwitch().reason() == DEFAULT_REASON


class Looping:
    """Steps forever, as a busy agent would, until proctor stops it."""

    name = "looping"

    def __init__(self) -> None:
        self.running = threading.Event()  # set at its first step: the run is under way

    def available(self) -> Availability:
        return Availability(available=True)

    def run(self, task: AgentTask, *, gate: Gate, usage: Usage, stop: Callable[[], str | None]) -> Iterator[Any]:
        while True:
            time.sleep(0.02)
            self.running.set()
            yield StepEvent()


class SubprocessAgent:
    """A one-step adapter that runs a child process and polls `stop`, the way a CLI adapter must."""

    name = "subprocess"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.running = threading.Event()  # set once its child runs

    def available(self) -> Availability:
        return Availability(available=True)

    def run(self, task: AgentTask, *, gate: Gate, usage: Usage, stop: Callable[[], str | None]) -> Iterator[Any]:
        # A child that would outlive every bound here: only the stop ends it.
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        self.running.set()
        while self.proc.poll() is None:
            if stop() is not None:
                self.proc.kill()
                self.proc.wait()
                break
            time.sleep(0.1)
        yield FinishedEvent(output="exit", claimed_status="completed")


def _run_then_stop(adapter: Looping | SubprocessAgent, tmp_path: Path, ws: Path) -> Any:
    """run_agent with `adapter`, the stop engaged once the adapter runs (not after a fixed pause: on a loaded
    machine the run may not have begun yet, and a stop before the start is another path)."""
    task = AgentTask.model_validate({"goal": "g", "permissions": {"workspace": str(ws)}})
    policy = Policy(ceilings=Ceilings(max_steps=10**6))

    def stop_once_running() -> None:
        if adapter.running.wait(120):  # a bound for a broken run only
            StopSwitch().engage("operator pressed stop")

    with Ledger(tmp_path / LEDGER_FILE) as ledger:
        th = threading.Thread(target=stop_once_running, daemon=True)
        th.start()
        out = run_agent(adapter, task, policy=policy, breaker=Breaker(ledger), ledger=ledger)
        th.join(120)
    return out


def test_stop_ends_a_running_in_process_agent(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    adapter = Looping()
    out = _run_then_stop(adapter, tmp_path, ws)
    # It steps forever: STOPPED with the operator's reason is the stop ending it.
    assert adapter.running.is_set()
    assert out.code is RunCode.STOPPED and "operator pressed stop" in out.reason


def test_stop_kills_an_adapters_child_process(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    adapter = SubprocessAgent()
    out = _run_then_stop(adapter, tmp_path, ws)
    assert out.code is RunCode.STOPPED and out.claimed_status is None
    # Killed (SIGKILL), not ended by its ten minutes of sleep, and reaped.
    assert adapter.proc is not None and adapter.proc.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(adapter.proc.pid, 0)


# The CLI-agent half (a running fake CLI agent killed within 2 s of `proctor stop`, status failed, code
# STOPPED) drives the host: tests/test_run_agent_guarded.py::test_stop_kill_latency and its neighbours.
