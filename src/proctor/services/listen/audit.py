"""The listener's audit trail into the ledger, batched: refusals, starts (signer, nonce, digest), ends.

Owns grouping the queue's audit rows into one ledger transaction per flush. It never decides anything and
is not the write-ahead record of a run: the job store's `running` row is the queue's, and the host's own
`job.start` ledger row is the agent run's. Rows land within `flush_every_s` (or at `close`), or at once when
the listener asks: before it publishes anything a reader may check against the ledger (a result, a refusal,
a released job handed back) it awaits `commit()`, so whoever holds the answer can already read its rows.

Why batched: each ledger append is one transaction plus a head-file replace, measured at ~0.65 ms here
(bench/jobqueue.py profile), two per job; one flush of many rows costs about the same as one append.

`append` is a list append (the listener calls it on its event loop). `commit()` is a group commit: the
rows of every job that asks in the same moment go in one ledger transaction, written by one worker thread
(the ledger is shared with other processes, whose write lock the event loop must never wait for), and one
flush at a time, so a commit returns only once its rows are in the ledger.

Also owns the listener's side of any audit log (`AuditLog`, `record_row`): a BatchedAudit appended to on the
event loop, anything else (a plain Ledger) written from a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.ledger.rows import Entry


class AuditLog(Protocol):
    """`append` may buffer (BatchedAudit); an audit with a `flush()` method is flushed before the listener
    publishes anything a reader may check against it. One without (a plain Ledger) writes at once. One with an
    async `commit()` (BatchedAudit) is appended to on the event loop and group-committed by `commit()`; any
    other is written from a worker thread."""

    def append(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None) -> int: ...


async def record_row(
    audit: AuditLog, kind: str, payload: dict[str, Any], *, job_id: str | None = None, durable: bool = False
) -> None:
    """Append an audit row; `durable`: committed (with every row before it) when this returns, for rows
    that must be readable by the time anything is published."""
    commit = getattr(audit, "commit", None)
    if commit is not None:  # BatchedAudit: a list append here, and a group commit when it must be durable
        audit.append(kind, payload, job_id=job_id)
        if durable:
            await commit()
        return

    def write() -> None:
        audit.append(kind, payload, job_id=job_id)
        flush = getattr(audit, "flush", None)
        if durable and flush is not None:
            flush()

    await asyncio.to_thread(write)


@dataclass
class BatchedAudit:
    ledger: Ledger
    flush_every_s: float = 0.01
    _pending: list[Entry] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Held across the ledger write: a flush returns only once every row appended before it is committed, even
    # when a concurrent flush took those rows (without it, the second flush would find nothing pending and
    # return while the first was still writing them).
    _write: threading.Lock = field(default_factory=threading.Lock)
    # Rows appended so far, and rows a flush has taken and finished with (written, or failed and raised to
    # the flush's caller): `commit()` waits until every row appended before it is settled.
    _appended: int = 0
    _settled: int = 0
    _flushing: asyncio.Future[None] | None = None

    def append(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None) -> int:
        with self._lock:
            self._pending.append(Entry(kind, payload, job_id))
            self._appended += 1
            return len(self._pending)

    def flush(self) -> None:
        """Commit every row appended so far; returns only when they are in the ledger."""
        with self._write:
            with self._lock:
                batch, self._pending = self._pending, []
                upto = self._appended
            try:
                if batch:
                    self.ledger.update(lambda _db: (None, batch))
            finally:
                with self._lock:
                    self._settled = max(self._settled, upto)

    async def commit(self) -> None:
        """Every row appended before this call is in the ledger when it returns (one flush in a worker thread
        for all the rows waiting then; a flush already under way is waited for first)."""
        with self._lock:
            target = self._appended
        while True:
            with self._lock:
                if self._settled >= target:
                    return
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.ensure_future(asyncio.to_thread(self.flush))
            await asyncio.shield(self._flushing)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush periodically until `stop`, then once more."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.flush_every_s)
            except asyncio.TimeoutError:
                pass
            if self._pending:
                await self.commit()
        await self.commit()
