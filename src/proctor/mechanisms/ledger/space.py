"""The ledger's room on its filesystem: telling a full disk, the floor a job needs, and `ledger.reserve`.

Owns MIN_FREE_BYTES (below it a job is refused before it starts), how a failed write is told to be a full
disk, and `Reserve`: RESERVE_BYTES of allocated space beside the ledger, given up to let a write that must not
be lost through once and made again after the next write that finds room. It never writes a row.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
from pathlib import Path

RESERVE_BYTES = 256 * 1024
# Below this much free space beside the ledger a job is refused before it starts (host.run_agent): its
# rows could not all be written.
MIN_FREE_BYTES = 1024 * 1024


def disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return False


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def space_problem(where: Path) -> str | None:
    """Why a job should not start on the ledger's filesystem `where` (under MIN_FREE_BYTES free), or None."""
    free = free_bytes(where)
    if free is None or free >= MIN_FREE_BYTES:
        return None
    return (f"the ledger's filesystem ({where}) has {free} bytes free, under the "
            f"{MIN_FREE_BYTES} a job needs for its ledger rows")


def full(exc: BaseException, where: Path) -> bool:
    """Whether `exc`, raised writing the ledger in the directory `where`, means its disk is full."""
    # SQLite reports a full disk as SQLITE_FULL only where it sees ENOSPC itself; growing the WAL index
    # (-shm) on a full filesystem is a bare "disk I/O error". Free space tells which it was.
    free = free_bytes(where)
    return disk_full(exc) or (isinstance(exc, sqlite3.Error) and free is not None and free < MIN_FREE_BYTES)


def full_reason(exc: BaseException, where: Path) -> str:
    free = free_bytes(where)
    at = f"{where}, {free} bytes free" if free is not None else str(where)
    return f"the ledger's disk is full ({at}): {exc}"


class Reserve:
    """`ledger.reserve` at `path`: space held back for a write that must not be lost on a full disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._checked = False

    def release(self) -> bool:
        """Give the reserve's space back to the filesystem; False when there was none to give."""
        try:
            self.path.unlink()
        except OSError:
            return False
        self._checked = False
        return True

    def keep(self) -> None:
        """Make `ledger.reserve` when it is missing and there is room for it (once per open, and again after
        it was given up)."""
        if self._checked:
            return
        self._checked = True
        if self.path.exists():
            return
        free = free_bytes(self.path.parent)
        if free is None or free < RESERVE_BYTES + MIN_FREE_BYTES:
            self._checked = False  # try again after a later write
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, RESERVE_BYTES)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    os.write(fd, b"\0" * RESERVE_BYTES)  # a filesystem without fallocate
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._checked = False
