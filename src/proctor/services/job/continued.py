"""A follow-up: a job that continues an earlier job's work with a new brief (`continues`, `run-agent
--continue JOB`).

Owns what such a job starts from and what it is judged against. The earlier job is read back as review
reads it (its ledger rows, its commit checked against the `job.tree` row, its objects through a git dir the
host makes, never the job's own). The new job is cut from the chain's first base, as any job, so the base's
own run (the baseline), the validation plan and the repo's settings are the base's; then, last before the
agent, the earlier job's tree is laid over the fresh checkout. The agent finds the chain's work as changes
to the base, and the tree that lands, its diff, its risks and its verdict are the chain's as a whole
against that base: what the chain fixed and broke, not only the last step. Landing it lands the chain.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.git import worktree
from proctor.services.job.context import Job
from proctor.services.review import jobs
from proctor.services.review.objects import open_objects
from proctor.services.review.outcome import Outcome

BRIEF_MAX = 20_000  # characters of the earlier briefs carried into the new prompt


@dataclass(frozen=True)
class Earlier:
    job: jobs.Job  # the job continued, as review reads it
    base: worktree.Base  # the chain's base: the new job is cut from it and judged against it
    chain: tuple[str, ...]  # the jobs the new one continues, oldest first
    brief: str  # the chain's earlier briefs, oldest first


def resolve(job: Job, repo: worktree.Repo) -> Earlier | str:
    """The job `continues` names, when it is one of this repo's with a commit the new job can start from;
    else why not."""
    ident = job.request.continues or ""
    if not job.trusted:
        return "continues is the person's own: a requester's job cannot start from another job's tree"
    found = jobs.find(job.ledger, ident)
    if isinstance(found, Outcome):
        return f"continues: {found.reason}"
    if found.status in ("running",):
        return f"continues: job {found.job_id} is still running"
    other = worktree.open_repo(found.repo or "")
    if isinstance(other, worktree.Failure) or other.common_dir != repo.common_dir:
        return f"continues: job {found.job_id} is a job of {found.repo}, not of {job.request.repo}"
    if found.commit is None:
        return f"continues: job {found.job_id} has no commit to start from (its tree was never built: {found.status})"
    result = found.record.result or {}
    with tempfile.TemporaryDirectory(prefix="proctor-continue-") as scratch:
        objects = open_objects(found, Path(scratch))
        if isinstance(objects, Outcome):
            return f"continues: {objects.reason}"
        base_ref = str(result.get("baseRef") or found.base or objects.base)
    chain = (*[str(j) for j in result.get("chain") or [] if isinstance(j, str)], found.job_id)
    briefs = []
    for ident in chain:
        one = found if ident == found.job_id else jobs.find(job.ledger, ident)
        task = (one.record.request or {}).get("task") if isinstance(one, jobs.Job) else None
        if isinstance(task, str) and task.strip():
            briefs.append(task.strip())
    brief = "\n\n".join(briefs)
    return Earlier(found, worktree.Base(base_ref, objects.base), chain, brief[-BRIEF_MAX:])


def prompt(task: str, earlier: Earlier) -> str:
    """The new brief, told where it starts: the earlier work is in the tree already, uncommitted."""
    return (f"{task}\n\n---\nThis continues earlier work (proctor job {earlier.job.job_id}): its changes are already "
            f"in this working tree, as uncommitted changes to the base. The earlier brief was:\n\n{earlier.brief}\n")


def lay(job: Job, wt: worktree.Worktree, earlier: Earlier) -> str | None:
    """The earlier job's tree laid over the fresh checkout of the base (before the agent, after the base's own
    run): through a git dir of the host's borrowing that job's objects, its index a copy of the job's own
    (the base's, stat data included), so git writes exactly what the chain changed. The job's own git dir
    keeps the base as HEAD and index. None, or why it could not be done."""
    with tempfile.TemporaryDirectory(prefix="proctor-continue-", dir=job.host_tmp) as scratch:
        objects = open_objects(earlier.job, Path(scratch))
        if isinstance(objects, Outcome):
            return objects.reason
        if objects.base != wt.base_sha:
            return (f"job {earlier.job.job_id} was cut from {objects.base[:12]}, not from the base "
                    f"{wt.base_sha[:12]} this job was")
        # The job's own index (the host's, from the base's checkout a moment ago: the agent has not run) with
        # its stat data, so git rewrites only what the chain changed and the rest keeps what landing vouches.
        try:
            shutil.copyfile(wt.path / ".git" / "index", objects.git_dir / "index")
        except OSError as exc:
            return f"the job's index could not be read: {exc}"
        failure = worktree.checkout(objects.git_dir, wt.path, objects.commit)
        return failure.reason if failure is not None else None
