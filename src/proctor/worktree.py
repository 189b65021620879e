"""The per-job git worktree: base-ref resolution, creation beside the repo, and what changed in it.

Owns `{repo}-agents/{jobId}` on branch `wt/{jobId}/{ticket}`, cut from a validated base ref passed after
`--`. It never touches the main checkout's files or its HEAD, and never removes a worktree (review, land,
discard and gc are separate verbs): a job's worktree is its review surface.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proctor.git import git, parse_name_status_z, parse_status_v2_z


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
    res = git(["rev-parse", "--show-toplevel", "--path-format=absolute", "--git-common-dir"], cwd=p)
    lines = res.text.splitlines()
    if not res.ok or len(lines) != 2:
        return Failure(f"repo {str(path)!r} is not a git repository ({res.err or 'no work tree'})")
    return Repo(Path(lines[0]), Path(lines[1]))


@dataclass(frozen=True)
class Base:
    ref: str
    sha: str


def default_base(repo: Repo) -> Base | Failure:
    """`master` where it exists, else `main`, else the branch HEAD names, else HEAD itself."""
    heads = git(["for-each-ref", "--format=%(refname:short) %(objectname)", "refs/heads/master", "refs/heads/main"],
                cwd=repo.path)
    found = dict(line.split(" ", 1) for line in heads.text.splitlines() if " " in line) if heads.ok else {}
    for name in ("master", "main"):
        if name in found:
            return Base(name, found[name])
    head = git(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=repo.path)
    return resolve_base(repo, head.text if head.ok and head.text else "HEAD")


def resolve_base(repo: Repo, ref: str) -> Base | Failure:
    res = git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"], cwd=repo.path)
    if not res.ok or not res.text:
        return Failure(f"base ref {ref!r} does not name a commit in {repo.path}")
    return Base(ref, res.text)


def _read_gitdir(path: Path) -> Path | None:
    # Read at creation, before any agent ran: later the pointer file is the agent's to rewrite.
    try:
        text = (path / ".git").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not text.startswith("gitdir: "):
        return None
    gd = Path(text.removeprefix("gitdir: "))
    return gd if gd.is_absolute() else (path / gd).resolve()


def create(repo: Repo, job_id: str, ticket: str, base: Base) -> Worktree | Failure:
    path = repo.path.parent / f"{repo.path.name}-agents" / job_id
    branch = f"wt/{job_id}/{ticket}"
    if path.exists():
        return Failure(f"worktree path {path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    # The sha, not the ref, after `--`: what we validated is exactly what we cut from.
    add = git(["worktree", "add", "--quiet", "-b", branch, "--", str(path), base.sha], cwd=repo.path)
    if not add.ok:
        return Failure(f"git worktree add failed: {add.err}")
    gd = _read_gitdir(path)
    if gd is None:
        return Failure(f"new worktree {path} has no readable .git pointer")
    return Worktree(path, branch, base.ref, base.sha, gd, repo.common_dir)


def changed_files(wt: Worktree) -> list[str] | Failure:
    """Everything that differs from the base: commits the agent made on its branch plus the working tree.

    An agent that commits leaves a clean `git status`; the committed diff keeps it from looking idle. The
    status header names HEAD, so the diff runs only when HEAD moved.
    """
    kw = {"cwd": wt.path, "git_dir": wt.git_dir, "work_tree": wt.path}
    status = git(["status", "--porcelain=v2", "-z", "--branch", "--untracked-files=all"], **kw)
    if not status.ok:
        return Failure(f"git status failed: {status.err or 'exit ' + str(status.code)}")
    head, paths = parse_status_v2_z(status.out)
    committed: list[str] = []
    if head != wt.base_sha:
        diff = git(["diff", "--name-status", "-z", "-M", wt.base_sha, "HEAD", "--"], **kw)
        if not diff.ok:
            return Failure(f"git diff against the base failed: {diff.err or 'exit ' + str(diff.code)}")
        committed = parse_name_status_z(diff.out)
    return list(dict.fromkeys(committed + paths))
