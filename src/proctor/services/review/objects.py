"""A job's objects, read through a git dir the host makes for the purpose: never the job's own git dir.

Owns opening a job for `diff` and `land`: a fresh git dir (config written by the host, no hooks, no
template) whose `objects/info/alternates` names the job's object store and then the main repo's, and the
checks that what it finds is what the ledger recorded — the commit of the `job.tree` row, holding that
row's tree. A reviewer may have run git in the job's checkout (its config is whatever they left), and the
host never points git at it: here it is only a directory of object files (DESIGN.md 9a).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.git import worktree
from proctor.mechanisms.git.command import git
from proctor.services.review.jobs import Job
from proctor.services.review.outcome import Code, Outcome, refuse

SCRATCH_BRANCH = "proctor-review"
HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclass(frozen=True)
class JobObjects:
    git_dir: Path  # the host's, made here
    repo: worktree.Repo  # the main repo
    commit: str  # the job's commit, as the ledger recorded it
    tree: str
    base: str  # its parent: the base the job started from


def open_objects(job: Job, where: Path) -> JobObjects | Outcome:
    """Make `where/.git` borrowing the job's and the main repo's objects, and check the job's commit."""
    if job.commit is None or job.tree is None:
        return refuse(Code.NO_COMMIT, f"job {job.job_id} has no commit: its tree was never built ({job.status})")
    if not (HEX.fullmatch(job.commit) and HEX.fullmatch(job.tree)):
        return refuse(Code.RECORD_MISMATCH, f"the ledger's job.tree row of {job.job_id} names no object id")
    recorded = (job.record.result or {}).get("commit")
    if recorded is not None and recorded != job.commit:
        return refuse(Code.RECORD_MISMATCH, f"result.json names commit {str(recorded)[:12]} but the ledger's "
                      f"job.tree row {job.commit[:12]}: the record was altered")
    if job.state == "discarded":
        return refuse(Code.DISCARDED, f"job {job.job_id} was discarded: its objects are gone")
    repo = worktree.open_repo(job.repo or "")
    if isinstance(repo, worktree.Failure):
        return refuse(Code.REPO_UNUSABLE, repo.reason)
    job_objects = (job.checkout or Path("/nonexistent")) / ".git" / "objects"
    present = job_objects.is_dir() and not job_objects.is_symlink()
    if not present and job.state != "landed":  # a landed job's objects are in the main repo
        return refuse(Code.OBJECTS_MISSING, f"job {job.job_id} has no object store at {job_objects}")
    failure = worktree.init_git_dir(where, repo, SCRATCH_BRANCH, alternates=(job_objects,) if present else ())
    if failure is not None:
        return refuse(Code.GIT_FAILED, failure.reason)
    git_dir = where / ".git"
    # One call: the commit's tree and its first parent (a commit the host made has exactly one).
    res = git(["rev-parse", f"{job.commit}^{{tree}}", f"{job.commit}^1"], git_dir=git_dir)
    lines = res.text.splitlines()
    if not res.ok or len(lines) != 2:
        return refuse(Code.OBJECTS_MISSING, f"the job's commit {job.commit[:12]} is not in its object store "
                      f"({res.err or 'no parent'})")
    if lines[0] != job.tree:
        return refuse(Code.RECORD_MISMATCH, f"commit {job.commit[:12]} holds tree {lines[0][:12]}, the ledger "
                      f"recorded {job.tree[:12]}")
    return JobObjects(git_dir, repo, job.commit, job.tree, lines[1])
