"""Spend budgets as the trusted policy declares them: which jobs a budget covers and what it allows per window.

Owns the `[budgets.<name>]` tables of `$PROCTOR_HOME/policy.toml` (parsed here, loaded by `proctor.mechanisms.policy.trusted`,
never taken from a caller), the amounts a job is counted in and the window arithmetic. It never counts
anything (proctor.mechanisms.policy.tally keeps the counters) and never admits a job (proctor.mechanisms.policy.governor does).

    [budgets.claude-fast]
    agent = "claude"             # the request's agent; a budget names an agent, a lane, or both
    lane = "fast"                # the queue lane the job came on (a local job has none)
    runs_per_hour = 20           # any subset of {runs,tokens,usd}_per_{hour,day}
    tokens_per_hour = 2_000_000
    usd_per_day = 50.0
    tokens_per_run = 150_000     # what each run books before it launches; needed with a tokens limit
    usd_per_run = 1.5            # the same for dollars; needed with a usd limit

Windows are fixed and aligned to UTC: an hour is [HH:00, HH+1:00), a day [00:00, 24:00). A run counts in the
windows that were current when it was booked, whenever it ends. Dollars are kept in micro-dollars, so
adding up bookings never drifts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
PERIODS: dict[str, int] = {"hour": 3600, "day": 86400}
METRICS = ("runs", "tokens", "usd")
MICROS = 1_000_000


@dataclass(frozen=True)
class Amount:
    """What a run is counted as: runs, tokens (in + out) and micro-dollars."""

    runs: int = 0
    tokens: int = 0
    usd_micros: int = 0

    def of(self, metric: str) -> int:
        return {"runs": self.runs, "tokens": self.tokens, "usd": self.usd_micros}[metric]

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.runs + other.runs, self.tokens + other.tokens, self.usd_micros + other.usd_micros)

    def __sub__(self, other: Amount) -> Amount:
        return Amount(self.runs - other.runs, self.tokens - other.tokens, self.usd_micros - other.usd_micros)

    def __bool__(self) -> bool:
        return bool(self.runs or self.tokens or self.usd_micros)

    def as_dict(self) -> dict[str, Any]:
        return {"runs": self.runs, "tokens": self.tokens, "usd": self.usd_micros / MICROS}


def usd_micros(usd: float) -> int:
    return round(usd * MICROS)


@dataclass(frozen=True)
class Limit:
    metric: str  # runs | tokens | usd
    period: str  # hour | day
    value: int  # in the metric's unit (usd: micro-dollars)

    @property
    def key(self) -> str:
        return f"{self.metric}_per_{self.period}"

    def shown(self, value: int | None = None) -> str:
        v = self.value if value is None else value
        return f"{v / MICROS:g}" if self.metric == "usd" else str(v)


@dataclass(frozen=True)
class Budget:
    name: str
    agent: str | None
    lane: str | None
    limits: tuple[Limit, ...]
    estimate: Amount  # booked by each run before it launches (runs: always 1)

    def covers(self, agent: str, lane: str | None) -> bool:
        return (self.agent is None or self.agent == agent) and (self.lane is None or self.lane == lane)

    @property
    def periods(self) -> tuple[str, ...]:
        return tuple(p for p in PERIODS if any(lim.period == p for lim in self.limits))

    def pool(self) -> dict[str, str | None]:
        return {"agent": self.agent, "lane": self.lane}


def window_start(period: str, now: float) -> int:
    size = PERIODS[period]
    return int(now // size) * size


def window_end(period: str, start: int) -> int:
    return start + PERIODS[period]


_Runs = Annotated[int, Field(ge=0, strict=True)]
_Tokens = Annotated[int, Field(ge=1, strict=True)]
_Usd = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class BudgetTable(BaseModel):
    """One `[budgets.<name>]` table; unknown keys are refused (a typo must not silently lift a limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: Annotated[str, Field(min_length=1)] | None = None
    lane: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")] | None = None
    runs_per_hour: _Runs | None = None
    runs_per_day: _Runs | None = None
    tokens_per_hour: _Tokens | None = None
    tokens_per_day: _Tokens | None = None
    usd_per_hour: _Usd | None = None
    usd_per_day: _Usd | None = None
    tokens_per_run: _Tokens | None = None
    usd_per_run: _Usd | None = None

    @model_validator(mode="after")
    def _coherent(self) -> BudgetTable:
        if self.agent is None and self.lane is None:
            raise ValueError("names no pool: give agent, lane or both")
        limits = self.limits()
        if not limits:
            raise ValueError("sets no limit: give one of runs/tokens/usd _per_hour or _per_day")
        for metric, estimate, key in (("tokens", self.tokens_per_run, "tokens_per_run"),
                                      ("usd", self.usd_per_run, "usd_per_run")):
            mine = [lim for lim in limits if lim.metric == metric]
            if mine and estimate is None:
                raise ValueError(f"{mine[0].key} needs {key}: the estimate each run books before it launches")
            booked = self.estimate().of(metric)
            for lim in mine:
                if booked > lim.value:
                    # Never admitting a run is a declaration error, not a budget: say so when the file loads.
                    raise ValueError(f"{key} {lim.shown(booked)} is over {lim.key} {lim.shown()}: no run "
                                     "could ever be admitted")
        return self

    def limits(self) -> tuple[Limit, ...]:
        out = []
        for metric in METRICS:
            for period in PERIODS:
                raw = getattr(self, f"{metric}_per_{period}")
                if raw is not None:
                    out.append(Limit(metric, period, usd_micros(raw) if metric == "usd" else int(raw)))
        return tuple(out)

    def estimate(self) -> Amount:
        usd = self.usd_per_run
        return Amount(1, self.tokens_per_run or 0, usd_micros(usd) if usd is not None and math.isfinite(usd) else 0)

    def build(self, name: str) -> Budget:
        return Budget(name, self.agent, self.lane, self.limits(), self.estimate())


BudgetName = Annotated[str, Field(pattern=NAME_PATTERN)]


def covering(budgets: tuple[Budget, ...], agent: str, lane: str | None) -> tuple[Budget, ...]:
    """The budgets a job of `agent` on `lane` is charged to, in name order (the order bookings are made in)."""
    return tuple(sorted((b for b in budgets if b.covers(agent, lane)), key=lambda b: b.name))
