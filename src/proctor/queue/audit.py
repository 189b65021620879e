"""The listener's audit trail into the ledger, batched: refusals, starts (signer, nonce, digest), ends.

Owns grouping the queue's audit rows into one ledger transaction per flush. It never decides anything and
is not the write-ahead record of a run: the job store's `running` row is the queue's, and the host's own
`job.start` ledger row is the agent run's. Rows land within `flush_every_s` (or at `close`), or at once when
the listener calls `flush()`: it does before it publishes anything a reader may check against the ledger (a
result, a refusal, a released job handed back), so whoever holds the answer can already read its rows.

Why batched: each ledger append is one transaction plus a head-file replace, measured at ~0.65 ms here
(bench/queue.py profile), two per job; one flush of many rows costs about the same as one append.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from proctor.ledger import Entry, Ledger


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

    def append(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None) -> int:
        with self._lock:
            self._pending.append(Entry(kind, payload, job_id))
            return len(self._pending)

    def flush(self) -> None:
        """Commit every row appended so far; returns only when they are in the ledger."""
        with self._write:
            with self._lock:
                batch, self._pending = self._pending, []
            if batch:
                self.ledger.update(lambda _db: (None, batch))

    async def run(self, stop: asyncio.Event) -> None:
        """Flush periodically until `stop`, then once more."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.flush_every_s)
            except asyncio.TimeoutError:
                pass
            self.flush()
        self.flush()
