"""The sender's own record of the envelopes it sent: `$PROCTOR_HOME/queue-sent/<jobId>.json`.

Owns what a sender may trust about a job after it was sent: the host its envelope named, the lane and kind,
and the envelope's digest. `wait`, `status` and `cancel` by job id read this, never the job record on the
server (`proctor_jobs` KV), which anyone who can reach an unauthenticated server can rewrite: a record
there is a hint for display only. It never talks to the queue.

One small file per job. A new job id's record is created with its content in one write (`O_EXCL`): it is
written before its job is published, and the id is random, so no reader can look for it while it is being
written; a record that exists already (the same envelope sent again) is replaced through a temp file and
`os.replace`, so concurrent `send`s and an HTTP API process sharing the home never see half a record. (The
temp file and rename for every record were half the cost of a publish's record, measured by bench/queue.py's
profile, and on the path from enqueue to start.) Files not written for `KEEP_S` are pruned by the first write
of each process, and again at most hourly (by mtime: one directory scan, no reads).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from proctor.home import proctor_home
from proctor.mechanisms import atomic
from proctor.mechanisms.queue.backend import valid_job_id
from proctor.mechanisms.queue.envelope import Sealed, envelope_digest

DIR_NAME = "queue-sent"
# Long enough for a sender to ask about a job for a while after it expired unstarted or ran (the default
# TTL is a day; the server's KV records live 14 days too).
KEEP_S = 14 * 24 * 3600.0
# And at most this many records, the newest (issue 41: every envelope sent left a record for 14 days).
KEEP_MOST = 100_000
# A sweep stats every record, so it runs at most once a process per this interval for a directory: every
# `SentStore()` made anew (one a `sender.publish` without a store) swept them all (measured: 0.9 ms of a
# 1.6 ms publish with 1,000 records, growing with them).
PRUNE_EVERY_S = 3600.0
_last_prune: dict[Path, float] = {}
_made: set[Path] = set()  # folders this process has made (or found): one mkdir each, not one per record


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass(frozen=True)
class SentJob:
    """What the sender knows first-hand about one envelope it sent (all from its own signed bytes)."""

    job_id: str
    target: str
    lane: str
    kind: str
    digest: str
    signer: str
    expires_at: float

    @classmethod
    def from_sealed(cls, sealed: Sealed) -> SentJob:
        f = json.loads(sealed.body)
        return cls(str(f["jobId"]), str(f["target"]), str(f["lane"]), str(f["kind"]), envelope_digest(sealed.body),
                   str(f.get("signer")), float(f.get("expiresAt") or 0))


class SentStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or proctor_home()) / DIR_NAME

    def _path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.json"

    def put(self, job: SentJob) -> None:
        if not valid_job_id(job.job_id):
            raise ValueError(f"job id {job.job_id!r} is not a valid job id")
        data = json.dumps(asdict(job)).encode()
        path = self._path(job.job_id)
        if self.root not in _made:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            _made.add(self.root)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            atomic.write(path, data)
        except FileNotFoundError:  # the folder went away since this process made it
            _made.discard(self.root)
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic.write(path, data)
        else:
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        now = time.time()
        if now - _last_prune.get(self.root, 0.0) >= PRUNE_EVERY_S:
            _last_prune[self.root] = now
            self.prune(now)

    def get(self, job_id: str) -> SentJob | None:
        if not valid_job_id(job_id):
            return None
        try:
            doc = json.loads(self._path(job_id).read_text())
            return SentJob(**doc)
        except (OSError, ValueError, TypeError):
            return None

    def prune(self, now: float) -> int:
        """Records not written for KEEP_S, then the oldest past KEEP_MOST (a sender that sent more than that
        in KEEP_S loses the first ones' records first, never the store's disk to them)."""
        n = 0
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return 0
        kept: list[tuple[float, str]] = []
        for entry in entries:
            try:
                if not entry.name.endswith((".json", ".tmp")):
                    continue
                mtime = entry.stat().st_mtime
                if mtime + KEEP_S < now:
                    os.unlink(entry.path)
                    n += 1
                else:
                    kept.append((mtime, entry.path))
            except OSError:
                continue
        for _, path in sorted(kept)[:max(0, len(kept) - KEEP_MOST)]:
            try:
                os.unlink(path)
                n += 1
            except OSError:
                continue
        return n
