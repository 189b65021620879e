"""A race read back from the ledger: its jobs, its ranking and its winner (`proctor land RACE`, the page).

Owns finding a race by its id (or a unique prefix) in the `race.start` and `race.end` rows. The ledger is
the authority: a race's jobs are the ones its start row named, in the order asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proctor.mechanisms.ledger.store import Ledger
from proctor.services.review import jobs


@dataclass(frozen=True)
class Race:
    race_id: str
    jobs: tuple[str, ...]
    agents: tuple[str, ...]
    repo: str | None
    started: str | None
    ranking: tuple[dict[str, Any], ...] = ()  # best first; empty while it runs, or when it never ended
    winner: str | None = None
    ended: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"raceId": self.race_id, "jobs": list(self.jobs), "agents": list(self.agents), "repo": self.repo,
                "started": self.started, "ended": self.ended, "winner": self.winner, "ranking": list(self.ranking)}


def find(ledger: Ledger, ident: str) -> Race | str:
    """The race `ident` names (its id or a prefix of exactly one), or why there is none."""
    starts = {str(r.payload.get("raceId")): r for r in ledger.rows(kind="race.start")}
    matches = jobs.matching(starts, ident)
    if not matches:
        return f"no race {ident!r} in the ledger"
    if len(matches) > 1:
        return f"{ident!r} is the start of {len(matches)} race ids: " + ", ".join(matches[:5])
    race_id = matches[0]
    start = starts[race_id]
    end = next((r for r in ledger.rows(kind="race.end") if r.payload.get("raceId") == race_id), None)
    p = start.payload
    return Race(race_id, tuple(str(j) for j in p.get("jobs") or []), tuple(str(a) for a in p.get("agents") or []), p.get("repo"), start.ts,
                tuple(end.payload.get("ranking") or []) if end else (),
                end.payload.get("winner") if end else None, end is not None)


def is_race_id(ident: str) -> bool:
    return ident.startswith("race-")
