"""What the host can vouch for in a directory without reading its files: the files it wrote itself, unchanged.

Owns the record of a checkout the host made (git's index exactly as the host's own checkout wrote it, kept in
the host's memory before anything else runs in the directory), the record of a directory the host made exactly
a tree (`Known`), the stamp that dates a record, and the rule for when a file on disk is still the one recorded.

The rule. A file is the one the host wrote, unchanged, when its device, inode, type and mode, size, mtime and
ctime are the recorded ones, AND the recorded ctime is earlier than the record's stamp: the ctime of a file the
host created on the same filesystem after its last write, read before anything else could write. Every write,
truncate, chmod, link, rename or re-create sets a file's ctime to the current time, which is at or after the
stamp, and no unprivileged process can set a ctime back (`utime` sets mtime and atime only; found in review: an
agent that rewrote a file with the same size and put its mtime back). A file whose recorded ctime is at or after
the stamp was written in the stamp's own clock tick ("racy", git's word): a later change could keep its ctime,
so it is never vouched for and its content is read. A file replaced by another (rename, re-create) has another
inode, or, where the inode number is reused, a ctime of its creation. What no rule here covers is said, not
guessed: the system clock stepped back during the job (CAP_SYS_TIME), and a filesystem whose ctimes another
machine sets (NFS); a mount over the directory has another device and is never vouched for.

Comparisons are to the nanosecond, not to git's second (git without USE_NSEC, as Debian builds it, compares
seconds; measured here): git is only ever asked to hash the paths this module does not vouch for.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import struct
import threading
from dataclasses import dataclass, field

NS = 1_000_000_000
M32 = 0xFFFFFFFF
GITLINK = 0o160000
SYMLINK = 0o120000
_ENTRY = struct.Struct(">10I")  # ctime s, ns, mtime s, ns, dev, ino, mode, uid, gid, size


# lstat mode & (type | owner's x bit) -> the mode git records for it (core.filemode true, symlinks on)
_MODE_OF = {stat.S_IFREG: 0o100644, stat.S_IFREG | stat.S_IXUSR: 0o100755, stat.S_IFLNK: SYMLINK,
            stat.S_IFLNK | stat.S_IXUSR: SYMLINK}


def stamp(dir_fd: int) -> int:
    """The filesystem's current time as it dates a change (the ctime of a file made now in `dir_fd`, then
    removed): every change made after this call has a ctime at or after it."""
    name = f".proctor-stamp-{secrets.token_hex(8)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        return os.fstat(fd).st_ctime_ns
    finally:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)


@dataclass(frozen=True)
class Entries:
    """A `Recorded` index read: every entry's mode, and for each file or symlink where its entry is and,
    when it was recorded before the stamp, what the rule compares (None: racy, never vouched for)."""

    modes: dict[str, int]  # path -> git mode of every entry, in git's order
    files: dict[str, tuple[int, tuple[int, ...] | None]]  # path -> (entry's offset, key), gitlinks aside
    tree: str | None  # the checkout's tree, from the index's cache of it (None: not cached)


@dataclass(frozen=True)
class Recorded:
    """git's index as the host's checkout wrote it (the stat of each file right after git wrote it), read by
    the host before anything else ran in the checkout, and the stamp taken after it."""

    data: bytes = field(repr=False)
    since: int
    hash_len: int = 20  # 32 for a sha256 repository
    _read: list[Entries | None] = field(default_factory=list, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def entries(self) -> Entries | None:
        """The index read (once: a caller may have it read in a thread while the agent runs, and the
        landing then finds it done). None for an index `compare` does not read (nothing vouched for)."""
        with self._lock:
            if not self._read:
                self._read.append(_read(self))
            return self._read[0]


@dataclass(frozen=True)
class Compared:
    """A `Recorded` checkout against an lstat of each entry of the directory now."""

    modes: dict[str, int]  # path -> git mode of every entry of the checkout, in git's order
    changed: list[tuple[str, int, int]]  # (path, mode, offset of its entry): a file now, not the one recorded
    gone: list[str]  # no file or symlink there now (nothing, or a directory)
    tree: str | None = None  # the checkout's tree, from the index's cache of it (None: not cached)
    vouched: dict[str, os.stat_result] = field(default_factory=dict)  # path -> its lstat: the one recorded


def compare(rec: Recorded, seen: dict[str, os.stat_result]) -> Compared | None:
    """Each entry of an index of version 2 or 3 at stage 0 with no flag set (a fresh checkout's) against
    `seen`: vouched for (the rule above), changed, or gone; gitlinks are neither. None for any other index
    (another version, a conflict, skip-worktree, a truncated file): then nothing is vouched for and the
    caller reads every file's content. The index is read once (`Recorded.entries`); this is one loop over
    its files (100,000: one Python loop)."""
    read = rec.entries()
    if read is None:
        return None
    modes = read.modes
    vouched: dict[str, os.stat_result] = {}
    changed: list[tuple[str, int, int]] = []
    gone: list[str] = []
    get, isdir, mode_of = seen.get, stat.S_ISDIR, _MODE_OF.get
    for path, (off, key) in read.files.items():
        st = get(path)
        if st is None or isdir(st.st_mode):
            gone.append(path)
        elif key is not None and key == (st.st_ctime_ns, st.st_mtime_ns, st.st_ino & M32, st.st_dev & M32,
                                         st.st_size & M32, st.st_uid, mode_of(st.st_mode & 0o170100)):
            vouched[path] = st
        else:
            changed.append((path, modes[path], off))
    return Compared(modes, changed, gone, read.tree, vouched)


def _read(rec: Recorded) -> Entries | None:
    data, hl, since = rec.data, rec.hash_len, rec.since
    digest = hashlib.sha256 if hl == 32 else hashlib.sha1
    if len(data) < 12 + hl or data[:4] != b"DIRC" or digest(data[:-hl]).digest() != data[-hl:]:
        return None
    version, count = struct.unpack_from(">II", data, 4)
    if version not in (2, 3) or since // NS > M32:
        return None
    fixed = 40 + hl + 2
    end = len(data) - hl
    modes: dict[str, int] = {}
    files: dict[str, tuple[int, tuple[int, ...] | None]] = {}
    unpack = _ENTRY.unpack_from
    off = 12
    try:
        for _ in range(count):
            flags = (data[off + 40 + hl] << 8) | data[off + 41 + hl]
            if flags & 0xF000:  # assume-valid, extended flags (skip-worktree, intent-to-add), a stage
                return None
            start = off + fixed
            n = flags & 0xFFF
            if n == 0xFFF:
                n = data.index(b"\0", start) - start
            path = data[start:start + n].decode("utf-8", "surrogateescape")
            cs, cn, ms, mn, dev, ino, mode, uid, _gid, size = unpack(data, off)
            modes[path] = mode
            if mode != GITLINK:
                ctime = cs * NS + cn
                # The key in the order compare builds it from an lstat: (ctime, mtime, ino, dev, size, uid, mode).
                files[path] = (off, (ctime, ms * NS + mn, ino, dev, size, uid, mode) if ctime < since else None)
            off += (fixed + n + 8) & ~7
            if off > end:
                return None
    except (IndexError, ValueError):
        return None
    return Entries(modes, files, _cached_root(data, off, end, hl, count))


def smudged(rec: Recorded, offsets: list[int]) -> bytes:
    """The recorded index with the stat data of the entries at `offsets` zeroed (their mode kept): git hashes
    such an entry's file whatever its stat (git's own "smudge" of a racy entry)."""
    data = bytearray(rec.data)
    for off in offsets:
        data[off:off + 24] = bytes(24)  # ctime, mtime, dev, ino
        data[off + 28:off + 40] = bytes(12)  # uid, gid, size
    hl = rec.hash_len
    data[-hl:] = (hashlib.sha256 if hl == 32 else hashlib.sha1)(data[:-hl]).digest()
    return bytes(data)


def _cached_root(data: bytes, off: int, end: int, hl: int, count: int) -> str | None:
    """The root tree's oid from the index's `TREE` extension, when it holds one valid for every entry."""
    while off + 8 <= end:
        sig, size = data[off:off + 4], int.from_bytes(data[off + 4:off + 8], "big")
        if sig == b"TREE":
            head = data[off + 8:off + 8 + min(size, 64)]
            if head[:1] != b"\0" or b"\n" not in head:
                return None
            entries, _, _subtrees = head[1:head.index(b"\n")].partition(b" ")
            if entries != str(count).encode():
                return None
            start = off + 8 + head.index(b"\n") + 1
            return data[start:start + hl].hex() if start + hl <= off + 8 + size else None
        off += 8 + size
    return None


@dataclass
class Known:
    """A directory the host made exactly `tree` (it checked every entry and wrote what differed), with the
    lstat of each file and symlink right after, and the stamp taken after its last write: what a later pass
    may keep without reading it (the rule above), whatever ran in the directory meanwhile."""

    tree: str
    modes: dict[str, int]  # path -> git mode of each non-directory entry of the tree (gitlinks included)
    stats: dict[str, os.stat_result]
    since: int
    _dirs: frozenset[str] | None = field(default=None, repr=False)
    lost: bool = False  # a pass failed half way: none of this holds any more (the index may hold another tree)

    @property
    def dirs(self) -> frozenset[str]:
        """Every directory of the tree (the parents of its entries), "" excluded."""
        if self._dirs is None:
            self._dirs = tree_dirs(self.modes)
        return self._dirs

    def unchanged(self, path: str, st: os.stat_result) -> bool:
        old = self.stats.get(path)
        return (old is not None and old.st_ctime_ns < self.since and st.st_ctime_ns == old.st_ctime_ns
                and st.st_mtime_ns == old.st_mtime_ns and st.st_ino == old.st_ino and st.st_dev == old.st_dev
                and st.st_size == old.st_size and st.st_mode == old.st_mode and st.st_nlink == old.st_nlink
                and st.st_uid == old.st_uid)


def tree_dirs(modes: dict[str, int]) -> frozenset[str]:
    dirs: set[str] = set()
    for path in modes:
        parent = path.rpartition("/")[0]
        while parent and parent not in dirs:
            dirs.add(parent)
            parent = parent.rpartition("/")[0]
    return frozenset(dirs)
