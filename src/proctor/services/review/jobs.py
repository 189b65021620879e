"""The jobs the ledger knows, as a person reviews them (`proctor jobs`), and one job's whole record (`show`).

Owns reading a job back: its `job.start`, `job.end` and `job.tree` rows, the review verbs' own rows
(`review.land`, `review.discard`), and the host's record (proctor.services.job.record). From them: its status
(the end row's, else `running` while its host lives and `interrupted` once that died), its review state
(`open`, `landed`, `discarded`), and where its worktree is — derived from the start row's repo and the job
id when no end row names it (a job interrupted before its end row still has a worktree to review).

The ledger is the authority (hash-chained); result.json adds detail and is checked against it by `land`.
It never writes anything but a verb's own ledger row, and never runs git in a job's repository.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proctor.services.job import record
from proctor.mechanisms.git import worktree
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.ledger.rows import Row
from proctor.services.review.outcome import Code, Outcome, refuse

GATE_KINDS = ("gate.decision", "gate.refusal", "egress.decision")
REVIEW_KINDS = ("review.land", "review.discard")


@dataclass
class Job:
    job_id: str
    agent: str | None = None
    ticket: str | None = None
    repo: str | None = None
    mode: str | None = None
    base: str | None = None  # the base ref the request named (None: the default branch)
    started: str | None = None
    ended: str | None = None
    status: str = "interrupted"
    code: str | None = None
    needs_human_review: bool | None = None
    worktree_path: str | None = None
    worktree_exists: bool = False
    commit: str | None = None  # from the ledger's job.tree row
    tree: str | None = None
    state: str = "open"  # open | landed | discarded
    landed: dict[str, Any] | None = None  # the review.land row that landed it
    host_alive: bool | None = None
    checkout: Path | None = None  # where the host cuts this job's worktree, whether or not it exists
    continues: str | None = None  # a follow-up's: the job whose tree it started from
    race: str | None = None  # the race it ran in (proctor.services.race)
    record: record.Record = field(default_factory=lambda: record.Record(None, None, None), repr=False)

    def age_s(self, now: datetime | None = None) -> float | None:
        ts = parse_ts(self.started)
        return None if ts is None else ((now or datetime.now(UTC)) - ts).total_seconds()

    def to_dict(self) -> dict[str, Any]:
        return {"jobId": self.job_id, "repo": self.repo, "ticket": self.ticket, "agent": self.agent,
                "status": self.status, "code": self.code, "needs_human_review": self.needs_human_review,
                "state": self.state, "started": self.started, "ended": self.ended, "mode": self.mode,
                "base": self.base, "branch": (self.record.result or {}).get("branch"), "commit": self.commit,
                "worktreePath": self.worktree_path, "worktreeExists": self.worktree_exists,
                "hostAlive": self.host_alive, "landed": self.landed, "continues": self.continues,
                "race": self.race}


def parse_ts(ts: str | None) -> datetime | None:
    if not ts:
        return None
    try:
        t = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _job_id(row: Row) -> str:
    return row.job_id or str(row.payload.get("jobId", ""))


def _shaped(path: object, job_id: str) -> Path | None:
    """A recorded worktree path, only when it has the shape the host gives one: /…/<name>-agents/<jobId>."""
    if not isinstance(path, str) or not path:
        return None
    p = Path(path)
    return p if p.is_absolute() and p.name == job_id and p.parent.name.endswith("-agents") else None


class _Paths:
    """Worktree paths derived from a start row's repo (its top level, as the host cut it), one git call a repo."""

    def __init__(self) -> None:
        self._tops: dict[str, Path | None] = {}

    def top(self, repo: str) -> Path | None:
        if repo not in self._tops:
            opened = worktree.open_repo(repo)
            self._tops[repo] = None if isinstance(opened, worktree.Failure) else opened.path
        return self._tops[repo]

    def derive(self, repo: object, job_id: str, recorded: object) -> Path | None:
        shaped = _shaped(recorded, job_id)
        if shaped is not None:
            return shaped
        if not isinstance(repo, str) or not Path(repo).is_absolute() or not record.safe_job_id(job_id):
            return None
        top = self.top(repo) or Path(repo)
        return top.parent / f"{top.name}-agents" / job_id


def _is_dir(path: Path | None) -> bool:
    return path is not None and path.is_dir() and not path.is_symlink()


