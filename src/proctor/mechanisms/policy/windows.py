"""A budget's stored value in the tally: its current windows (fixed, UTC-aligned hours and days), the ids of
the last writes that went into it, its encoding, and which limits a booking would pass. Pure functions of
the value and the clock: it never reads or writes the tally itself (the governor's compare-and-set does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proctor.mechanisms.policy.budget import PERIODS, Amount, Budget, Limit, window_end, window_start
from proctor.mechanisms.policy.tally import TallyError, Versioned

STATE_VERSION = 1
KEY_PREFIX = "budget."


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Window:
    period: str
    start: int
    spent: Amount

    @property
    def end(self) -> int:
        return window_end(self.period, self.start)


@dataclass(frozen=True)
class Over:
    """One limit a booking would pass: the budget, the limit, what its window has spent, what the run books."""

    budget: str
    limit: Limit
    spent: int
    booked: int
    retry_at: int  # the window's end: when it frees

    def line(self) -> str:
        return (f"budget {self.budget!r}: {self.limit.key} {self.limit.shown()} would be passed "
                f"({self.limit.shown(self.spent)} spent this {self.limit.period}, a run books "
                f"{self.limit.shown(self.booked)}); it frees at {iso(self.retry_at)}")

    def record(self) -> dict[str, Any]:
        shown = (lambda v: v / 1_000_000) if self.limit.metric == "usd" else (lambda v: v)
        return {"budget": self.budget, "limit": self.limit.key, "allowed": shown(self.limit.value),
                "spent": shown(self.spent), "booked": shown(self.booked), "frees_at": iso(self.retry_at)}


@dataclass(frozen=True)
class PoolSpend:
    """One budget's current windows against its limits, for `proctor usage`."""

    budget: Budget
    windows: dict[str, Window]

    def as_dict(self) -> dict[str, Any]:
        limits = []
        for lim in self.budget.limits:
            w = self.windows[lim.period]
            spent = w.spent.of(lim.metric)
            shown = (lambda v: v / 1_000_000) if lim.metric == "usd" else (lambda v: v)
            limits.append({"limit": lim.key, "allowed": shown(lim.value), "spent": shown(spent),
                           "left": shown(max(0, lim.value - spent)), "window_start": iso(w.start),
                           "window_end": iso(w.end)})
        return {"budget": self.budget.name, "pool": self.budget.pool(),
                "estimate": self.budget.estimate.as_dict(), "limits": limits,
                "windows": {p: {"start": iso(w.start), "end": iso(w.end), "spent": w.spent.as_dict()}
                            for p, w in self.windows.items()}}


def key_for(budget: Budget) -> str:
    return KEY_PREFIX + budget.name


def _amount(raw: Any) -> Amount:
    if not isinstance(raw, dict):
        raise ValueError("window is not an object")
    values = [raw.get(k, 0) for k in ("runs", "tokens", "usd_micros")]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError("window counters must be integers")
    return Amount(*values)


def windows_of(found: Versioned | None, now: float, key: str = "") -> dict[str, Window]:
    """The budget's current windows: a stored window that is no longer current starts over at zero."""
    stored: dict[str, Any] = {}
    if found is not None:
        try:
            data = json.loads(found.value)
            if not isinstance(data, dict) or data.get("v") != STATE_VERSION or not isinstance(data.get("windows"), dict):
                raise ValueError(f"not a version {STATE_VERSION} tally value")
            stored = data["windows"]
        except (ValueError, RecursionError) as exc:
            # Fail closed: a value nobody can read is no evidence the budget has room.
            raise TallyError(f"the tally's value for {key or 'a budget'} is unreadable ({exc}); delete the key "
                             "to start its windows over") from None
    out = {}
    for period in PERIODS:
        start = window_start(period, now)
        raw = stored.get(period)
        spent = Amount()
        if isinstance(raw, dict) and raw.get("start") == start:
            try:
                spent = _amount(raw)
            except ValueError as exc:
                raise TallyError(f"the tally's value for {key or 'a budget'} is unreadable ({exc})") from None
        out[period] = Window(period, start, spent)
    return out


OPS_KEPT = 64  # the ids of the last writes a value remembers (see `_change`)


def ops_of(found: Versioned | None) -> list[str]:
    """The ids of the last writes that went into this value (none for an older value)."""
    if found is None:
        return []
    try:
        ops = json.loads(found.value).get("ops")
    except (ValueError, AttributeError, RecursionError):
        return []
    return [o for o in ops if isinstance(o, str)] if isinstance(ops, list) else []


def encode(windows: dict[str, Window], ops: Sequence[str] = ()) -> bytes:
    return json.dumps({"v": STATE_VERSION, "ops": list(ops)[-OPS_KEPT:], "windows": {
        p: {"start": w.start, "runs": w.spent.runs, "tokens": w.spent.tokens, "usd_micros": w.spent.usd_micros}
        for p, w in windows.items()}}, sort_keys=True, separators=(",", ":")).encode()


def over_limits(budget: Budget, windows: dict[str, Window], amount: Amount) -> list[Over]:
    out = []
    for lim in budget.limits:
        w = windows[lim.period]
        spent, booked = w.spent.of(lim.metric), amount.of(lim.metric)
        if spent + booked > lim.value:
            out.append(Over(budget.name, lim, spent, booked, w.end))
    return out
