"""The run loop for in-process adapters: one declared task, one adapter, every call through the gate.

Owns `AgentRuntime` (the adapter seam), its events, and `run_agent`, which turns whatever an adapter does
into an `Outcome` with a stable code, and never raises. It never runs a tool itself and never trusts what
the agent says about its own work: `claimed_status` is kept apart, and `evidence.independent_check` is filled
only by a check proctor ran (the host fills it with validation results for run-agent jobs).

Each run writes `run.start` before the adapter is touched, `gate.decision` / `gate.refusal` for every call
before it takes effect, and `run.end`, all under one job id. The stop switch is checked before every step;
a CLI adapter gets `stop` to poll while its process runs and `usage.remaining_s()` for its deadline.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.breaker import Breaker, Signal
from proctor.mechanisms.policy.gate import CallVerdict, Decision, Gate
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Ceilings, Policy, check_workspace

_CLOSED = ConfigDict(extra="forbid", frozen=True)


class Availability(BaseModel):
    model_config = _CLOSED

    available: bool
    reason: str = ""
    version: str | None = None


class StepEvent(BaseModel):
    """The agent took one step (a model turn); counted against max_steps."""

    model_config = _CLOSED

    kind: Literal["step"] = "step"
    note: str = ""


class ToolResultEvent(BaseModel):
    """The result of a call the gate let run (or dry-run); a result for any other call is UNGATED_TOOL."""

    model_config = _CLOSED

    kind: Literal["tool_result"] = "tool_result"
    call_id: str
    output: Any = None
    ok: bool = True


class FinishedEvent(BaseModel):
    """The agent says it is done. `claimed_status` is its claim, recorded and never believed."""

    model_config = _CLOSED

    kind: Literal["finished"] = "finished"
    output: str = ""
    claimed_status: str | None = None


AgentEvent = StepEvent | ToolResultEvent | FinishedEvent
_EVENT: TypeAdapter[AgentEvent] = TypeAdapter(Annotated[AgentEvent, Field(discriminator="kind")])
_EVENT_TYPES = (StepEvent, ToolResultEvent, FinishedEvent)


class BackendRateLimited(Exception):
    """Raised by an adapter whose backend said "slow down"; the breaker backs off instead of counting it."""

    def __init__(self, message: str = "rate limited", *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Usage:
    """What the run has used so far, read by the adapter; only the loop advances it."""

    def __init__(self, limits: Ceilings, clock: Callable[[], float], started: float, gate: Gate) -> None:
        self.limits = limits
        self._clock = clock
        self._started = started
        self._gate = gate
        self._steps = 0

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def tool_calls(self) -> int:
        return self._gate.granted_calls

    def elapsed_s(self) -> float:
        return self._clock() - self._started

    def remaining_s(self) -> float:
        """Seconds left before the run's deadline (never negative): a CLI adapter's process deadline."""
        return max(0.0, self.limits.wall_clock_s - self.elapsed_s())

    def _step(self) -> int:
        self._steps += 1
        return self._steps


@runtime_checkable
class AgentRuntime(Protocol):
    """An adapter the loop can drive. `run` yields events and asks `gate.decide(call)` before every call."""

    name: str

    def available(self) -> Availability: ...

    def run(
        self, task: AgentTask, *, gate: Gate, usage: Usage, stop: Callable[[], str | None]
    ) -> Iterator[AgentEvent | Mapping[str, Any]]: ...


class Verdict(StrEnum):
    blocked_escalated = "blocked-escalated"
    """Proctor stopped or refused the run; a person has to look."""
    qualified_draft = "qualified-draft"
    """The agent finished; its work is a draft qualified by how much was checked."""


class RunCode(StrEnum):
    """Stable codes of a run's outcome; additive only, never renamed."""

    SELF_REPORTED = "SELF_REPORTED"
    DRY_RUN = "DRY_RUN"
    NOT_AN_ADAPTER = "NOT_AN_ADAPTER"
    TASK_INVALID = "TASK_INVALID"
    WORKSPACE = "WORKSPACE"
    STOPPED = "STOPPED"
    UNAVAILABLE = "UNAVAILABLE"
    CIRCUIT_OPEN = "CIRCUIT_OPEN"
    RATE_LIMITED = "RATE_LIMITED"
    ADAPTER_ERROR = "ADAPTER_ERROR"
    MALFORMED_EVENT = "MALFORMED_EVENT"
    NO_FINISH = "NO_FINISH"
    STEP_LIMIT = "STEP_LIMIT"
    DEADLINE = "DEADLINE"
    UNGATED_TOOL = "UNGATED_TOOL"
    LEDGER_FAILED = "LEDGER_FAILED"
    INTERNAL_ERROR = "INTERNAL_ERROR"


