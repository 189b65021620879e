"""A job's allowed roots, and hard-link refusal.

Owns deriving a ConfineRequest for one job directory (creating the dirs that bind mounts and Landlock
rules need) and listing planted hard links. It never runs git and never spawns.

A job's directory holds a repository of its own (proctor.mechanisms.git.worktree), so nothing of the main repo is ever
writable: not its objects, refs, config or checkout. That replaces granting the agent the main store and
its branch's ref directory, which let an agent rewrite master's blobs in place (found in review).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from proctor.mechanisms.confine.request import ConfineRequest, Unavailable
from proctor.home import proctor_home


def job_roots(
    worktree: Path,
    tmpdir: Path,
    state_dirs: Iterable[Path] = (),
    *,
    readonly: Iterable[Path] = (),
    network: bool = False,
    home: Path | None = None,
) -> ConfineRequest | Unavailable:
    """The roots of one job: writable `worktree` (its `.git` included: the job's own), `tmpdir` and
    `state_dirs`; `readonly` must stay visible and unwritable even under a private tmpfs (the main repo,
    whose objects the job borrows); $PROCTOR_HOME hidden, not even readable."""
    state = tuple(Path(d).resolve() for d in state_dirs)
    try:
        for d in (tmpdir, *state):
            if not d.is_file():  # a state file is granted as it is
                d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return Unavailable(f"cannot prepare the job's roots: {exc}")
    return ConfineRequest(
        worktree=worktree.resolve(),
        git_paths=(),
        readonly=tuple(Path(p).resolve() for p in readonly if Path(p).exists()),
        tmpdir=tmpdir.resolve(),
        state_dirs=state,
        network=network,
        hidden=((home or proctor_home()).resolve(),),
    )


def checkout_hidden(roots: ConfineRequest, checkout: Path, shown: Iterable[Path]) -> ConfineRequest | str:
    """`roots` with a person's `checkout` hidden but what `shown` names inside it (read-only), or why it
    cannot be: the roots' own writable dir lies inside it."""
    main = checkout.resolve()
    if roots.worktree.is_relative_to(main):
        return (f"the person's checkout {main} holds the job's own checkout (its worktree dir is inside it): its "
                "untracked and ignored files are not hidden from the agent and the code under test")
    kept = tuple(dict.fromkeys(p.resolve() for p in shown if p.exists() and p.resolve().is_relative_to(main)))
    readonly = tuple(p for p in roots.readonly if p != main) + tuple(p for p in kept if p not in roots.readonly)
    return dataclasses.replace(roots, readonly=readonly, hidden=(*roots.hidden, main))


def around(root: Path, targets: Sequence[Path]) -> Iterator[Path]:
    """Every entry below `root` that neither is one of `targets` nor holds one, descending only along the
    way down to them, in name order: the siblings that, together, cover all of `root` but the targets.
    Symlinks are skipped (a rule or a mount on one binds what it resolves to). Landlock's read rules
    around hidden paths and a command's hidden home around what it needs are both this walk."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        p = Path(entry.path)
        if p in targets or entry.is_symlink():
            continue
        if any(t.is_relative_to(p) for t in targets):
            yield from around(p, targets)
        else:
            yield p


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