def load_jobs(ledger: Ledger, only: str | None = None) -> list[Job]:
    """Every run_agent job of the ledger (or only the one with id `only`), oldest first."""
    jobs: dict[str, Job] = {}
    for row in ledger.rows(kind="job.start"):
        jid = _job_id(row)
        if only is not None and jid != only:
            continue
        p = row.payload
        jobs[jid] = Job(jid, agent=p.get("agent"), ticket=p.get("ticket"), repo=p.get("repo"), mode=p.get("mode"),
                        base=p.get("branch"), started=row.ts,
                        continues=p.get("continues") if isinstance(p.get("continues"), str) else None)
    for row in ledger.rows(kind="race.start"):
        for jid in row.payload.get("jobs") or []:
            if isinstance(jid, str) and jid in jobs:
                jobs[jid].race = str(row.payload.get("raceId"))
    ends: dict[str, dict[str, Any]] = {}
    for row in ledger.rows(kind="job.end"):
        jid = _job_id(row)
        if only is not None and jid != only:
            continue
        job = jobs.setdefault(jid, Job(jid))
        job.ended, job.status = row.ts, str(row.payload.get("status") or "?")
        job.code, job.needs_human_review = row.payload.get("code"), row.payload.get("needs_human_review")
        ends[jid] = row.payload
    for row in ledger.rows(kind="job.tree"):
        job = jobs.get(_job_id(row))
        if job is not None:
            job.commit, job.tree = row.payload.get("commit"), row.payload.get("tree")
    for kind in REVIEW_KINDS:
        for row in ledger.rows(kind=kind):
            job = jobs.get(_job_id(row))
            if job is None or row.payload.get("ok") is not True:
                continue
            if kind == "review.land":
                job.state, job.landed = "landed", {"into": row.payload.get("into"), "commit": row.payload.get("new"),
                                                   "at": row.ts}
            elif job.state != "landed":
                job.state = "discarded"
    paths = _Paths()
    for job in jobs.values():
        job.record = record.load(job.job_id) if record.safe_job_id(job.job_id) else job.record
        if job.ended is None:
            job.host_alive = job.record.host_alive()
            job.status = "running" if job.host_alive else "interrupted"
        recorded = (job.record.result or {}).get("worktreePath") or ends.get(job.job_id, {}).get("worktreePath")
        path = job.checkout = paths.derive(job.repo, job.job_id, recorded)
        job.worktree_exists = _is_dir(path)
        # A refused job (an invalid request) never had a worktree: the path it would have had is not shown.
        job.worktree_path = str(path) if path is not None and (job.worktree_exists or recorded) else None
    return list(jobs.values())


def _same_repo(a: str | None, b: str) -> bool:
    if not a:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def select(jobs: list[Job], *, repo: str | None = None, statuses: tuple[str, ...] = ()) -> list[Job]:
    """Jobs of `repo` (a path, compared resolved) whose status or review state is one of `statuses`."""
    out = [j for j in jobs if repo is None or _same_repo(j.repo, repo)]
    if statuses:
        out = [j for j in out if j.status in statuses or j.state in statuses]
    return out


def matching(ids: Iterable[str], ident: str) -> list[str]:
    """The ids `ident` names: itself when it is one, else every id it begins (one: a unique prefix)."""
    ids = list(ids)
    return [i for i in ids if i == ident] or [i for i in ids if ident and i.startswith(ident)]


def find(ledger: Ledger, ident: str) -> Job | Outcome:
    """The job named by `ident`: its id, or a prefix of exactly one id."""
    ids = dict.fromkeys(_job_id(r) for kind in ("job.start", "job.end") for r in ledger.rows(kind=kind))
    matches = matching(ids, ident)
    if len(matches) == 1 and not record.safe_job_id(matches[0]):
        # Ids become paths and ref patterns: one the host would never have made is not acted on.
        return refuse(Code.UNKNOWN_JOB, f"the ledger's job id {matches[0]!r} is not [A-Za-z0-9._-]+")
    if len(matches) == 1:
        return load_jobs(ledger, only=matches[0])[0]
    if matches:
        return refuse(Code.AMBIGUOUS_JOB, f"{ident!r} is the start of {len(matches)} job ids: "
                      + ", ".join(matches[:5]))
    return refuse(Code.UNKNOWN_JOB, f"no job {ident!r} in the ledger")


def show(ledger: Ledger, job: Job) -> dict[str, Any]:
    """The job's whole record: the result, validation output, risks, every ledger row it has, gate decisions."""
    rows = [{"id": r.id, "ts": r.ts, "kind": r.kind, "payload": r.payload} for r in ledger.rows(job_id=job.job_id)]
    result = job.record.result
    log = (result or {}).get("validation_log")
    return {
        "job": job.to_dict(),
        "result": result,
        "request": job.record.request,
        "risks": (result or {}).get("known_risks", []),
        "validation": (result or {}).get("validation", []),
        "validation_log": log if isinstance(log, str) and Path(log).is_file() else None,
        "ledger": rows,
        "gate": [r for r in rows if r["kind"] in GATE_KINDS],
    }


def note(ledger: Ledger, kind: str, payload: dict[str, Any], job_id: str | None = None) -> str | None:
    """A read verb's ledger row; None, or why it could not be written (the read still answers)."""
    try:
        ledger.append(kind, payload, job_id=job_id)
    except Exception as exc:  # noqa: BLE001 - a ledger that refuses a row costs the row, not the answer
        return f"the {kind} row could not be written: {exc}"
    return None


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"
