"""The per-job git worktree: base-ref resolution, creation beside the repo, and what changed in it.

Owns `{repo}-agents/{jobId}` on branch `wt/{jobId}/{ticket}`, cut from a validated base ref passed after
`--`. It never touches the main checkout's files or its HEAD, and never removes a worktree (review, land,
discard and gc are separate verbs): a job's worktree is its review surface.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proctor.git import git, parse_name_status_z, parse_status_z


@dataclass(frozen=True)
class Repo:
    path: Path  # top of the main checkout
    common_dir: Path  # the shared .git


@dataclass(frozen=True)
class Worktree:
    path: Path
    branch: str
    base_ref: str
    base_sha: str
    git_dir: Path  # <common>/worktrees/<name>, read once at creation, before any agent ran
    common_dir: Path


@dataclass(frozen=True)
class Failure:
    reason: str


def open_repo(path: str | Path) -> Repo | Failure:
    p = Path(path)
    if not p.is_dir():
        return Failure(f"repo {str(path)!r} is not an existing directory")
    top = git(["rev-parse", "--show-toplevel"], cwd=p)
    common = git(["rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=p)
    if not top.ok or not common.ok:
        return Failure(f"repo {str(path)!r} is not a git repository ({top.err or common.err})")
    return Repo(Path(top.text), Path(common.text))


def default_base(repo: Repo) -> str:
    """`master` where it exists, else `main`, else the branch HEAD names, else HEAD itself."""
    for name in ("master", "main"):
        if git(["show-ref", "--verify", "--quiet", f"refs/heads/{name}"], cwd=repo.path).ok:
            return name
    head = git(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=repo.path)
    return head.text if head.ok and head.text else "HEAD"


def resolve_base(repo: Repo, ref: str) -> str | Failure:
    res = git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"], cwd=repo.path)
    if not res.ok or not res.text:
        return Failure(f"base ref {ref!r} does not name a commit in {repo.path}")
    return res.text


def create(repo: Repo, job_id: str, ticket: str, base_ref: str) -> Worktree | Failure:
    base_sha = resolve_base(repo, base_ref)
    if isinstance(base_sha, Failure):
        return base_sha
    path = repo.path.parent / f"{repo.path.name}-agents" / job_id
    branch = f"wt/{job_id}/{ticket}"
    if path.exists():
        return Failure(f"worktree path {path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    # The sha, not the ref, after `--`: what we validated is exactly what we cut from.
    add = git(["worktree", "add", "--quiet", "-b", branch, "--", str(path), base_sha], cwd=repo.path)
    if not add.ok:
        return Failure(f"git worktree add failed: {add.err}")
    gd = git(["rev-parse", "--absolute-git-dir"], cwd=path)
    if not gd.ok:
        return Failure(f"new worktree has no git dir: {gd.err}")
    return Worktree(path, branch, base_ref, base_sha, Path(gd.text), repo.common_dir)


def changed_files(wt: Worktree) -> list[str] | Failure:
    """Everything that differs from the base: commits the agent made on its branch plus the working tree.

    An agent that commits leaves a clean `git status`; the committed diff keeps it from looking idle.
    """
    kw = {"cwd": wt.path, "git_dir": wt.git_dir, "work_tree": wt.path}
    status = git(["status", "--porcelain=v1", "-z", "--untracked-files=all"], **kw)
    if not status.ok:
        return Failure(f"git status failed: {status.err or 'exit ' + str(status.code)}")
    committed = git(["diff", "--name-status", "-z", "-M", wt.base_sha, "HEAD", "--"], **kw)
    if not committed.ok:
        return Failure(f"git diff against the base failed: {committed.err or 'exit ' + str(committed.code)}")
    seen: dict[str, None] = {}
    for path in parse_name_status_z(committed.out) + parse_status_z(status.out):
        seen.setdefault(path, None)
    return list(seen)
