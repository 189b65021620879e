"""A metadata snapshot of a project tree (tracked, untracked and ignored alike) and the diff of two snapshots.

Owns walking the tree with `os.scandir` (one lstat per entry, nothing from git, so `.gitignore` hides
nothing), the git dirs (walked whole but for what git itself churns: loose objects, packs, logs, index),
and what "changed" means. Each file is `(kind, mode, size, mtime_ns, ctime_ns, ino, link target)`;
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
import re
import signal
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
_UNREADABLE = -1  # in a folder's size field: it could not be listed; in an OTHER entry's: it could not be lstat'd
_TOP_GIT = ".git"  # the project's own git dir: skipped by the tree walk only when it is watched as a git dir
_LOOSE = re.compile(r"[0-9a-f]{2}")

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
    """Walk `root` and each watched path; a watched folder is a git dir (see `_walk_git`).

    Only the project's own top-level `.git` folder is left out of the tree walk, and only when it is
    watched (then the git-dir walk covers it); nested or newly made `.git` folders are walked like any other.

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
        watch = list(watch)
        skip = _TOP_GIT if root / _TOP_GIT in watch and os.path.isdir(root / _TOP_GIT) else None
        _walk_tree(root_s + os.sep, "", entries, digests, racy_from, ref, skip)
        for w in watch:
            w_s = str(w)
            key = os.path.relpath(w_s, root_s) if w.is_relative_to(root) else w_s
            try:
                st = os.lstat(w_s)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                entries[key] = (DIR, st.st_mode, 0, 0, 0, st.st_ino, None)
                _walk_git(w_s + os.sep, key + "/", entries, digests, racy_from, ref)
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
    ref: Snapshot | None, push: Callable[[tuple[str, str]], None], skip: str | None = None,
) -> None:
    """The hot loop, once per folder: one scandir, one lstat per entry, a plain tuple per regular file.

    `skip`: the one key (the watched top-level `.git`) not to descend into."""
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
                    if key == skip:
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
            except PermissionError:
                # Listed but not searchable: a marker no lstat result equals, so the diff shows it.
                entries[key] = (OTHER, 0, _UNREADABLE, 0, 0, 0, None)


def _walk(
    stack: list[tuple[str, str]], entries: dict[str, Meta], digests: dict[str, str], racy_from: int | None,
    ref: Snapshot | None, skip: str | None = None,
) -> None:
    pop, push = stack.pop, stack.append
    while stack:
        path, pre = pop()
        _scan(path, pre, entries, digests, racy_from, ref, push, skip)


def _git_volatile(rel: str, is_dir: bool) -> bool:
    """What git rewrites on its own (status refreshes `index`), or what cannot run code or redirect
    anything: loose objects `objects/<2 hex>/`, `objects/pack/`, `logs/`, `index`; at any git dir's level
    (the dir itself, `worktrees/<id>/`, `modules/<name>/`), never under `refs/`."""
    parts = rel.split("/")
    if "refs" in parts:
        return False
    name = parts[-1]
    if not is_dir:
        return name == "index"
    if name == "logs":
        return True
    return len(parts) > 1 and parts[-2] == "objects" and (name == "pack" or _LOOSE.fullmatch(name) is not None)


def _walk_git(
    top: str, prefix: str, entries: dict[str, Meta], digests: dict[str, str], racy_from: int | None,
    ref: Snapshot | None,
) -> None:
    """A git dir, whole but for `_git_volatile`: refs, packed-refs, modules, objects/info, hooks, config..."""
    stack = [(top, prefix, "")]
    while stack:
        path, pre, rel = stack.pop()
        try:
            it = os.scandir(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError:
            old = entries.get(pre[:-1])
            if old is not None:
                entries[pre[:-1]] = (DIR, old[1], _UNREADABLE, 0, 0, old[5], None)
            continue
        with it:
            for e in it:
                name = e.name
                key, sub = pre + name, rel + name
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                    if _git_volatile(sub, is_dir):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except PermissionError:
                    entries[key] = (OTHER, 0, _UNREADABLE, 0, 0, 0, None)
                    continue
                if is_dir:
                    entries[key] = (DIR, st.st_mode, 0, 0, 0, st.st_ino, None)
                    stack.append((path + name + "/", key + "/", sub + "/"))
                else:
                    _entry(path + name, key, st, entries, digests, racy_from, ref)


def _can_fork() -> bool:
    # fork() copies only the calling thread; with other threads alive a lock one of them holds could
    # hang the child, so a multi-threaded host walks in one process.
    return hasattr(os, "fork") and (os.cpu_count() or 1) > 1 and threading.active_count() == 1


def _walk_tree(
    top: str, prefix: str, entries: dict[str, Meta], digests: dict[str, str], racy_from: int | None,
    ref: Snapshot | None, skip: str | None = None,
) -> None:
    """Walk `top`; a big tree is split with one forked worker, since lstat-bound Python gains nothing from
    threads (the GIL) but does from a second process: bench/snapshot.py, 100k files, ~510 -> ~320 ms."""
    frontier = [(top, prefix)]
    for _ in range(PARALLEL_PROBE_LEVELS):
        if not frontier or len(frontier) >= PARALLEL_MIN_DIRS:
            break
        nxt: list[tuple[str, str]] = []
        for path, pre in frontier:
            _scan(path, pre, entries, digests, racy_from, ref, nxt.append, skip)
        frontier = nxt
    if len(frontier) < PARALLEL_MIN_DIRS or not _can_fork():
        _walk(frontier, entries, digests, racy_from, ref, skip)
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
            _walk(theirs, part, part_digests, racy_from, ref, skip)
            with os.fdopen(w, "wb") as fh:
                fh.write(marshal.dumps((part, part_digests)))
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    reader = os.fdopen(r, "rb")
    done = False
    try:
        _walk(mine, entries, digests, racy_from, ref, skip)
        data = reader.read()
        done = True
    finally:
        # On a failure here the worker may be blocked writing into the pipe (or still walking): close the
        # read end and kill it, or waitpid would wait forever on a child that waits on us.
        reader.close()
        if not done:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
    """The git dirs themselves, each walked whole but for what git churns (`_git_volatile`); a dir inside
    another (a linked worktree's `<common>/worktrees/<id>`) is covered by that one."""
    dirs = list(dict.fromkeys(git_dirs))
    return [d for d in dirs if not any(o != d and d.is_relative_to(o) for o in dirs)]
