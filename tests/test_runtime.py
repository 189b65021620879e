"""The run loop: every way a run ends has its own code, the claim stays apart from the evidence, every
decision reaches the ledger, and the breaker learns from each run. Adapters here are small scripted fakes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock

from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger
from proctor.mechanisms.policy.breaker import Breaker, BreakerState, Signal
from proctor.mechanisms.policy.gate import CallVerdict, Gate
from proctor.mechanisms.policy.runtime import (
    AgentRuntime,
    Availability,
    BackendRateLimited,
    FinishedEvent,
    Outcome,
    RunCode,
    StepEvent,
    ToolResultEvent,
    Usage,
    Verdict,
    run_agent,
)
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask, ToolCall
from proctor.mechanisms.policy.trusted import Policy

Script = Callable[[Gate, Usage], Iterator[Any]]


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    fresh_home.mkdir()
    return fresh_home


@pytest.fixture
def ws(tmp_path) -> Path:
    w = tmp_path / "ws"
    w.mkdir()
    (w / "a.py").write_text("x = 1\n")
    return w


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / LEDGER_FILE) as led:
        yield led


@pytest.fixture
def clock() -> Clock:
    return Clock(0.0)


@pytest.fixture
def breaker(ledger, clock) -> Breaker:
    return Breaker(ledger, threshold=3, cooldown_s=60, clock=clock)


class Scripted:
    """An in-process adapter that runs a script (a generator function of the gate and usage)."""

    def __init__(self, script: Script, *, available: Availability | None = None, name: str = "scripted") -> None:
        self.name = name
        self._script = script
        self._available = available or Availability(available=True)
        self.seen_stop: Callable[[], str | None] | None = None

    def available(self) -> Availability:
        return self._available

    def run(self, task: AgentTask, *, gate: Gate, usage: Usage, stop: Callable[[], str | None]) -> Iterator[Any]:
        self.seen_stop = stop
        return self._script(gate, usage)


def task(ws: Path, **limits: Any) -> AgentTask:
    return AgentTask.model_validate({
        "goal": "fix it",
        "tools": [{"name": "read", "effect": "read"}, {"name": "sh", "effect": "shell"}],
        "permissions": {"workspace": str(ws), "read_files": True, "shell": True},
        "limits": limits,
    })


def good_script(gate: Gate, usage: Usage) -> Iterator[Any]:
    yield StepEvent()
    d = gate.decide(ToolCall(tool="read", paths=("a.py",), call_id="r1"))
    assert d.verdict is CallVerdict.run
    yield ToolResultEvent(call_id="r1", output="x = 1")
    yield {"kind": "step"}
    yield FinishedEvent(output="done", claimed_status="completed, all tests pass")


def shell_script(gate: Gate, usage: Usage) -> Iterator[Any]:
    d = gate.decide(ToolCall(tool="sh", arguments={"argv": ["make"]}, call_id="s1"))
    yield ToolResultEvent(call_id="s1", output="(dry run)" if d.verdict is CallVerdict.dry_run else "ok")
    yield FinishedEvent(output="built")


def run(adapter: object, t: Any, ledger: Ledger, breaker: Breaker, clock: Clock, **kw: Any) -> Outcome:
    return run_agent(adapter, t, policy=kw.pop("policy", Policy()), breaker=breaker, ledger=ledger, clock=clock, **kw)


def test_scripted_adapter_is_an_agent_runtime():
    assert isinstance(Scripted(good_script), AgentRuntime)


def test_finished_run_is_a_qualified_draft_with_the_claim_kept_apart(ws, ledger, breaker, clock):
    out = run(Scripted(good_script), task(ws), ledger, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.qualified_draft, RunCode.SELF_REPORTED)
    assert out.claimed_status == "completed, all tests pass" and out.output == "done"
    assert out.evidence.independent_check is None
    assert (out.evidence.steps, out.evidence.granted_calls) == (2, 1)


def test_dry_run_code_when_outward_calls_were_dry_control_live(ws, ledger, breaker, clock):
    dry = run(Scripted(shell_script), task(ws), ledger, breaker, clock)
    assert (dry.verdict, dry.code, dry.evidence.dry_run_calls) == (Verdict.qualified_draft, RunCode.DRY_RUN, 1)
    live = run(Scripted(shell_script), task(ws), ledger, breaker, clock, dry_run=False)
    assert live.code is RunCode.SELF_REPORTED and live.evidence.live_outward_calls == 1


def test_every_run_and_decision_is_in_the_ledger(ws, ledger, breaker, clock):
    def script(gate: Gate, usage: Usage) -> Iterator[Any]:
        gate.decide(ToolCall(tool="read", paths=("a.py",), call_id="ok"))
        gate.decide(ToolCall(tool="read", paths=("../x",), call_id="no"))
        yield FinishedEvent()

    out = run(Scripted(script), task(ws), ledger, breaker, clock, job_id="job-1")
    kinds = [r.kind for r in ledger.rows(job_id="job-1")]
    assert kinds == ["run.start", "gate.decision", "gate.refusal", "run.end"]
    end = ledger.rows(kind="run.end")[-1].payload
    assert end["code"] == out.code.value == "SELF_REPORTED" and end["refused_calls"] == 1
    assert ledger.verify() == []


def test_not_an_adapter(ws, ledger, breaker, clock):
    out = run(object(), task(ws), ledger, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.NOT_AN_ADAPTER)


def test_task_invalid_control_valid_dict(ws, ledger, breaker, clock):
    raw = task(ws).model_dump(mode="json")
    assert run(Scripted(good_script), raw, ledger, breaker, clock).code is RunCode.SELF_REPORTED
    raw["permissions"]["approved_by"] = "me"
    out = run(Scripted(good_script), raw, ledger, breaker, clock)
    assert out.code is RunCode.TASK_INVALID and "approved_by" in out.reason


def test_workspace(home, ledger, breaker, clock):
    out = run(Scripted(good_script), task(home), ledger, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.WORKSPACE)


def test_stopped_before_start_control_released(ws, home, ledger, breaker, clock):
    StopSwitch(home).engage("freeze")
    out = run(Scripted(good_script), task(ws), ledger, breaker, clock)
    assert out.code is RunCode.STOPPED and "freeze" in out.reason
    StopSwitch(home).release()
    assert run(Scripted(good_script), task(ws), ledger, breaker, clock).code is RunCode.SELF_REPORTED


def test_stopped_mid_run_and_adapter_gets_the_switch(ws, home, ledger, breaker, clock):
    def script(gate: Gate, usage: Usage) -> Iterator[Any]:
        yield StepEvent()
        StopSwitch(home).engage("enough")
        yield StepEvent()
        yield FinishedEvent()

    adapter = Scripted(script)
    out = run(adapter, task(ws), ledger, breaker, clock)
    assert out.code is RunCode.STOPPED and out.evidence.steps == 1
    assert adapter.seen_stop is not None and adapter.seen_stop() == "enough"


@pytest.mark.parametrize("avail", ["down", "raises", "wrong type"])
def test_unavailable(ws, ledger, breaker, clock, avail):
    adapter = Scripted(good_script, available=Availability(available=False, reason="not installed"))
    if avail == "raises":
        adapter.available = lambda: 1 / 0  # type: ignore[method-assign]
    elif avail == "wrong type":
        adapter.available = lambda: True  # type: ignore[method-assign]
    out = run(adapter, task(ws), ledger, breaker, clock)
    assert out.code is RunCode.UNAVAILABLE


def test_circuit_open_control_closed(ws, ledger, breaker, clock):
    for _ in range(3):
        breaker.record("scripted", Signal.failure)
    out = run(Scripted(good_script), task(ws), ledger, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.CIRCUIT_OPEN)
    assert run(Scripted(good_script, name="other"), task(ws), ledger, breaker, clock).code is RunCode.SELF_REPORTED


def test_failing_runs_open_the_breaker(ws, ledger, breaker, clock):
    def broken(gate: Gate, usage: Usage) -> Iterator[Any]:
        raise ConnectionError("backend 502")
        yield

    for _ in range(3):
        assert run(Scripted(broken), task(ws), ledger, breaker, clock).code is RunCode.ADAPTER_ERROR
    assert run(Scripted(good_script), task(ws), ledger, breaker, clock).code is RunCode.CIRCUIT_OPEN


def test_dry_run_trial_releases_the_half_open_breaker(ws, ledger, breaker, clock):
    for _ in range(3):
        breaker.record("scripted", Signal.failure)
    clock.now += 60
    assert run(Scripted(shell_script), task(ws), ledger, breaker, clock).code is RunCode.DRY_RUN
    st = breaker.status("scripted")
    assert st.state is BreakerState.half_open and st.trial_at is None
    assert run(Scripted(good_script), task(ws), ledger, breaker, clock).code is RunCode.SELF_REPORTED
    assert breaker.status("scripted").state is BreakerState.closed


def test_rate_limited_backs_off(ws, ledger, breaker, clock):
    def limited(gate: Gate, usage: Usage) -> Iterator[Any]:
        yield StepEvent()
        raise BackendRateLimited("429", retry_after_s=30)

    out = run(Scripted(limited), task(ws), ledger, breaker, clock)
    assert out.code is RunCode.RATE_LIMITED
    assert run(Scripted(good_script), task(ws), ledger, breaker, clock).code is RunCode.RATE_LIMITED
    clock.now += 30
    assert run(Scripted(good_script), task(ws), ledger, breaker, clock).code is RunCode.SELF_REPORTED


def test_adapter_error_inside_and_at_call(ws, ledger, breaker, clock):
    def boom(gate: Gate, usage: Usage) -> Iterator[Any]:
        yield StepEvent()
        raise KeyError("oops")

    assert run(Scripted(boom), task(ws), ledger, breaker, clock).code is RunCode.ADAPTER_ERROR

    class RaisesAtRun(Scripted):
        def run(self, task, *, gate, usage, stop):  # type: ignore[override]
            raise RuntimeError("no")

    assert run(RaisesAtRun(good_script), task(ws), ledger, breaker, clock).code is RunCode.ADAPTER_ERROR


@pytest.mark.parametrize("bad", [{"kind": "bogus"}, "step", {"kind": "finished", "extra": 1}, 42])
def test_malformed_event(ws, ledger, breaker, clock, bad):
    def script(gate: Gate, usage: Usage) -> Iterator[Any]:
        yield StepEvent()
        yield bad

    assert run(Scripted(script), task(ws), ledger, breaker, clock).code is RunCode.MALFORMED_EVENT


def test_no_finish(ws, ledger, breaker, clock):
    def script(gate: Gate, usage: Usage) -> Iterator[Any]:
        yield StepEvent()

    out = run(Scripted(script), task(ws), ledger, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.NO_FINISH)


def test_step_limit_control_at_limit(ws, ledger, breaker, clock):
    def steps(n: int) -> Script:
        def script(gate: Gate, usage: Usage) -> Iterator[Any]:
            for _ in range(n):
                yield StepEvent()
            yield FinishedEvent()
        return script

    assert run(Scripted(steps(2)), task(ws, max_steps=2), ledger, breaker, clock).code is RunCode.SELF_REPORTED
    out = run(Scripted(steps(3)), task(ws, max_steps=2), ledger, breaker, clock)
    assert out.code is RunCode.STEP_LIMIT and "max_steps of 2 (steps=3)" in out.reason


def test_step_limit_capped_by_policy_ceiling(ws, ledger, breaker, clock):
    from proctor.mechanisms.policy.trusted import Ceilings

    def many(gate: Gate, usage: Usage) -> Iterator[Any]:
        assert usage.limits.max_steps == 2
        while True:
            yield StepEvent()

    out = run(Scripted(many), task(ws, max_steps=1000), ledger, breaker, clock,
              policy=Policy(ceilings=Ceilings(max_steps=2)))
    assert out.code is RunCode.STEP_LIMIT


def test_deadline_control_within(ws, ledger, breaker, clock):
    def slow(seconds: float) -> Script:
        def script(gate: Gate, usage: Usage) -> Iterator[Any]:
            yield StepEvent()
            clock.now += seconds
            assert usage.remaining_s() == max(0.0, 10 - usage.elapsed_s())
            yield StepEvent()
            yield FinishedEvent()
        return script

    assert run(Scripted(slow(9)), task(ws, wall_clock_s=10), ledger, breaker, clock).code is RunCode.SELF_REPORTED
    out = run(Scripted(slow(11)), task(ws, wall_clock_s=10), ledger, breaker, clock)
    assert out.code is RunCode.DEADLINE and "wall_clock_s of 10" in out.reason


@pytest.mark.parametrize("which", ["never decided", "refused"])
def test_ungated_tool_control_granted(ws, ledger, breaker, clock, which):
    def script(gate: Gate, usage: Usage) -> Iterator[Any]:
        gate.decide(ToolCall(tool="read", paths=("a.py",), call_id="ok"))
        yield ToolResultEvent(call_id="ok")  # control: granted
        gate.decide(ToolCall(tool="read", paths=("/etc/passwd",), call_id="refused"))
        yield ToolResultEvent(call_id="refused" if which == "refused" else "ghost")
        yield FinishedEvent()

    out = run(Scripted(script), task(ws), ledger, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.UNGATED_TOOL)


def test_ledger_failure_is_its_own_code(ws, tmp_path, breaker, clock):
    led = Ledger(tmp_path / "other.sqlite3")
    led.close()
    out = run(Scripted(good_script), task(ws), led, breaker, clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.LEDGER_FAILED)


def test_ledger_failure_mid_run_even_if_adapter_swallows_it(ws, ledger, breaker, clock):
    def script(gate: Gate, usage: Usage) -> Iterator[Any]:
        yield StepEvent()
        ledger.close()
        try:
            gate.decide(ToolCall(tool="read", paths=("a.py",), call_id="r"))
        except Exception:  # noqa: BLE001 - a careless adapter
            pass
        yield ToolResultEvent(call_id="r")
        yield FinishedEvent()

    assert run(Scripted(script), task(ws), ledger, breaker, clock).code is RunCode.LEDGER_FAILED


def test_internal_error_never_raises(ws, ledger, breaker, clock):
    broken_policy: Any = None
    out = run_agent(Scripted(good_script), task(ws), policy=broken_policy, breaker=breaker, ledger=ledger, clock=clock)
    assert (out.verdict, out.code) == (Verdict.blocked_escalated, RunCode.INTERNAL_ERROR)


def test_every_run_code_is_reached_by_this_file():
    import re

    text = Path(__file__).read_text()
    assert {c.value for c in RunCode} <= set(re.findall(r"RunCode\.([A-Z_]+)", text))
