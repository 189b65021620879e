"""The circuit breaker: per credential pool (an adapter and the key it uses), N consecutive backend failures
open it for a cooldown.

Owns the breaker's state (a table in the ledger's file, changed in the same transaction as the ledger row
that records each transition) and the rules of its three states. It never runs an agent and never decides
what an outcome was: callers report each run's `Signal` with `record` (`evidence_for` turns a job's result
into one, and says what it was read from).

    closed     every run is admitted. A failure adds one; `threshold` in a row opens it. A success resets
               the count. A rate limit only backs off: the count stays, runs wait until the backoff ends.
    open       runs are refused with CIRCUIT_OPEN until `cooldown_s` has passed, then it is half-open.
    half_open  one trial run is admitted; further runs are refused while it is out. Its success closes the
               breaker, its failure opens it again, and an outcome that shows nothing of the backend (a dry
               run, a stop, a refusal) releases the trial so the next run becomes the trial. A trial never
               reported within `cooldown_s` (its process died) is released too.

Time is wall-clock seconds from the injectable `clock`, because state is shared between processes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from proctor.contract import Code, Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.ledger.rows import Entry

TRANSITION_KIND = "breaker.transition"


class BreakerState(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


class Signal(StrEnum):
    """What one run showed of the adapter's backend."""

    success = "success"
    """The backend answered (whatever the task's fate)."""
    failure = "failure"
    """A backend/server error, a hang, a crash: counts toward opening."""
    rate_limited = "rate_limited"
    """Backs off only; never counts toward opening."""
    neutral = "neutral"
    """Shows nothing of the backend: dry run, stop, refusal, invalid request."""


@dataclass(frozen=True)
class BreakerStatus:
    adapter: str
    state: BreakerState
    failures: int
    opened_at: float | None
    trial_at: float | None
    backoff_until: float | None


@dataclass(frozen=True)
class Admission:
    """`allowed`, or refused with `code` (CIRCUIT_OPEN, or RATE_LIMITED while backing off) and `retry_at`."""

    allowed: bool
    code: Code
    reason: str
    trial: bool = False
    """This run is the half-open trial: report its outcome with `record`, whatever happens."""
    retry_at: float | None = None


@dataclass(frozen=True)
class Evidence:
    """The signal one run gives its pool's breaker, and what the host read it from (said in the result)."""

    signal: Signal
    source: str


def evidence_for(status: Status, code: Code, backend_status: int | None = None, backend_source: str = "") -> Evidence:
    """How a run_agent job's result counts for its pool's breaker. It reads what the host can trust — the exit
    (through `status`/`code`), its own deadline, and an HTTP status in a field of the CLI's protocol
    (`backend_status`) — never the text an agent printed: one agent's words must not back off or open the
    pool for every other job on it.

    HTTP 429: back off. HTTP 5xx: a failure. Completed or failed validation: the backend answered. An agent
    that exited nonzero or hung: a failure, like any crash — unless its text read as a rate limit: that job
    is `rate_limited` itself, but the text is the agent's claim and moves nothing shared (neutral). Anything
    proctor refused or cut short on its own (stop, cancel, invalid request, approval prompt, confinement, an
    open breaker, a resource limit): neutral.
    """
    if backend_status == 429:
        return Evidence(Signal.rate_limited, f"HTTP 429 in the CLI's {backend_source}")
    if backend_status is not None and backend_status >= 500:
        return Evidence(Signal.failure, f"HTTP {backend_status} in the CLI's {backend_source}")
    if status is Status.completed or code is Code.VALIDATION_FAILED:
        return Evidence(Signal.success, "the agent exited 0")
    if status is Status.timed_out or code is Code.TIMED_OUT:
        return Evidence(Signal.failure, "the agent ran to the job's deadline")
    if code is Code.AGENT_FAILED:
        return Evidence(Signal.failure, "the agent exited nonzero")
    if status is Status.rate_limited:
        return Evidence(Signal.neutral, "the agent exited nonzero and its text read as a rate limit: a claim, "
                                        "which moves nothing shared (a status in the CLI's protocol would)")
    return Evidence(Signal.neutral, f"{code.value}: shows nothing of the backend")


