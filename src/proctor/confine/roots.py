"""A job's allowed roots: which paths of a linked worktree's repo the agent may write, and hard-link refusal.

Owns deriving a ConfineRequest from the repo layout (creating the job's ref and reflog directories, since
bind mounts and Landlock rules need existing paths) and listing planted hard links. It never runs git,
never spawns, and never decides the branch name (the host does; it must live in a directory of its own).

Why the ref *directory* and not the ref file: git updates `refs/heads/B` by creating `B.lock` beside it and
renaming it over `B`. A read-only parent refuses the lock file, and a bind-mounted file cannot be renamed
over (EBUSY); Landlock likewise needs MAKE_REG/REMOVE_FILE on the parent. So the job gets the parent
directory, which must hold nothing but its own branch, or the agent could rewrite its neighbours.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from proctor.confine.request import ConfineRequest, Unavailable
from proctor.contract import check_ref
from proctor.home import proctor_home


def _other_refs(ref_dir: Path, leaf: str, common: Path, prefix: str) -> list[str]:
    others = [e for e in os.listdir(ref_dir) if e not in (leaf, f"{leaf}.lock")]
    try:
        packed = (common / "packed-refs").read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        packed = []
    # A packed neighbour counts too: a loose file of the same name would shadow it.
    for line in packed:
        fields = line.split()
        if len(fields) == 2 and not line.startswith(("#", "^")) and fields[1].startswith(f"{prefix}/"):
            if fields[1] != f"{prefix}/{leaf}":
                others.append(fields[1])
    return others


def job_roots(
    repo_common_git_dir: Path,
    worktree_git_dir: Path,
    branch: str,
    worktree: Path,
    tmpdir: Path,
    state_dirs: Iterable[Path] = (),
    *,
    network: bool = False,
    home: Path | None = None,
) -> ConfineRequest | Unavailable:
    """The roots of one job on a linked worktree (`git worktree add`), or why they cannot be granted safely.

    Writable: the worktree, `<common>/worktrees/<id>`, `<common>/objects`, the branch's ref directory and its
    reflog directory, `tmpdir`, `state_dirs`. Read-only even where reachable: the main checkout, the common
    dir (HEAD, config, hooks/, packed-refs, other refs), the worktree's `.git` pointer, and the
    `commondir`/`gitdir` links of the job's metadata. Hidden (not even readable): $PROCTOR_HOME.
    """
    state = tuple(Path(d).resolve() for d in state_dirs)
    try:
        check_ref(branch)
    except ValueError as exc:
        return Unavailable(str(exc))
    common, wt_git, worktree = repo_common_git_dir.resolve(), worktree_git_dir.resolve(), worktree.resolve()
    prefix, _, leaf = branch.rpartition("/")
    if not prefix:
        return Unavailable(f"branch {branch!r} would share refs/heads/ with every branch (master included); "
                           "name it inside a per-job directory, e.g. wt/<jobId>/<ticket>")
    ref_dir = common / "refs" / "heads" / prefix
    log_dir = common / "logs" / "refs" / "heads" / prefix
    try:
        for d in (ref_dir, log_dir, tmpdir, *state):
            d.mkdir(parents=True, exist_ok=True)
        others = _other_refs(ref_dir, leaf, common, f"refs/heads/{prefix}")
    except OSError as exc:
        return Unavailable(f"cannot prepare the job's git roots: {exc}")
    if others:
        return Unavailable(f"refs/heads/{prefix}/ also holds {sorted(others)[:5]}; the job's branch needs "
                           "a directory of its own, or the agent could rewrite those")
    main_checkout = (common.parent,) if common.name == ".git" else ()
    inner = (worktree / ".git", wt_git / "commondir", wt_git / "gitdir")
    readonly = (*main_checkout, common, *(p for p in inner if p.exists()))
    return ConfineRequest(
        worktree=worktree,
        git_paths=(wt_git, common / "objects", ref_dir, log_dir),
        readonly=readonly,
        tmpdir=tmpdir.resolve(),
        state_dirs=state,
        network=network,
        hidden=((home or proctor_home()).resolve(),),
    )


def refuse_hard_links(worktree: Path) -> list[str]:
    """Worktree files (relative paths) with more than one link: writable through in every mode (measured,
    research/sandbox.md 2d), so the host refuses to start on any. One scandir pass (an lstat per file)."""
    found: list[str] = []
    stack = [str(worktree)]
    root_len = len(str(worktree)) + 1
    while stack:
        try:
            it = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        with it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_nlink > 1:
                        found.append(entry.path[root_len:])
                except FileNotFoundError:
                    continue
    return sorted(found)
