"""A race: one task to several agents (or several attempts of one) side by side, then their ranking.

Owns running the jobs together and what binds them: the race's id, its `race.start` and `race.end` ledger
rows (its jobs, then its ranking), and its booking. Each job is an ordinary run_agent job — its own
worktree, confinement, gate, booking and validation — so each stays reviewable and landable alone. The
budgets are booked for every run before any launches: a race the budgets cannot hold whole is refused whole,
saying how many of its runs would fit, rather than starting some and starving the rest. The ranking is
rank.py's; the diff sizes it weighs are read through the host's git dir over each job's objects (never the
job's own git dir), as review reads them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from proctor.contract import Code, RaceResult, Requester, RunAgentRequest, RunAgentResult, Status
from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.ledger.store import Ledger, LedgerError
from proctor.mechanisms.policy.governor import Booking, Prebooked, UsageGovernor
from proctor.mechanisms.policy.tally import SqliteTally
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.mechanisms.process.spawn import Watch
from proctor.services.job.progress import NullProgress, Progress
from proctor.services.job.record import new_job_id
from proctor.services.job.run_agent import run_agent
from proctor.services.race.rank import Standing, rank
from proctor.services.review import auto, jobs
from proctor.services.review import diff as review_diff

MAX_RUNS = 16  # jobs in one race: each is a worktree, a sandbox and an agent
DEFAULT_PARALLEL = 4  # at once: an agent mostly waits on its model, so more than the cores; --parallel bounds it


@dataclass(frozen=True)
class Lane:
    """One run of the race as its watcher sees it: which job, which agent, and its number (1-based)."""

    number: int
    job_id: str
    agent: str


class LaneProgress:
    """A job's Progress told to the race's watcher with the lane it is (`on_phase(lane, phase)`)."""

    def __init__(self, lane: Lane, on_phase: Callable[[Lane, str], None]) -> None:
        self.lane, self._on_phase = lane, on_phase

    def phase(self, name: str) -> None:
        self._on_phase(self.lane, name)

    def watch(self, inner: Watch | None) -> Watch | None:
        return inner

    def done(self, result: RunAgentResult) -> None:
        self._on_phase(self.lane, f"ended {result.status.value} ({result.code.value})")


def race_errors(requests: Sequence[RunAgentRequest], parallel: int) -> list[str]:
    """What makes a set of requests no race: too few or too many, or not one task in one repo."""
    out = []
    if not 2 <= len(requests) <= MAX_RUNS:
        out.append(f"a race runs 2 to {MAX_RUNS} jobs, not {len(requests)}")
    if len({(r.task, r.repo, r.branch, r.validate_command, r.continues) for r in requests}) > 1:
        out.append("a race's jobs share one task, repo, branch, validation and follow-up: only the agent differs")
    if parallel < 1:
        out.append(f"parallel must be at least 1, not {parallel}")
    return out


@dataclass(frozen=True)
class Opened:
    """A race admitted: its id, its jobs' ids, every run booked, its start row written. Run each request
    with its id and booking (`run_agent(..., job_id=, booked=)`), then `close_race` with the results; a
    booking no job took is released there (`release_untaken` where the jobs never all ran)."""

    race_id: str
    requests: tuple[RunAgentRequest, ...]
    ids: tuple[str, ...]
    booked: tuple[Prebooked, ...]
    config: Config
    start: float


def race(requests: Sequence[RunAgentRequest], *, parallel: int = DEFAULT_PARALLEL, config: Config | None = None,
         on_phase: Callable[[Lane, str], None] | None = None, cancel: Callable[[], str | None] | None = None,
         governor: UsageGovernor | None = None, requester: Requester | None = None) -> RaceResult:
    """Run `requests` (one task, one agent each) up to `parallel` at once; never raises for a bad request or a
    misbehaving agent. `governor`: where the race is booked (default: the trusted policy's budgets in this
    home's tally, as a job's own). `requester`: who asked, when not the person (as run_agent's)."""
    with governed(governor) as gov:
        opened = open_race(requests, parallel=parallel, config=config, governor=gov)
        if isinstance(opened, RaceResult):
            return opened
        assert not isinstance(gov, PolicyError)  # open_race refused the race over it
        lanes = [Lane(i + 1, job_id, r.agent) for i, (r, job_id) in enumerate(zip(opened.requests, opened.ids))]
        lock = threading.Lock()

        def told(lane: Lane, phase: str) -> None:
            if on_phase is not None:
                with lock:  # one watcher line at a time, whichever job's thread says it
                    on_phase(lane, phase)

        def one(i: int) -> RunAgentResult:
            progress: Progress = LaneProgress(lanes[i], told) if on_phase is not None else NullProgress()
            return run_agent(opened.requests[i], config=opened.config, progress=progress, cancel=cancel,
                             job_id=opened.ids[i], booked=opened.booked[i], requester=requester)

        try:
            with ThreadPoolExecutor(max_workers=min(parallel, len(requests)), thread_name_prefix=opened.race_id) as pool:
                results = list(pool.map(one, range(len(requests))))
        except BaseException:
            release_untaken(opened, gov)  # run_agent never raises; should it, no booking outlives the race
            raise
        # A race someone else asked for, or one cancelled, lands nothing on its own: the person's own only.
        return close_race(opened, results, gov, land=requester is None and not (cancel and cancel()))


def own_governor() -> UsageGovernor | PolicyError:
    """The trusted policy's budgets over this home's tally, as a job's own are (or why they cannot be
    read); the caller closes it."""
    try:
        return UsageGovernor(Policy.load().budgets, SqliteTally.default)
    except PolicyError as exc:
        return exc


@contextmanager
def governed(governor: UsageGovernor | None) -> Iterator[UsageGovernor | PolicyError]:
    """`governor`, or `own_governor()` closed after."""
    if governor is not None:
        yield governor
        return
    own = own_governor()
    try:
        yield own
    finally:
        if not isinstance(own, PolicyError):
            own.close()


def open_race(requests: Sequence[RunAgentRequest], *, parallel: int = DEFAULT_PARALLEL,
              config: Config | None = None, governor: UsageGovernor | PolicyError) -> Opened | RaceResult:
    """The race admitted (ids made, every run booked, `race.start` written), or refused whole with nothing
    launched: not a race, the config or policy unreadable, the budgets without room for all of it."""
    start = time.monotonic()
    race_id = f"race-{new_job_id()}"
    errors = race_errors(requests, parallel)
    if errors:
        return _refused(race_id, Code.INVALID_REQUEST, "; ".join(errors), start)
    if isinstance(governor, PolicyError):
        return _refused(race_id, Code.CONFIG_INVALID, f"the trusted policy cannot be read: {governor}", start)
    if config is None:  # read once for all the jobs, and for the winner's auto_land policy
        try:
            config = load_config()
        except ConfigError as exc:
            return _refused(race_id, Code.CONFIG_INVALID, str(exc), start)
    ids: list[str] = []
    while len(ids) < len(requests):
        one = new_job_id()
        if one not in ids:
            ids.append(one)
    booked = _book_all(governor, requests, ids)
    if isinstance(booked, RaceResult):
        booked.race_id, booked.duration_seconds = race_id, round(time.monotonic() - start, 3)
        return booked
    try:
        started(race_id, requests, ids, parallel=parallel)
    except (LedgerError, OSError) as exc:
        for b in booked:
            governor.release(b)
        return _refused(race_id, Code.HOST_ERROR, f"the race's start could not be recorded ({exc}); "
                        "nothing was launched", start)
    return Opened(race_id, tuple(requests), tuple(ids), tuple(Prebooked(b) for b in booked), config, start)


def started(race_id: str, requests: Sequence[RunAgentRequest], ids: Sequence[str], **more: Any) -> None:
    """The race's `race.start` row (what `races.find` reads): its jobs in the order asked, and `more`."""
    with Ledger.default() as ledger:
        ledger.append("race.start", {"raceId": race_id, "jobs": list(ids), "agents": [r.agent for r in requests],
                                     "repo": requests[0].repo, "ticket": requests[0].ticket, **more})


def release_untaken(opened: Opened, governor: UsageGovernor) -> None:
    """The bookings no job took (refused before admission, or never started): the race's to give back. A
    taken one is its job's, settled or released by it, never here too."""
    for pre in opened.booked:
        if not pre.taken and pre.booking.parts:
            pre.taken = True  # given back once, whoever asks again
            governor.release(pre.booking)


def close_race(opened: Opened, results: Sequence[RunAgentResult], governor: UsageGovernor, *,
               land: bool = True) -> RaceResult:
    """The race's ranking from its jobs' results (in the order asked), its `race.end` row, the bookings no
    job took back, and (`land`: the person's own race, not cancelled) its winner landed where the repo's
    auto_land policy says."""
    release_untaken(opened, governor)
    with Ledger.default() as ledger:
        lines = {r.job_id or "": n for r in results if (n := diff_lines(ledger, r)) is not None}
        standings = rank(results, lines)
        out = ranked(opened.race_id, results, standings, opened.start)
        ledger.append("race.end", {"raceId": opened.race_id, "winner": out.winner, "ranking": out.ranking})
        if out.winner and land:
            top = next(r for r in results if r.job_id == out.winner)
            out.landed = auto.after_job(opened.requests[0].repo, top, opened.config, ledger=ledger,
                                        race=opened.race_id)
    return out


def ranked(race_id: str, results: Sequence[RunAgentResult], standings: Sequence[Standing], start: float,
           extra: Callable[[Standing], dict[str, Any]] | None = None) -> RaceResult:
    """The race's result from its ranking: the winner (the first, when its verdict needs no person), its
    summary, and every job's place with `extra`'s fields."""
    ranking = [{**s.record(i + 1), **(extra(s) if extra else {})} for i, s in enumerate(standings)]
    best = standings[0]
    winner = best.job_id if best.tier == 0 else None
    top = next(r for r in results if r.job_id == best.job_id)
    summary = (f"{winner} ({top.agent}) ranked first of {len(results)}: {best.reasons[0]}" if winner
               else f"no job of {len(results)} was accepted; the best, {best.job_id} ({top.agent}): {best.reasons[0]}")
    return RaceResult(raceId=race_id, status=Status.completed if winner else Status.failed,
                      code=Code.OK if winner else top.code, summary=summary, winner=winner, ranking=ranking,
                      jobs=list(results), durationSeconds=round(time.monotonic() - start, 3))


def _book_all(governor: UsageGovernor, requests: Sequence[RunAgentRequest],
              ids: list[str]) -> list[Booking] | RaceResult:
    """Every run booked, or none: the first denial takes back what was booked before it."""
    booked: list[Booking] = []
    for request, job_id in zip(requests, ids):
        got = governor.book(request.agent, job_id)
        if isinstance(got, Booking):
            booked.append(got)
            continue
        for b in booked:
            governor.release(b)
        fit = len(booked)
        why = got.reason if got.code is Code.BUDGET_UNAVAILABLE else (
            f"the spend budgets have room for {fit} of the race's {len(requests)} runs "
            f"({got.over[0].line() if got.over else got.reason}); nothing was launched")
        out = _refused("", got.code, why, time.monotonic())
        out.status = Status.rate_limited if got.code is Code.BUDGET_DENIED else Status.failed
        out.budget = {"runs": len(requests), "fit": fit, "denied": got.record()}
        return out
    return booked


def diff_lines(ledger: Ledger, result: RunAgentResult) -> int | None:
    """Lines added and removed by the job's commit against its base (review's `diff.lines`); None when it
    has no commit or its objects cannot be read."""
    if not result.commit or not result.job_id:
        return None
    found = jobs.find(ledger, result.job_id)
    got = review_diff.lines(found) if isinstance(found, jobs.Job) else None
    return got if isinstance(got, int) else None


def _refused(race_id: str, code: Code, why: str, start: float) -> RaceResult:
    return RaceResult(raceId=race_id, status=Status.failed, code=code, summary=why,
                      durationSeconds=round(time.monotonic() - start, 3))
