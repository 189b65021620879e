"""What the review page shows, as plain data: the job list's rows, one job's page, the live snapshot.

Owns the page's reading of proctor.review (the ledger and the host's job records): which badge a job
gets, what "needs review" means on the page, which verbs its buttons offer. The verdict shown is the
host's (the ledger's end row, the host-run validation), never the agent's own summary, which is shown
as the agent's claim. Every value is still untrusted text: templates autoescape it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.ledger import Ledger
from proctor.review import jobs as jobs_mod
from proctor.review.diff import Diff, diff
from proctor.review.land import landable
from proctor.review.outcome import Outcome
from proctor.web import patch

STATUS_BADGE = {"completed": "good", "running": "live", "interrupted": "warn"}  # anything else: bad
PAYLOAD_CHARS = 600  # of one ledger row's payload on the page (the whole row: `proctor show --json`)


def badge(job: jobs_mod.Job) -> str:
    return STATUS_BADGE.get(job.status, "bad")


def review_badge(job: jobs_mod.Job) -> tuple[str, str]:
    """(text, class): the host's needs_human_review, said as a person reads it."""
    if job.status == "running":
        return "running", "live"
    if job.needs_human_review is False:
        return "checked", "good"
    if job.needs_human_review is True:
        return "needs review", "bad"
    return "unknown", "warn"


def risks(job: jobs_mod.Job) -> list[str]:
    got = (job.record.result or {}).get("known_risks") or []
    return [str(r) for r in got] if isinstance(got, list) else [str(got)]


def progress(job: jobs_mod.Job) -> dict[str, Any]:
    p = job.record.progress or {}
    return {"phase": str(p.get("phase") or ""), "lastLine": str(p.get("lastLine") or ""),
            "elapsedS": p.get("elapsedS")}


def row(job: jobs_mod.Job) -> dict[str, Any]:
    """One line of the job list, also what the live stream sends for it."""
    text, cls = review_badge(job)
    repo = job.repo or ""
    return {"jobId": job.job_id, "repo": repo, "repoName": Path(repo).name if repo else "?",
            "ticket": job.ticket or "", "agent": job.agent or "?", "status": job.status, "badge": badge(job),
            "code": job.code or "", "review": text, "reviewBadge": cls, "risks": len(risks(job)),
            "state": job.state, "age": jobs_mod.age_text(job.age_s()), "started": job.started or "",
            **({"progress": progress(job)} if job.status == "running" else {})}


def job_list(ledger: Ledger, repo: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
    found = jobs_mod.select(jobs_mod.load_jobs(ledger), repo=repo or None, statuses=(status,) if status else ())
    return [row(j) for j in reversed(found)]  # newest first


@dataclass(frozen=True)
class DiffView:
    page: patch.Page | None
    stat: str
    refused: str | None  # why there is no diff (no commit yet, objects gone, ...)


def diff_view(job: jobs_mod.Job) -> DiffView:
    if job.commit is None:
        return DiffView(None, "", "the job has no commit (it was refused, failed before its tree was built, "
                        "or is still running)")
    got = diff(job)
    if isinstance(got, Outcome):
        return DiffView(None, "", f"{got.code.value}: {got.reason}")
    assert isinstance(got, Diff)
    return DiffView(patch.split(got.patch), got.stat, None)


def _payload_text(payload: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in payload.items() if k != "jobId"}, default=str, ensure_ascii=False)
    return text if len(text) <= PAYLOAD_CHARS else text[:PAYLOAD_CHARS] + f"… ({len(text)} chars)"


def job_page(ledger: Ledger, job: jobs_mod.Job) -> dict[str, Any]:
    shown = jobs_mod.show(ledger, job)
    result = shown["result"] or {}
    text, cls = review_badge(job)
    blocked = landable(job)
    ended = job.status != "running"
    rows = [{**r, "text": _payload_text(r["payload"])} for r in shown["ledger"]]
    return {
        "job": job.to_dict(), "badge": badge(job), "review": text, "reviewBadge": cls,
        "result": result, "hasResult": shown["result"] is not None, "risks": risks(job),
        "validation": shown["validation"], "validationLog": shown["validation_log"],
        "ledger": rows, "gate": [r for r in rows if r["kind"] in jobs_mod.GATE_KINDS],
        "diff": diff_view(job) if ended else DiffView(None, "", "the job is still running"),
        "progress": progress(job),
        "canLand": ended and job.state == "open" and job.commit is not None,
        "landBlocked": blocked, "canDiscard": ended and job.state != "discarded",
    }
