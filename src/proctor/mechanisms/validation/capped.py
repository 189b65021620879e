"""Reading a file of a tree others shape (the agent's tree, the main checkout, a tool's config in the user's
home): a regular file only, never through a symlink, never blocking on a FIFO, capped; and TOML read from
such bytes, anything unreadable read as empty. It never writes and never raises on odd input.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

MAX_READ = 1024 * 1024


def read_capped(path: Path, cap: int = MAX_READ) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            return None
        chunks, total = [], 0
        while total <= cap:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
            total += len(b)
        return b"".join(chunks) if total <= cap else None
    finally:
        os.close(fd)


def parse_toml(data: bytes | None) -> dict:
    if not data:
        return {}
    try:
        out = tomllib.loads(data.decode("utf-8", "replace"))
    except tomllib.TOMLDecodeError:
        return {}
    return out if isinstance(out, dict) else {}


def toml_table(data: object, *keys: str) -> dict:
    """The table at `keys` under `data`; {} when any step is missing or not a table."""
    for k in keys:
        data = data.get(k) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else {}


def tree_size(root: Path, cap: int) -> int:
    """The bytes of the regular files below `root` (no link followed), counted up to just past `cap`."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
        if total > cap:
            break
    return total
