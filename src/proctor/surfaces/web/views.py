"""What the review page shows, as plain data: the job list's rows, one job's page, the live snapshot.

Owns the page's reading of proctor.services.review (the ledger and the host's job records): which badge a job
gets, what "needs review" means on the page, which verbs its buttons offer. The verdict shown is the
host's (the ledger's end row, the host-run validation), never the agent's own summary, which is shown
as the agent's claim. Every value is still untrusted text: templates pass it through `terminal.visible` and
autoescape it, and the live stream's rows go through `shown_rows` (the same function).
"""

from __future__ import annotations

import hashlib

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.mechanisms.ledger.store import Ledger
from proctor.services.race import races
from proctor.services.review import jobs as jobs_mod
from proctor.services.review.diff import Diff, diff
from proctor.services.review.land import landable
from proctor.services.review.outcome import Outcome
from proctor.mechanisms.terminal import visible
from proctor.surfaces.web import patch

STATUS_BADGE = {"completed": "good", "running": "live", "interrupted": "warn"}  # anything else: bad
PAYLOAD_CHARS = 600  # of one ledger row's payload on the page (the whole row: `proctor show --json`)
TASK_CHARS = 8000  # of the task's text on a job page (the whole of it: `proctor show --json`)
TASK_LINE_CHARS = 120  # of its first line in the list
NEEDS_REVIEW = "needs-review"
STATUS_FILTERS = (NEEDS_REVIEW, "running", "completed", "failed", "interrupted", "timed_out", "cancelled", "open",
                  "landed", "discarded")


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


def task_text(job: jobs_mod.Job) -> str:
    task = (job.record.request or {}).get("task")
    return task if isinstance(task, str) else ""


def first_line(text: str) -> str:
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= TASK_LINE_CHARS else line[:TASK_LINE_CHARS - 1] + "…"


def row(job: jobs_mod.Job) -> dict[str, Any]:
    """One line of the job list, also what the live stream sends for it."""
    text, cls = review_badge(job)
    repo = job.repo or ""
    return {"jobId": job.job_id, "repo": repo, "repoName": Path(repo).name if repo else "?",
            "ticket": job.ticket or "", "task": first_line(task_text(job)), "agent": job.agent or "?", "status": job.status, "badge": badge(job),
            "code": job.code or "", "review": text, "reviewBadge": cls, "risks": len(risks(job)),
            "state": job.state, "age": jobs_mod.age_text(job.age_s()), "started": job.started or "",
            **({"progress": progress(job)} if job.status == "running" else {})}


def job_list(ledger: Ledger, repo: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
    """The list's rows, newest first. `status` NEEDS_REVIEW: ended, still open, and the host's verdict asks for
    a person (needs_human_review) or could not say."""
    wanted = (status,) if status and status != NEEDS_REVIEW else ()
    found = jobs_mod.select(jobs_mod.load_jobs(ledger), repo=repo or None, statuses=wanted)
    if status == NEEDS_REVIEW:
        found = [j for j in found if j.status != "running" and j.state == "open" and j.needs_human_review is not False]
    return [row(j) for j in reversed(found)]


def shown_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the live stream, every string as `visible` shows it (the page's script sets them as text)."""
    def one(value: Any) -> Any:
        if isinstance(value, str):
            return visible(value)
        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        return value

    return [one(r) for r in rows]


@dataclass(frozen=True)
class DiffView:
    page: patch.Page | None
    stat: str
    refused: str | None  # why there is no diff (no commit yet, objects gone, ...)
    # sha256 of the patch the page was made from, when the page shows all of it: the land form carries it,
    # and the page lands only that patch (`shown_digest`). "" when something was cut: no landing from here.
    digest: str = ""


def shown_digest(patch_bytes: bytes) -> str:
    return hashlib.sha256(patch_bytes).hexdigest()


def landable_digest(job: jobs_mod.Job) -> str:
    """The digest a page of this job's diff carries now (`DiffView.digest`), "" when it would cut anything:
    the same cuts as the page, without colouring it (a land needs the limits, not the highlighting)."""
    got = diff(job) if job.commit is not None else None
    if not isinstance(got, Diff):
        return ""
    return shown_digest(got.patch) if patch.split(got.patch, colour_chars=0).whole else ""


def diff_view(job: jobs_mod.Job) -> DiffView:
    if job.commit is None:
        return DiffView(None, "", "the job has no commit (it was refused, failed before its tree was built, "
                        "or is still running)")
    got = diff(job)
    if isinstance(got, Outcome):
        return DiffView(None, "", f"{got.code.value}: {got.reason}")
    assert isinstance(got, Diff)
    page = patch.split(got.patch)
    return DiffView(page, got.stat, None, shown_digest(got.patch) if page.whole else "")


def _payload_text(payload: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in payload.items() if k != "jobId"}, default=str, ensure_ascii=False)
    return text if len(text) <= PAYLOAD_CHARS else text[:PAYLOAD_CHARS] + f"… ({len(text)} chars)"


TEST_COUNTS = ("collected", "passed", "failed", "skipped", "errors", "xfailed", "deselected")


def _validation(v: dict[str, Any]) -> dict[str, Any]:
    """One validation record with its per-test counts (what the runner reported) as `name: n` pairs."""
    tests = v.get("tests") if isinstance(v.get("tests"), dict) else None
    counts = [(k, tests[k]) for k in TEST_COUNTS if tests and isinstance(tests.get(k), int)]
    return {**v, "counts": counts, "countsSource": (tests or {}).get("source")}


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
        "validation": [_validation(v) for v in shown["validation"] if isinstance(v, dict)],
        "task": task_text(job), "taskChars": TASK_CHARS, "validationLog": shown["validation_log"],
        "ledger": rows, "gate": [r for r in rows if r["kind"] in jobs_mod.GATE_KINDS],
        "diff": diff_view(job) if ended else DiffView(None, "", "the job is still running"),
        "progress": progress(job),
        "canLand": ended and job.state == "open" and job.commit is not None,
        "landBlocked": blocked, "canDiscard": ended and job.state != "discarded",
    }


def race_page(ledger: Ledger, race: races.Race) -> dict[str, Any]:
    """A race's jobs side by side, best first (the race's own ranking; a race still running: as asked), each
    column a job's page (its verdict, tests, risks, diff) with its place and the reasons for it."""
    placed = {str(r.get("jobId")): r for r in race.ranking}
    order = [str(r.get("jobId")) for r in race.ranking] or list(race.jobs)
    columns = []
    for job_id in order:
        found = jobs_mod.find(ledger, job_id)
        if isinstance(found, Outcome):
            columns.append({"missing": found.reason, "jobId": job_id, "place": placed.get(job_id)})
            continue
        columns.append({**job_page(ledger, found), "place": placed.get(job_id)})
    return {"race": race.to_dict(), "columns": columns,
            "landed": next((c["job"]["jobId"] for c in columns if c.get("job", {}).get("state") == "landed"), None)}
