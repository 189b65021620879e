"""Landing a race: one of its jobs (the winner unless the person picks another) and the rest discarded.

Owns choosing the job from the race's own record and tidying up after it: the other jobs of the race are
discarded once the pick has landed (kept with `keep_rest`), never before and never when the landing was
refused. Landing itself is review's (`land`), with every check a single job's landing has.
"""

from __future__ import annotations

from typing import Any

from proctor.mechanisms.ledger.store import Ledger
from proctor.services.race import races
from proctor.services.review import gc, jobs
from proctor.services.review.land import land
from proctor.services.review.outcome import Code, Outcome, refuse


def chosen(ledger: Ledger, race: races.Race, pick: str | None) -> jobs.Job | Outcome:
    """The race's job `pick` names (an id or a unique prefix of one of its jobs), else its winner."""
    wanted = pick or race.winner
    if wanted is None:
        why = "it has not ended" if not race.ended else "no job's verdict was accepted"
        return refuse(Code.NOT_LANDABLE, f"race {race.race_id} has no winner ({why}): name one of its jobs "
                      f"with --pick JOB ({', '.join(race.jobs)})")
    ids = jobs.matching(race.jobs, wanted)
    if len(ids) != 1:
        return refuse(Code.UNKNOWN_JOB, f"{wanted!r} is not one job of race {race.race_id} "
                      f"(its jobs: {', '.join(race.jobs)})")
    return jobs.find(ledger, ids[0])


def land_race(ledger: Ledger, ident: str, pick: str | None = None, *, keep_rest: bool = False, via: str = "cli",
              **options: Any) -> Outcome:
    """Land race `ident`'s pick (`land`'s options pass through) and discard its other jobs once it landed."""
    race = races.find(ledger, ident)
    if isinstance(race, str):
        return refuse(Code.UNKNOWN_JOB, race)
    job = chosen(ledger, race, pick)
    if isinstance(job, Outcome):
        job.details["raceId"] = race.race_id
        return job
    out = land(ledger, job, via=via, **options)
    out.details["raceId"] = race.race_id
    if not out.ok or keep_rest:
        return out
    discarded, kept = [], []
    for other in race.jobs:
        if other == job.job_id:
            continue
        found = jobs.find(ledger, other)
        if not isinstance(found, jobs.Job) or found.state != "open":
            continue
        done = gc.discard(ledger, found, via=via)
        (discarded if done.ok else kept).append(other if done.ok else f"{other}: {done.reason}")
    out.details["discarded"] = discarded
    if kept:
        out.details["not_discarded"] = kept
    return out