class Breaker:
    """`Breaker(ledger, *, threshold=3, cooldown_s=300, backoff_s=60, clock=time.time)`.

    Before a run: `admission = breaker.admit(adapter)`; if not `admission.allowed`, refuse with its code.
    After the run: `breaker.record(adapter, signal, retry_after_s=None)`. `status(adapter)` only reads.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        threshold: int = 3,
        cooldown_s: float = 300.0,
        backoff_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if threshold < 1 or cooldown_s <= 0 or backoff_s < 0:
            raise ValueError("breaker needs threshold >= 1, cooldown_s > 0, backoff_s >= 0")
        self._ledger = ledger
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.backoff_s = backoff_s
        self._clock = clock

    def status(self, adapter: str) -> BreakerStatus:
        return self._ledger.read(lambda db: _load(db, adapter))

    def admit(self, adapter: str, *, job_id: str | None = None) -> Admission:
        """May a run of `adapter` start now? In half-open this hands out the one trial."""

        def apply(db: sqlite3.Connection) -> tuple[Admission, list[Entry]]:
            now = self._clock()
            st = _load(db, adapter)
            entries: list[Entry] = []
            if st.backoff_until is not None and now < st.backoff_until:
                why = f"{adapter}: backing off after a rate limit"
                return Admission(False, Code.RATE_LIMITED, why, retry_at=st.backoff_until), entries
            if st.state is BreakerState.open:
                reopen_at = (now if st.opened_at is None else st.opened_at) + self.cooldown_s
                if now < reopen_at:
                    why = f"{adapter}: circuit open after {st.failures} consecutive failures"
                    return Admission(False, Code.CIRCUIT_OPEN, why, retry_at=reopen_at), entries
                half = BreakerState.half_open
                entries.append(self._transition(adapter, st.state, half, "cooldown over", st.failures, job_id))
                st = _save(db, st, state=half, trial_at=None)
            if st.state is BreakerState.half_open:
                if st.trial_at is not None and now < st.trial_at + self.cooldown_s:
                    why = f"{adapter}: half-open, a trial run is out"
                    return Admission(False, Code.CIRCUIT_OPEN, why, retry_at=st.trial_at + self.cooldown_s), entries
                _save(db, st, trial_at=now)
                return Admission(True, Code.OK, f"{adapter}: half-open trial", trial=True), entries
            return Admission(True, Code.OK, f"{adapter}: closed"), entries

        return self._ledger.update(apply)[0]

    def record(
        self, adapter: str, signal: Signal, *, retry_after_s: float | None = None, job_id: str | None = None
    ) -> BreakerStatus:
        """Report what a run showed of the backend; the new status. `retry_after_s` is a rate limit's reset."""

        def apply(db: sqlite3.Connection) -> tuple[BreakerStatus, list[Entry]]:
            now = self._clock()
            st = _load(db, adapter)
            entries: list[Entry] = []

            def move(to: BreakerState, why: str, **changes: Any) -> BreakerStatus:
                failures = changes.get("failures", st.failures)
                entries.append(self._transition(adapter, st.state, to, why, failures, job_id))
                return _save(db, st, state=to, **changes)

            if signal is Signal.success:
                if st.state is BreakerState.closed:
                    st = _save(db, st, failures=0)
                else:
                    half = st.state is BreakerState.half_open
                    why = "trial succeeded" if half else "a run admitted before it opened succeeded"
                    st = move(BreakerState.closed, why, failures=0, opened_at=None, trial_at=None)
            elif signal is Signal.failure:
                failures = st.failures + 1
                if st.state is BreakerState.half_open:
                    st = move(BreakerState.open, "trial failed", failures=failures, opened_at=now, trial_at=None)
                elif st.state is BreakerState.closed and failures >= self.threshold:
                    st = move(BreakerState.open, f"{failures} consecutive failures", failures=failures, opened_at=now)
                else:
                    st = _save(db, st, failures=failures)
            elif signal is Signal.rate_limited:
                wait = self.backoff_s if retry_after_s is None else max(0.0, min(retry_after_s, self.cooldown_s))
                st = _save(db, st, backoff_until=now + wait, trial_at=None)
            elif st.state is BreakerState.half_open:
                st = _save(db, st, trial_at=None)
            return st, entries

        # A job's outcome must reach the breaker even on a filling disk (a half-open trial held forever).
        return self._ledger.update(apply, reserve=True)[0]

    def _transition(
        self, adapter: str, old: BreakerState, new: BreakerState, why: str, failures: object, job_id: str | None
    ) -> Entry:
        payload = {"adapter": adapter, "from": old.value, "to": new.value, "reason": why, "failures": failures,
                   "at": self._clock()}
        return Entry(TRANSITION_KIND, payload, job_id)


def _load(db: sqlite3.Connection, adapter: str) -> BreakerStatus:
    row = db.execute(
        "SELECT state, failures, opened_at, trial_at, backoff_until FROM breaker WHERE adapter = ?", (adapter,)
    ).fetchone()
    if row is None:
        return BreakerStatus(adapter, BreakerState.closed, 0, None, None, None)
    return BreakerStatus(adapter, BreakerState(row[0]), row[1], row[2], row[3], row[4])


def _save(db: sqlite3.Connection, st: BreakerStatus, **changes: Any) -> BreakerStatus:
    new = replace(st, **changes)
    db.execute(
        "INSERT OR REPLACE INTO breaker (adapter, state, failures, opened_at, trial_at, backoff_until)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (new.adapter, new.state.value, new.failures, new.opened_at, new.trial_at, new.backoff_until),
    )
    return new
