"""A metadata snapshot of a project tree (tracked, untracked and ignored alike) and the diff of two snapshots.

Owns walking the tree with `os.scandir` (one lstat per entry, nothing from git, so `.gitignore` hides
nothing), the git dir's persistence paths a command could use to run code later (hooks, config, info,
HEAD), and what "changed" means. Each file is `(kind, mode, size, mtime_ns, ctime_ns, ino, link target)`;
ctime changes on every write, chmod, utime and rename and cannot be set by a user, so metadata alone tells a
same-size same-mtime rewrite apart. It cannot for a "racy" file, one whose timestamps lie within the
filesystem's timestamp granularity of the snapshot (git's racy-git problem): a write in the same clock tick
leaves every field equal. Only those files are hashed, and hashed again afterwards if still equal.
It never runs git or a command and never decides whether a change was allowed (declared does).
"""

from __future__ import annotations

import gc
import hashlib
import marshal
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Covers the coarsest timestamps a project may sit on: 1 s (ext3, HFS+) and 2 s (FAT, some network
# filesystems); ext4/xfs/btrfs/tmpfs stamp at the kernel's coarse clock tick (1-10 ms).
RACY_WINDOW_NS = 2_000_000_000

FILE, DIR, LINK, OTHER = "f", "d", "l", "o"
# Split the walk with a forked worker only when the first levels already show this many folders.
PARALLEL_MIN_DIRS = 32
PARALLEL_PROBE_LEVELS = 3
_IFMT, _IFREG = 0o170000, stat.S_IFREG  # stat.S_ISREG, inlined for the hot loop
_UNREADABLE = -1  # in a folder's size field: it could not be listed

# A folder is (DIR, mode, 0, 0, 0, ino, None): its own size and times change whenever a child does, and the
# child shows in the diff itself.

Meta = tuple[str, int, int, int, int, int, str | None]


@dataclass(frozen=True)
class Snapshot:
    root: Path
    entries: Mapping[str, Meta]
    """Key (project-relative posix path; absolute for a watched path outside the root) -> metadata."""
    digests: Mapping[str, str] = field(default_factory=dict)
    """Content hashes of the files metadata could not vouch for."""


@dataclass(frozen=True)
class Changes:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    modified: tuple[str, ...]
    folders: frozenset[str]
    """Which of the changed keys are folders (before or after)."""

    @property
    def paths(self) -> list[str]:
        return sorted({*self.added, *self.removed, *self.modified})


def _digest(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "blake2b").hexdigest()
    except OSError as exc:
        return f"unreadable:{exc.errno}"


def take(root: Path, watch: Iterable[Path] = (), *, reference: Snapshot | None = None) -> Snapshot:
    """Walk `root` (every `.git` folder skipped) and each watched path.

    Without `reference` (the before-snapshot) racy files are hashed. With it (the after-snapshot) a file is
    hashed only when the reference hashed it and its metadata is unchanged: the only case a hash decides.
    """
    # Building ~100k tuples into a growing dict triggers the cyclic GC over and over, for nothing (tuples of
    # ints hold no cycles): on the bench tree a take went from ~0.8 s to ~0.55 s with it paused.
    paused = gc.isenabled()
    gc.disable()
    try:
        entries: dict[str, Meta] = {}
        digests: dict[str, str] = {}
        racy_from = time.time_ns() - RACY_WINDOW_NS if reference is None else None
        ref = reference if reference is not None and reference.digests else None
        root_s = str(root)
        _walk_tree(root_s + os.sep, "", entries, digests, racy_from, ref)
        for w in watch:
            w_s = str(w)
            key = os.path.relpath(w_s, root_s) if w.is_relative_to(root) else w_s
            try:
                st = os.lstat(w_s)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                entries[key] = (DIR, st.st_mode, 0, 0, 0, st.st_ino, None)
                _walk([(w_s + os.sep, key + "/")], entries, digests, racy_from, ref)
            else:
                _entry(w_s, key, st, entries, digests, racy_from, ref)
        return Snapshot(root, entries, digests)
    finally:
        if paused:
            gc.enable()


def _entry(
    path: str, key: str, st: os.stat_result, entries: dict[str, Meta], digests: dict[str, str],
    racy_from: int | None, ref: Snapshot | None,
) -> None:
    """One non-folder entry (the slow path: watched files, links, specials, racy or re-hashed files)."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        meta: Meta = (FILE, mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, None)
        entries[key] = meta
        if racy_from is not None:
            if st.st_ctime_ns >= racy_from or st.st_mtime_ns >= racy_from:
                digests[key] = _digest(path)
        elif ref is not None and key in ref.digests and ref.entries.get(key) == meta:
            digests[key] = _digest(path)
        return
    target = os.readlink(path) if stat.S_ISLNK(mode) else None
    kind = LINK if target is not None else OTHER
    entries[key] = (kind, mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, target)


def _scan(
    path: str, pre: str, entries: dict[str, Meta], digests: dict[str, str], racy_from: int | None,
    ref: Snapshot | None, push: Callable[[tuple[str, str]], None],
) -> None:
    """The hot loop, once per folder: one scandir, one lstat per entry, a plain tuple per regular file."""
    rehash = ref.digests if ref is not None else {}
    # Before-snapshot: hash files newer than racy_from. After-snapshot: no racy rule (see `take`); a file
    # is hashed only when the reference hashed it. Both checks are inlined: this loop runs once per file.
    racy = racy_from if racy_from is not None else 1 << 63  # after-snapshot: nothing is racy
    try:
        it = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except PermissionError:
        # Unreadable now: its folder entry differs from a readable one's, so the change shows.
        old = entries.get(pre[:-1])
        if old is not None:
            entries[pre[:-1]] = (DIR, old[1], _UNREADABLE, 0, 0, old[5], None)
        return
    with it:
        for e in it:
            name = e.name
            key = pre + name
            try:
                if e.is_dir(follow_symlinks=False):
                    if name == ".git":
                        continue
                    st = e.stat(follow_symlinks=False)
                    entries[key] = (DIR, st.st_mode, 0, 0, 0, st.st_ino, None)
                    push((path + name + "/", key + "/"))
                    continue
                st = e.stat(follow_symlinks=False)
                mode = st.st_mode
                ctime, mtime = st.st_ctime_ns, st.st_mtime_ns
                if mode & _IFMT == _IFREG and ctime < racy and mtime < racy and key not in rehash:
                    entries[key] = (FILE, mode, st.st_size, mtime, ctime, st.st_ino, None)
                else:
                    _entry(path + name, key, st, entries, digests, racy_from, ref)
            except FileNotFoundError:
                continue  # gone between listing and lstat: absent, as it is now


def _walk(
    stack: list[tuple[str, str]], entries: dict[str, Meta], digests: dict[str, str], racy_from: int | None,
    ref: Snapshot | None,
) -> None:
    pop, push = stack.pop, stack.append
    while stack:
        path, pre = pop()
        _scan(path, pre, entries, digests, racy_from, ref, push)


def _can_fork() -> bool:
    # fork() copies only the calling thread; with other threads alive a lock one of them holds could
    # hang the child, so a multi-threaded host walks in one process.
    return hasattr(os, "fork") and (os.cpu_count() or 1) > 1 and threading.active_count() == 1


def _walk_tree(
    top: str, prefix: str, entries: dict[str, Meta], digests: dict[str, str], racy_from: int | None,
    ref: Snapshot | None,
) -> None:
    """Walk `top`; a big tree is split with one forked worker, since lstat-bound Python gains nothing from
    threads (the GIL) but does from a second process: bench/snapshot.py, 100k files, ~510 -> ~320 ms."""
    frontier = [(top, prefix)]
    for _ in range(PARALLEL_PROBE_LEVELS):
        if not frontier or len(frontier) >= PARALLEL_MIN_DIRS:
            break
        nxt: list[tuple[str, str]] = []
        for path, pre in frontier:
            _scan(path, pre, entries, digests, racy_from, ref, nxt.append)
        frontier = nxt
    if len(frontier) < PARALLEL_MIN_DIRS or not _can_fork():
        _walk(frontier, entries, digests, racy_from, ref)
        return
    mine, theirs = frontier[0::2], frontier[1::2]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: walk its half, send it back, never return into the caller's code
        status = 1
        try:
            os.close(r)
            part: dict[str, Meta] = {}
            part_digests: dict[str, str] = {}
            _walk(theirs, part, part_digests, racy_from, ref)
            with os.fdopen(w, "wb") as fh:
                fh.write(marshal.dumps((part, part_digests)))
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    try:
        _walk(mine, entries, digests, racy_from, ref)
        with os.fdopen(r, "rb") as fh:
            data = fh.read()
    finally:
        _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        raise OSError(f"snapshot worker for {top} failed (wait status {status})")
    part, part_digests = marshal.loads(data)
    entries.update(part)
    digests.update(part_digests)


def diff(before: Snapshot, after: Snapshot) -> Changes:
    b, a = before.entries, after.entries
    bd, ad = before.digests, after.digests
    added: list[str] = []
    modified: list[str] = []
    folders: set[str] = set()
    for k, v in a.items():
        old = b.get(k)
        if old is None:
            added.append(k)
        elif old != v or (bd and bd.get(k) != ad.get(k)):
            modified.append(k)
        else:
            continue
        if v[0] == DIR or (old is not None and old[0] == DIR):
            folders.add(k)
    removed = [k for k in b if k not in a]
    folders.update(k for k in removed if b[k][0] == DIR)
    return Changes(tuple(sorted(added)), tuple(sorted(removed)), tuple(sorted(modified)), frozenset(folders))


def git_watch_paths(git_dirs: Iterable[Path]) -> list[Path]:
    """Inside each git dir, what makes git run code or change what it checks out: hooks, config, info, HEAD."""
    names = ("config", "config.worktree", "HEAD", "hooks", "info", "commondir", "gitdir")
    out: list[Path] = []
    for d in git_dirs:
        for n in names:
            p = d / n
            if p not in out:
                out.append(p)
    return out
