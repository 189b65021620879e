"""The spend governor: before anything launches, a job books its estimate against every budget that covers
it; after the run, the booking is settled with what the CLI itself reported, or released if nothing ran.

Owns the rules of a budget's windows and the compare-and-set loop over the tally (proctor.mechanisms.policy.tally): read the
budget's value and revision, compute the new value, write it only if the revision did not move, else read
again. Two hosts racing for a budget's last unit both compute a booking from the same revision; the server
(or SQLite) takes exactly one write, and the loser reads the winner's value and is denied. It never reads
the policy file (the caller gives the budgets) and never writes the ledger: it returns results with stable
codes (`Booking`, `Denial`, `Settlement`) whose `record()` the host writes as rows.

A job covered by several budgets is looked at against all of them first, writing nothing, so a denial names
every limit it is over and the latest time one frees. Then it books each in name order; a booking that loses
its race to the last unit releases the ones already made (a compensating compare-and-set). So no limit is
ever passed; two jobs racing over overlapping budgets may, rarely, both be denied where one could have run.

Windows (proctor.mechanisms.policy.budget): fixed, UTC-aligned hours and days, both kept for every budget. A booking counts in
the windows current when it was made; settling or releasing it changes those windows only while they are
current (a window that closed meanwhile keeps the estimate: its spend is history, and in the ledger).
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proctor.mechanisms.adapters.output import Usage
from proctor.contract import Code
from proctor.mechanisms.policy.budget import Amount, Budget, covering, usd_micros
from proctor.mechanisms.policy.tally import Tally, TallyError
from proctor.mechanisms.policy.windows import (
    KEY_PREFIX,
    Over,
    PoolSpend,
    Window,
    encode,
    iso,
    key_for,
    ops_of,
    over_limits,
    windows_of,
)

# Compare-and-set attempts before a booking gives up (BUDGET_UNAVAILABLE). Each lost attempt means another
# host's write went in, so this many only under a storm of bookings on one budget.
MAX_TRIES = 200


@dataclass(frozen=True)
class Booked:
    """One budget's part of a booking: what was added and to which windows (period -> start)."""

    budget: str
    amount: Amount
    windows: tuple[tuple[str, int], ...]

    def record(self) -> dict[str, Any]:
        return {"budget": self.budget, "booked": self.amount.as_dict(), "windows": dict(self.windows)}


@dataclass
class Prebooked:
    """A booking made before its job was asked (a race books all its runs at once), handed to the job. The
    job `take`s it at admission and from then on settles or releases it as its own; one never taken (the
    job refused before admission) is the booker's to release. Exactly one of the two does, never both."""

    booking: Booking
    taken: bool = False

    def take(self) -> Booking:
        self.taken = True
        return self.booking


@dataclass(frozen=True)
class Booking:
    """Admitted: the run may launch. Settle it after the run (`settle`), or `release` it if nothing ran.
    Without a covering budget it books nothing (`parts` empty) and settling it does nothing."""

    job_id: str
    agent: str
    lane: str | None
    store: str | None
    parts: tuple[Booked, ...] = ()
    code: Code = Code.OK
    allowed: bool = True

    def record(self) -> dict[str, Any]:
        return {"jobId": self.job_id, "pool": {"agent": self.agent, "lane": self.lane}, "store": self.store,
                "budgets": [p.record() for p in self.parts]}


@dataclass(frozen=True)
class Denial:
    """Refused before anything launched: BUDGET_DENIED (a limit would be passed; `retry_at` is when the last
    of the windows in `over` frees) or BUDGET_UNAVAILABLE (the tally could not be reached or read)."""

    job_id: str
    agent: str
    lane: str | None
    store: str | None
    code: Code
    reason: str
    retry_at: int | None = None
    over: tuple[Over, ...] = ()
    allowed: bool = False

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"jobId": self.job_id, "pool": {"agent": self.agent, "lane": self.lane},
                               "store": self.store, "code": self.code.value, "reason": self.reason,
                               "denied": [o.record() for o in self.over]}
        if self.retry_at is not None:
            out["retry_after"] = iso(self.retry_at)
        return out


