"""`proctor diff JOB`: the job's commit against its base, computed host-safely.

Owns the patch (and its stat) between the base and the job's commit, read from objects alone in a git
dir the host makes (proctor.services.review.objects): no work tree, so no `.gitattributes` of the agent's is read;
no external diff, no textconv, no filter, no pager, no colour. It never runs git in the job's checkout.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.git.command import git
from proctor.mechanisms.git.trees import changed_paths
from proctor.mechanisms.git.worktree import Failure
from proctor.services.review.jobs import Job
from proctor.services.review.objects import JobObjects, open_objects
from proctor.services.review.outcome import Code, Outcome, refuse

DIFF_FLAGS = ("--no-ext-diff", "--no-textconv", "--no-color", "-M", "--root")


@dataclass(frozen=True)
class Diff:
    base: str
    commit: str
    files: list[str]
    stat: str
    patch: bytes


def diff(job: Job, *, binary: bool = False) -> Diff | Outcome:
    where = Path(tempfile.mkdtemp(prefix=f"proctor-diff-{job.job_id}-"))
    try:
        objs = open_objects(job, where)
        if isinstance(objs, Outcome):
            return objs
        return _diff(objs, binary)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def lines(job: Job) -> int | Outcome:
    """Lines the job's commit adds and removes against its base (a binary file counts one), from objects
    alone as `diff` reads them: a race weighs its jobs' diffs by it."""
    where = Path(tempfile.mkdtemp(prefix=f"proctor-diff-{job.job_id}-"))
    try:
        objs = open_objects(job, where)
        if isinstance(objs, Outcome):
            return objs
        # Renames counted whole (--no-renames after DIFF_FLAGS' -M): what a reviewer reads, line by line.
        res = git(["diff-tree", "--numstat", "-r", *DIFF_FLAGS, "--no-renames", objs.base, objs.commit],
                  git_dir=objs.git_dir)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if not res.ok:
        return refuse(Code.GIT_FAILED, f"git diff-tree failed: {res.err}")
    total = 0
    for line in res.text.splitlines():
        added, _, rest = line.partition("\t")
        removed = rest.partition("\t")[0]
        total += (int(added) if added.isdigit() else 1) + (int(removed) if removed.isdigit() else 0)
    return total


def _diff(objs: JobObjects, binary: bool) -> Diff | Outcome:
    files = changed_paths(objs.git_dir, objs.base, objs.commit)
    if isinstance(files, Failure):
        return refuse(Code.GIT_FAILED, files.reason)
    stat = git(["diff-tree", "--stat=200", *DIFF_FLAGS, objs.base, objs.commit], git_dir=objs.git_dir)
    patch = git(["diff-tree", "-p", *DIFF_FLAGS, *(("--binary",) if binary else ()), objs.base, objs.commit],
                git_dir=objs.git_dir)
    if not stat.ok or not patch.ok:
        return refuse(Code.GIT_FAILED, f"git diff-tree failed: {stat.err or patch.err}")
    return Diff(objs.base, objs.commit, files, stat.out.decode("utf-8", "replace"), patch.out)