# What each ending shows of the adapter's backend, for its breaker (see breaker.py).
_SIGNAL: dict[RunCode, Signal] = {
    RunCode.SELF_REPORTED: Signal.success,
    RunCode.STEP_LIMIT: Signal.success,
    RunCode.RATE_LIMITED: Signal.rate_limited,
    RunCode.ADAPTER_ERROR: Signal.failure,
    RunCode.MALFORMED_EVENT: Signal.failure,
    RunCode.NO_FINISH: Signal.failure,
    RunCode.DEADLINE: Signal.failure,
}


class Evidence(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = 0
    granted_calls: int = 0
    refused_calls: int = 0
    dry_run_calls: int = 0
    live_outward_calls: int = 0
    independent_check: list[str] | None = None
    """Filled only by a check proctor ran itself (run-agent jobs: `"<cmd> => exit N"` per validation)."""


class Outcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verdict: Verdict
    code: RunCode
    reason: str
    adapter: str
    job_id: str
    dry_run: bool
    output: str | None = None
    claimed_status: str | None = None
    """What the agent said of its own work; never used to decide the verdict."""
    evidence: Evidence = Field(default_factory=Evidence)
    duration_s: float = 0.0


class _RecordFailed(Exception):
    """The ledger refused a decision row; the call it records must not take effect (the loop then ends with
    LEDGER_FAILED through `_Recorder.failure`, even if the adapter swallowed this)."""


class _Recorder:
    """Writes a run's decisions to the ledger and counts them for the evidence."""

    def __init__(self, ledger: Ledger, job_id: str) -> None:
        self.ledger = ledger
        self.job_id = job_id
        self.failure: str | None = None
        self.evidence = Evidence()

    def append(self, kind: str, payload: dict[str, Any]) -> bool:
        try:
            self.ledger.append(kind, payload, job_id=self.job_id)
        except Exception as exc:  # noqa: BLE001 - any ledger failure becomes LEDGER_FAILED, never a crash
            self.failure = self.failure or f"ledger append {kind!r} failed: {exc}"
            return False
        return True

    def decision(self, d: Decision) -> None:
        refused = d.verdict is CallVerdict.refused
        if not self.append("gate.refusal" if refused else "gate.decision", d.to_dict()):
            raise _RecordFailed(self.failure)
        ev = self.evidence
        if refused:
            ev.refused_calls += 1
            return
        ev.granted_calls += 1
        if d.verdict is CallVerdict.dry_run:
            ev.dry_run_calls += 1
        elif d.outward:
            ev.live_outward_calls += 1


class _End(Exception):
    """How the loop leaves early: an ending code and its reason."""

    def __init__(self, code: RunCode, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.retry_after_s = retry_after_s


def run_agent(
    adapter: object,
    task: AgentTask | Mapping[str, Any],
    *,
    policy: Policy,
    dry_run: bool = True,
    breaker: Breaker,
    ledger: Ledger,
    stop: StopSwitch | None = None,
    clock: Callable[[], float] | None = None,
    job_id: str | None = None,
) -> Outcome:
    """Run `task` with `adapter` under `policy`; never raises.

    `dry_run=False` makes the run live (outward calls really run). `stop` defaults to the `$PROCTOR_HOME`
    switch, `clock` (monotonic seconds, for the deadline) to `time.monotonic`, `job_id` to a fresh one.
    """
    clock = clock or time.monotonic
    stop_reason = (stop or StopSwitch()).reason
    job_id = job_id or uuid.uuid4().hex
    name = _name_of(adapter)
    started = clock()
    rec = _Recorder(ledger, job_id)
    run = _Run(adapter, name, policy, dry_run, rec, stop_reason, clock, started)
    out = run.out
    try:
        code, reason = _run(run, task, breaker)
    except Exception as exc:  # noqa: BLE001 - a bug in proctor is still an outcome, never a traceback
        code, reason = RunCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}"
    if code in (RunCode.SELF_REPORTED, RunCode.DRY_RUN) and rec.failure is None:
        verdict = Verdict.qualified_draft
    else:
        verdict = Verdict.blocked_escalated
    outcome = Outcome(
        verdict=verdict, code=code, reason=reason, adapter=name, job_id=job_id, dry_run=dry_run,
        output=out.get("output"), claimed_status=out.get("claimed_status"), evidence=rec.evidence,
        duration_s=round(clock() - started, 6),
    )
    end = {"adapter": name, "verdict": verdict.value, "code": code.value, "reason": reason,
           "claimed_status": outcome.claimed_status, **rec.evidence.model_dump(exclude={"independent_check"})}
    if not rec.append("run.end", end) or rec.failure is not None:
        outcome = outcome.model_copy(update={
            "verdict": Verdict.blocked_escalated, "code": RunCode.LEDGER_FAILED, "reason": rec.failure or reason,
        })
    return outcome


def _name_of(adapter: object) -> str:
    try:
        name = getattr(adapter, "name", None)
    except Exception:  # noqa: BLE001 - a property that raises still names nothing
        name = None
    return name if isinstance(name, str) and name else type(adapter).__name__


@dataclass(frozen=True)
class _Run:
    """One run as `run_agent` set it up: what the checks and the loop read, and `out`, where the loop puts
    the adapter's finished event."""

    adapter: object
    name: str
    policy: Policy
    dry_run: bool
    rec: _Recorder
    stop_reason: Callable[[], str | None]
    clock: Callable[[], float]
    started: float
    out: dict[str, Any] = field(default_factory=dict)


def _run(run: _Run, task: AgentTask | Mapping[str, Any], breaker: Breaker) -> tuple[RunCode, str]:
    adapter, name, dry_run, rec, stop_reason = run.adapter, run.name, run.dry_run, run.rec, run.stop_reason
    goal = task.goal if isinstance(task, AgentTask) else None
    if not rec.append("run.start", {"adapter": name, "goal": goal, "dry_run": dry_run}):
        return RunCode.LEDGER_FAILED, rec.failure or "ledger append failed"
    if not isinstance(adapter, AgentRuntime):
        return RunCode.NOT_AN_ADAPTER, f"{name} is not an AgentRuntime (needs name, available(), run())"
    if not isinstance(task, AgentTask):
        try:
            task = AgentTask.model_validate(task)
        except ValidationError as exc:
            err = exc.errors()[0]
            return RunCode.TASK_INVALID, f"task invalid: {'.'.join(map(str, err['loc']))}: {err['msg']}"
    stopped = stop_reason()
    if stopped is not None:
        return RunCode.STOPPED, f"stopped: {stopped}"
    problem = check_workspace(task.permissions.workspace)
    if problem is not None:
        return RunCode.WORKSPACE, problem
    try:
        avail = adapter.available()
    except Exception as exc:  # noqa: BLE001 - the adapter's bug, reported as its code
        return RunCode.UNAVAILABLE, f"{name}.available() raised {type(exc).__name__}: {exc}"
    if not isinstance(avail, Availability) or not avail.available:
        why = avail.reason if isinstance(avail, Availability) else f"available() returned {type(avail).__name__}"
        return RunCode.UNAVAILABLE, f"{name} is unavailable: {why}"
    try:
        admission = breaker.admit(name, job_id=rec.job_id)
    except Exception as exc:  # noqa: BLE001 - the breaker's state lives in the ledger file
        return RunCode.LEDGER_FAILED, f"breaker state unreadable: {exc}"
    if not admission.allowed:
        return RunCode(admission.code.value), admission.reason
    code, reason, retry_after = RunCode.INTERNAL_ERROR, "the loop did not finish", None
    try:
        code, reason = _loop(run, adapter, task)
    except _End as end:
        code, reason, retry_after = end.code, end.reason, end.retry_after_s
    finally:
        signal = Signal.neutral if rec.failure else _SIGNAL.get(code, Signal.neutral)
        try:
            breaker.record(name, signal, retry_after_s=retry_after, job_id=rec.job_id)
        except Exception as exc:  # noqa: BLE001
            rec.failure = rec.failure or f"breaker state not recorded: {exc}"
    return code, reason


def _loop(run: _Run, adapter: AgentRuntime, task: AgentTask) -> tuple[RunCode, str]:
    rec, stop_reason, out = run.rec, run.stop_reason, run.out
    gate = Gate(task, policy=run.policy, dry_run=run.dry_run, stop=stop_reason, on_decision=rec.decision)
    usage = Usage(gate.limits, run.clock, run.started, gate)

    def checkpoint() -> None:
        if rec.failure is not None:
            raise _End(RunCode.LEDGER_FAILED, rec.failure)
        stopped = stop_reason()
        if stopped is not None:
            raise _End(RunCode.STOPPED, f"stopped: {stopped}")
        late = gate.limits.check_wall_clock(usage.elapsed_s())
        if late is not None:
            raise _End(RunCode.DEADLINE, late)

    checkpoint()
    try:
        events = iter(adapter.run(task, gate=gate, usage=usage, stop=stop_reason))
    except Exception as exc:  # noqa: BLE001
        raise _End(RunCode.ADAPTER_ERROR, f"run() raised {type(exc).__name__}: {exc}") from None
    try:
        while True:
            checkpoint()
            # After any ending of next(), a stop, the deadline or a ledger failure explains it first: a CLI
            # adapter whose process proctor killed reports that as an error or an early end.
            try:
                raw = next(events)
            except StopIteration:
                checkpoint()
                raise _End(RunCode.NO_FINISH, "the adapter ended without a finished event") from None
            except BackendRateLimited as exc:
                checkpoint()
                raise _End(RunCode.RATE_LIMITED, f"backend rate limited: {exc}", exc.retry_after_s) from None
            except Exception as exc:  # noqa: BLE001 - the adapter's bug, reported as its code
                checkpoint()
                raise _End(RunCode.ADAPTER_ERROR, f"the adapter raised {type(exc).__name__}: {exc}") from None
            checkpoint()
            try:
                event = raw if isinstance(raw, _EVENT_TYPES) else _EVENT.validate_python(raw)
            except ValidationError as exc:
                raise _End(RunCode.MALFORMED_EVENT, f"malformed event: {exc.errors()[0]['msg']}") from None
            if isinstance(event, StepEvent):
                rec.evidence.steps = usage._step()
                over = gate.limits.check_steps(usage.steps)
                if over is not None:
                    raise _End(RunCode.STEP_LIMIT, over)
            elif isinstance(event, ToolResultEvent):
                if gate.verdict_for(event.call_id) not in (CallVerdict.run, CallVerdict.dry_run):
                    why = f"a result for call {event.call_id!r}, which the gate never let run"
                    raise _End(RunCode.UNGATED_TOOL, why)
            else:
                out["output"], out["claimed_status"] = event.output, event.claimed_status
                if rec.evidence.dry_run_calls and not rec.evidence.live_outward_calls:
                    return RunCode.DRY_RUN, "finished; its outward calls were dry runs, and its claim is self-reported"
                return RunCode.SELF_REPORTED, "finished; its claim is self-reported, nothing independent checked it"
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001, S110 - a generator misbehaving on close changes nothing decided
                pass