@dataclass(frozen=True)
class Settlement:
    """What a booking finally counted: per budget the change made (`charged` minus `booked`), `how` it was
    settled (`usage`: the CLI's report; `estimate`: the CLI said nothing, the estimate stands; `released`:
    nothing ran), the budgets whose booked windows had closed, and an error if the tally failed."""

    booking: Booking
    how: str
    charged: tuple[tuple[str, Amount], ...] = ()
    closed: tuple[str, ...] = ()
    error: str | None = None
    usage: dict[str, Any] | None = None

    def view(self) -> dict[str, Any]:
        """The result's `budget` field: per budget what was booked before launch and what it was charged."""
        charged = dict(self.charged)
        out: dict[str, Any] = {
            "store": self.booking.store, "pool": {"agent": self.booking.agent, "lane": self.booking.lane},
            "how": self.how,
            "budgets": [{"budget": p.budget, "booked": p.amount.as_dict(),
                         "charged": charged[p.budget].as_dict() if p.budget in charged else None}
                        for p in self.booking.parts]}
        if self.closed:
            out["closed_windows"] = list(self.closed)
        if self.error:
            out["error"] = self.error
        return out

    def record(self) -> dict[str, Any]:
        return {"jobId": self.booking.job_id, "store": self.booking.store, "how": self.how,
                "usage": self.usage, "charged": {name: a.as_dict() for name, a in self.charged},
                "closed_windows": list(self.closed), "error": self.error}


def _clamped(a: Amount) -> Amount:
    return Amount(max(0, a.runs), max(0, a.tokens), max(0, a.usd_micros))


@dataclass(frozen=True)
class Spend:
    """Where a job's spend is counted: the tally to open (only when a budget covers the job) and the queue
    lane it came on. What the caller chooses; the budgets themselves are always the trusted policy's."""

    tally: Callable[[], Tally]
    lane: str | None = None


