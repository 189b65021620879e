"""A file replaced whole: a reader sees the old bytes or the new ones, never half.

    write(path, data)   `data` into a fresh owner-only file beside `path` (created exclusively, no link
                        followed), then renamed over it. Raises OSError, the fresh file removed.

One piece for the records proctor rewrites in place (a job's record, the baselines, the sent-jobs index, the
CLI versions seen): a crash mid-write leaves the old file, and a planted link or a leftover temp file is
never written through.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
