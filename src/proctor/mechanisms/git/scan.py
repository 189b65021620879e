"""The host's lstat walks of a directory it does not trust: the agent's, or one validation ran in.

Owns `scan` (the job's one walk of the agent's directory after it exited: special files, nested repos,
files over the size cap, and the lstat of every entry) and `walk` (the walk of a directory the host once made
a tree, entering only that tree's directories). Each directory is opened beneath the root with no symlink on
the way (proctor.mechanisms.confine.beneath); nothing here follows a link, opens a file or runs git.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.git.worktree import Failure


MAX_FILE_BYTES = 100 * 1024 * 1024  # a larger file is left out of the job's tree, and said so
MAX_ENTRIES = 2_000_000
# Files git reads whole for its rules wherever it walks (a pathspec exclusion does not stop it reading a
# directory's .gitignore): a special or oversized one is removed before git runs.
CONTROL_FILES = frozenset({".gitignore", ".gitattributes", ".gitmodules"})
MAX_CONTROL_BYTES = 1024 * 1024
BARE_REPO = frozenset({"HEAD", "objects", "refs"})  # what git's discovery takes for a git dir


@dataclass(frozen=True)
class Scan:
    special: tuple[str, ...] = ()  # FIFOs, sockets, devices: tamper (a FIFO hung the host in review)
    nested: tuple[str, ...] = ()  # directories holding a `.git` of their own: left out
    oversized: tuple[tuple[str, int], ...] = ()
    unreadable: tuple[str, ...] = ()
    # path -> lstat of every entry the walk saw (special and unreadable ones aside), each directory before
    # what is in it; the root's `.git` and nested repos are listed, never entered.
    seen: dict[str, os.stat_result] | None = field(default=None, compare=False, repr=False)

    @property
    def left_out(self) -> tuple[str, ...]:
        return (*self.special, *self.nested, *(p for p, _ in self.oversized), *self.unreadable)


def scan(root: Path, *, max_file_bytes: int = MAX_FILE_BYTES, max_entries: int = MAX_ENTRIES) -> Scan | Failure:
    """One lstat pass over the agent's directory (never following a link, never opening a file): each
    directory opened beneath the root with no symlink on the way."""
    special: list[str] = []
    nested: list[str] = []
    oversized: list[tuple[str, int]] = []
    unreadable: list[str] = []
    seen: dict[str, os.stat_result] = {}
    entries = 0
    try:
        root_fd = beneath.open_root(root)
    except OSError as exc:
        return Failure(f"cannot open the agent's directory {root}: {exc.strerror}")
    stack = [""]
    try:
        for rel, children in _listings(root_fd, stack):
            if children is None:
                unreadable.append(rel)
                continue
            names = {c.name for c in children}
            if rel and (".git" in names or BARE_REPO <= names):
                # A `.git` inside: git would record a gitlink and look into the nested repo for its HEAD.
                # A bare repo's layout: a reviewer's git run inside it would read its config (embedded
                # bare repos).
                nested.append(rel)
                continue
            for entry in children:
                entries += 1
                if entries > max_entries:
                    return Failure(f"the agent's worktree holds more than {max_entries} entries")
                path = f"{rel}/{entry.name}" if rel else entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    unreadable.append(path)
                    continue
                mode = st.st_mode
                if stat.S_ISDIR(mode):
                    seen[path] = st
                    if rel or entry.name != ".git":  # the agent's own git dir: never read
                        stack.append(path)
                elif stat.S_ISREG(mode):
                    seen[path] = st
                    if st.st_size > (MAX_CONTROL_BYTES if entry.name in CONTROL_FILES else max_file_bytes):
                        oversized.append((path, st.st_size))
                elif stat.S_ISLNK(mode):
                    seen[path] = st
                elif not rel and entry.name == ".git":
                    seen[path] = st  # whatever it is, never read; removed from the tree's checkout
                else:
                    special.append(path)
    finally:
        os.close(root_fd)
    return Scan(tuple(sorted(special)), tuple(sorted(nested)), tuple(sorted(oversized)), tuple(sorted(unreadable)),
                seen)


def walk(root: Path, walked: frozenset[str] | set[str], broken: set[str],
         strays: list[str]) -> Iterator[tuple[str, os.stat_result]]:
    """One lstat pass over a directory the host once made a tree, entering only the directories in `walked`
    (a tree's own, gitlinks included): whatever else is there goes whole. Each directory is opened beneath
    the root with no symlink on the way. Yields each entry and its lstat, each directory before what is in
    it; adds to `broken` the directories that could not be read, to `strays` the entries that could not be
    stat'ed."""
    root_fd = beneath.open_root(root)
    stack = [""]
    try:
        for rel, children in _listings(root_fd, stack):
            if children is None:
                if not rel:
                    raise OSError(f"cannot read {root}")
                broken.add(rel)
                continue
            for entry in children:
                path = f"{rel}/{entry.name}" if rel else entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    strays.append(path)
                    continue
                if path in walked and stat.S_ISDIR(st.st_mode):
                    stack.append(path)
                yield path, st
    finally:
        os.close(root_fd)


def _listings(root_fd: int, stack: list[str]) -> Iterator[tuple[str, list[os.DirEntry] | None]]:
    """Each directory on `stack` (which the caller adds to as it reads) listed beneath the root, its fd open
    while the caller lstats its entries; None for one that cannot be opened or read."""
    while stack:
        rel = stack.pop()
        listed = _list_dir(root_fd, rel)
        if listed is None:
            yield rel, None
            continue
        fd, children = listed
        try:
            yield rel, children
        finally:
            os.close(fd)


def _list_dir(root_fd: int, rel: str) -> tuple[int, list[os.DirEntry]] | None:
    """`rel` opened beneath the root (no symlink on the way) and listed; its fd stays open for the entries'
    lstat (the caller closes it). None when it cannot be opened or read."""
    try:
        fd = beneath.open_beneath(root_fd, rel, beneath.DIR_FLAGS) if rel else os.dup(root_fd)
    except OSError:
        return None
    try:
        with os.scandir(fd) as it:
            return fd, list(it)
    except OSError:
        os.close(fd)
        return None