@dataclass
class UsageGovernor:
    """`UsageGovernor(budgets, tally, lane=None)`: `tally` makes the store (opened only when a budget covers
    a job). `book(agent, job_id)` -> Booking | Denial; `settle(booking, usage)`; `release(booking)`;
    `spend()` -> the current windows of every budget. `lane`: the queue lane the job came on (None locally)."""

    budgets: Sequence[Budget]
    tally: Callable[[], Tally]
    lane: str | None = None
    clock: Callable[[], float] = time.time
    max_tries: int = MAX_TRIES
    conflicts: int = 0  # compare-and-set writes lost to another writer (read again and retried)
    _opened: Tally | None = field(default=None, repr=False)

    def _store(self) -> Tally:
        if self._opened is None:
            self._opened = self.tally()
        return self._opened

    @property
    def store(self) -> str | None:
        return self._opened.store if self._opened is not None else None

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    def covering(self, agent: str) -> tuple[Budget, ...]:
        return covering(tuple(self.budgets), agent, self.lane)

    def book(self, agent: str, job_id: str) -> Booking | Denial:
        budgets = self.covering(agent)
        if not budgets:
            return Booking(job_id, agent, self.lane, None)
        booked: list[Booked] = []
        try:
            tally = self._store()
            now = self.clock()
            # Look at every budget before writing any: the denial names each limit and the latest window end.
            over = [o for b in budgets for o in over_limits(b, windows_of(tally.get(key_for(b)), now, b.name),
                                                             b.estimate)]
            if over:
                return self._denied(job_id, agent, over)
            for b in budgets:
                got = self._book_one(tally, b, now)
                if isinstance(got, list):
                    self._undo(tally, booked)  # lost the last unit to another host: give back what we took
                    return self._denied(job_id, agent, got)
                booked.append(got)
        except TallyError as exc:
            if booked:
                try:
                    self._undo(self._store(), booked)
                except TallyError:
                    pass  # the tally is gone: what was booked stays booked (the safe side)
            return Denial(job_id, agent, self.lane, self.store, Code.BUDGET_UNAVAILABLE,
                          f"the spend of {', '.join(b.name for b in budgets)} cannot be counted: {exc}; "
                          "nothing was launched")
        return Booking(job_id, agent, self.lane, self.store, tuple(booked))

    def settle(self, booking: Booking, usage: Usage | None) -> Settlement:
        """Count what the run really used in place of its estimate: tokens in + out and dollars as the CLI
        reported them; what it did not report keeps the estimate (a cost codex never states, say)."""
        report = usage.as_dict() if usage is not None else None
        if usage is None:
            return Settlement(booking, "estimate", tuple((p.budget, p.amount) for p in booking.parts),
                              usage=report)
        charged = []
        for p in booking.parts:
            actual = Amount(p.amount.runs, usage.tokens if usage.tokens_stated else p.amount.tokens,
                            usd_micros(usage.usd) if usage.usd is not None else p.amount.usd_micros)
            charged.append((p, actual))
        return self._adjust(booking, "usage", charged, report)

    def release(self, booking: Booking) -> Settlement:
        """The run never launched: take its booking back out of every window still current."""
        return self._adjust(booking, "released", [(p, Amount()) for p in booking.parts], None)

    def spend(self) -> list[PoolSpend]:
        tally = self._store()
        now = self.clock()
        return [PoolSpend(b, windows_of(tally.get(key_for(b)), now, b.name))
                for b in sorted(self.budgets, key=lambda b: b.name)]

    def _denied(self, job_id: str, agent: str, over: list[Over]) -> Denial:
        reason = "; ".join(o.line() for o in over) + "; nothing was launched"
        return Denial(job_id, agent, self.lane, self.store, Code.BUDGET_DENIED, reason,
                      max(o.retry_at for o in over), tuple(over))

    # -- the compare-and-set loop -------------------------------------------------------------------

    def _change(self, tally: Tally, key: str, change: Callable[[dict[str, Window]], tuple[dict[str, Window] | None, Any]],
                now: float) -> Any:
        """Apply `change` to the key's current windows until a write of it goes in unopposed; `change`
        returning no new windows ends the loop without a write (a denial, nothing to do).

        Each write carries this call's id among the value's last OPS_KEPT: a write that went in but whose
        reply was lost (a failover; the store retries the request, which then loses to itself) is found in
        the value read next and not applied a second time."""
        op = secrets.token_hex(8)
        out: Any = None  # what the attempt whose write went in decided
        for attempt in range(self.max_tries):
            found = tally.get(key)
            if attempt and op in ops_of(found):
                return out  # our earlier write went in: its reply was lost, not the write
            new, out = change(windows_of(found, now, key))
            if new is None:
                return out
            data = encode(new, [*ops_of(found), op])
            revision = tally.create(key, data) if found is None else tally.update(key, data, found.revision)
            if revision is not None:
                return out
            self.conflicts += 1
            # Another writer went in between our read and our write: read its value and decide again. A
            # little jitter keeps two hosts from colliding in lockstep.
            time.sleep(random.uniform(0, 0.0005 * min(attempt + 1, 20)))
        raise TallyError(f"{key}: {self.max_tries} compare-and-set attempts in a row lost to other writers")

    def _book_one(self, tally: Tally, budget: Budget, now: float) -> Booked | list[Over]:
        def change(windows: dict[str, Window]) -> tuple[dict[str, Window] | None, Booked | list[Over]]:
            over = over_limits(budget, windows, budget.estimate)
            if over:
                return None, over
            new = {p: Window(p, w.start, w.spent + budget.estimate) for p, w in windows.items()}
            return new, Booked(budget.name, budget.estimate, tuple((p, w.start) for p, w in windows.items()))

        return self._change(tally, key_for(budget), change, now)

    def _undo(self, tally: Tally, booked: list[Booked]) -> None:
        now = self.clock()
        for part in booked:
            self._change(tally, KEY_PREFIX + part.budget, _delta(part, Amount() - part.amount), now)

    def _adjust(self, booking: Booking, how: str, charged: list[tuple[Booked, Amount]],
                usage: dict[str, Any] | None) -> Settlement:
        done: list[tuple[str, Amount]] = []
        closed: list[str] = []
        try:
            tally = self._store() if charged else None
            now = self.clock()
            for part, actual in charged:
                delta = actual - part.amount
                if delta and tally is not None:
                    if not self._change(tally, KEY_PREFIX + part.budget, _delta(part, delta), now):
                        closed.append(part.budget)
                done.append((part.budget, actual))
        except TallyError as exc:
            return Settlement(booking, how, tuple(done), tuple(closed), str(exc), usage)
        return Settlement(booking, how, tuple(done), tuple(closed), None, usage)


def _delta(part: Booked, delta: Amount) -> Callable[[dict[str, Window]], tuple[dict[str, Window] | None, bool]]:
    """Add `delta` to the windows `part` was booked in, those still current; True when all of them were."""
    starts = dict(part.windows)

    def change(windows: dict[str, Window]) -> tuple[dict[str, Window] | None, bool]:
        current = {p for p, w in windows.items() if starts.get(p) == w.start}
        if not current:
            return None, False
        new = {p: Window(p, w.start, _clamped(w.spent + delta)) if p in current else w for p, w in windows.items()}
        return new, current == set(starts)

    return change
