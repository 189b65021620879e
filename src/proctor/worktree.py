"""The per-job git worktree: base-ref resolution, creation beside the repo, and what changed in it.

Owns `{repo}-agents/{jobId}` on branch `wt/{jobId}/{ticket}`, cut from a validated base ref passed after
`--`. It never touches the main checkout's files or its HEAD, and never removes a worktree (review, land,
discard and gc are separate verbs): a job's worktree is its review surface.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from proctor.git import git, parse_status_v2_z


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
    # A copy of the index as checkout wrote it, before any agent ran: changes are listed against it, never
    # against the agent's own index (which can hide an edit with --skip-worktree / --assume-unchanged).
    pristine_index: Path | None = None
    pointers: tuple[tuple[str, bytes], ...] = ()  # the metadata files git trusts, as created


POINTER_FILES = ("commondir", "gitdir", "HEAD")


def path_for(repo: Repo, job_id: str) -> Path:
    return repo.path.parent / f"{repo.path.name}-agents" / job_id


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


def create(repo: Repo, job_id: str, ticket: str, base: Base, private_dir: Path) -> Worktree | Failure:
    """Cut the worktree; `private_dir` (the job's own temp dir, outside every agent-writable root) keeps
    the pristine index copy."""
    path = path_for(repo, job_id)
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
    pristine = private_dir / "index"
    try:
        shutil.copyfile(gd / "index", pristine)
        pointers = tuple((name, (gd / name).read_bytes()) for name in POINTER_FILES if (gd / name).exists())
    except OSError as exc:
        return Failure(f"cannot snapshot the new worktree's metadata: {exc}")
    return Worktree(path, branch, base.ref, base.sha, gd, repo.common_dir, pristine, pointers)


def tampered_pointers(wt: Worktree) -> list[str]:
    """Metadata files of the job that differ from creation (HEAD moving on a commit is expected)."""
    out = []
    for name, before in wt.pointers:
        try:
            now = (wt.git_dir / name).read_bytes()
        except OSError:
            now = None
        if name == "HEAD":
            if now is None or not now.startswith(b"ref: refs/heads/" + wt.branch.encode()):
                out.append(f"{name} no longer names the job's branch")
        elif now != before:
            out.append(f"{name} was rewritten")
    return out


def changed_files(wt: Worktree) -> list[str] | Failure:
    """Every path that differs from the base: the agent's commits and its working tree, untracked included.

    One `git status` against a private copy of the index as checkout wrote it (the base's tree, with
    stat data, so only changed files are re-hashed): the agent's own index, where `--skip-worktree` hides
    an edit, is never consulted. HEAD against that index gives what the agent committed, the index
    against the tree what it left uncommitted. Ignored files do not count.
    """
    if wt.pristine_index is None:
        return Failure("the worktree has no pristine index to compare against")
    index = wt.pristine_index.with_name(f"index-{time.monotonic_ns()}")
    try:
        shutil.copyfile(wt.pristine_index, index)
    except OSError as exc:
        return Failure(f"cannot copy the private index: {exc}")
    try:
        status = git(["status", "--porcelain=v2", "-z", "--untracked-files=all"], cwd=wt.path,
                     git_dir=wt.git_dir, work_tree=wt.path, common_dir=wt.common_dir, index_file=index)
        if not status.ok:
            return Failure(f"git status failed: {status.err or 'exit ' + str(status.code)}")
        return list(dict.fromkeys(parse_status_v2_z(status.out)))
    finally:
        index.unlink(missing_ok=True)
        index.with_name(index.name + ".lock").unlink(missing_ok=True)
