"""Build caches a base's own run leaves, kept by the host and laid into each later run as a copy: a warm cache
every job reuses, and nothing a job writes reaches another job's verdict.

    Seeds(root).keep(key, name, src)   after the base's run (confined, the base's code): its cache dir copied
                                       under $PROCTOR_HOME/caches/<key>/<name>, when under the size cap
    Seeds(root).lay(key, name, dst)    before a job's run: a copy of it into the run's own, private dir

Which caches: the ones the job environment makes private per run (proctor.mechanisms.validation.environment)
and a toolchain keys by content, so a copy made for one tree serves another: Go's build cache (`GOCACHE`;
measured: a vendored module's `go test` 0.94 s cold, 0.14 s from a copy of the base's). Why a copy and not the
user's cache read-only: Go writes its cache as it reads it, and bubblewrap 0.8 has no overlay; the user's own
cache is never written nor read by a job. The key is the baseline's (the base commit, the toolchain, the
environment): a different toolchain never sees another's entries. It runs nothing.
"""

from __future__ import annotations

import os
import shutil
import secrets
from pathlib import Path

from proctor.mechanisms.validation.capped import tree_size

SEEDED = ("GOCACHE",)  # env vars of the job environment naming a per-run cache dir a base's run may seed
MAX_BYTES = 256 * 1024 * 1024
KEEP = 8  # seeds kept (the newest by use); older ones go


class Seeds:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, key: str, name: str) -> Path:
        return self.root / key[:32] / name

    def keep(self, key: str, name: str, src: Path) -> str | None:
        """None, or why the cache was not kept (too big, not a dir, the disk)."""
        if not src.is_dir() or src.is_symlink():
            return None
        size = tree_size(src, MAX_BYTES)
        if size > MAX_BYTES:
            return f"{name} of the base's run is over {MAX_BYTES >> 20} MiB: not kept"
        dst = self._dir(key, name)
        tmp = dst.with_name(f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.copytree(src, tmp, symlinks=True)
            if dst.exists():
                shutil.rmtree(dst, ignore_errors=True)
            os.replace(tmp, dst)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"{name} of the base's run not kept: {exc.strerror or exc}"
        self._prune()
        return None

    def lay(self, key: str, name: str, dst: Path) -> bool:
        """Copy the kept cache into `dst` (made, or empty); False when there is none (a cold run)."""
        src = self._dir(key, name)
        if not src.is_dir():
            return False
        try:
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
            os.utime(src.parent)  # the newest by use is kept longest
        except OSError:
            return False
        return True

    def _prune(self) -> None:
        try:
            dirs = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
        except OSError:
            return
        for old in dirs[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
