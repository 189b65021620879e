"""The job store as the listener's event loop uses it: group-committed writes, and never a wait for a lock.

Owns batching the loop's store writes into one transaction per turn, handing a busy store to a worker
thread, and checkpointing the WAL off the loop. It never decides what to write (the listener does, with the
store's `op_*` calls).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from proctor.mechanisms.queue.store import JobStore, StoreBusy

log = logging.getLogger(__name__)
# Commits the event loop makes to the job store between two WAL checkpoints (in a worker thread): a few
# hundred kilobytes of WAL at a no-op job's 8-10 pages a job.
CHECKPOINT_EVERY = 100


class StoreOnLoop:
    """The job store as the listener's event loop uses it: group-committed writes, and never a wait for a lock.

    `submit(op)` queues a store write (a `JobStore.op_*` call) and returns its future; every write queued in
    one turn of the loop is committed in one transaction at the end of that turn, on the loop. Each caller
    acts on its outcome only after that commit (nothing is published, acked or run before its row is
    durable). When the store is busy (another thread of this process, another process's write transaction)
    the batch goes to a worker thread, which waits for the lock; writes queued meanwhile follow it, in order.
    An op that raises rolls its batch back; each op of it is then made again alone, so only its own caller
    sees the error."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._pending: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._scheduled = False
        self._behind: asyncio.Task[None] | None = None  # a batch a worker thread is committing
        # The WAL is checkpointed from a worker thread every CHECKPOINT_EVERY commits made here, not by
        # whichever commit on the loop crosses SQLite's threshold (store.checkpoint_in_background).
        store.checkpoint_in_background()
        self._commits = 0
        self._checkpointing: asyncio.Future[None] | None = None

    def submit(self, op: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((op, fut))
        if not self._scheduled and self._behind is None:
            self._scheduled = True
            loop.call_soon(self._commit)
        return fut

    async def write(self, op: Callable[[], Any]) -> Any:
        return await self.submit(op)

    def commit_now(self) -> None:
        """Commit what is queued at once instead of at the end of this turn (the caller queued a whole batch)."""
        if self._scheduled and self._behind is None:
            self._commit()

    async def read(self, op: Callable[[], Any]) -> Any:
        try:
            return self.store.read(op, wait=False)
        except StoreBusy:
            return await asyncio.to_thread(self.store.read, op)

    def _commit(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            results = self.store.transact([op for op, _ in batch], wait=False)
        except StoreBusy:
            self._behind = asyncio.ensure_future(self._in_thread(batch))
            return
        except Exception:  # noqa: BLE001 - one op failed and rolled the batch back: each again, alone
            self._behind = asyncio.ensure_future(self._in_thread(batch, alone=True))
            return
        for (_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY == 0 and (self._checkpointing is None or self._checkpointing.done()):
            self._checkpointing = asyncio.ensure_future(asyncio.to_thread(self._checkpoint))

    def _checkpoint(self) -> None:
        try:
            self.store.checkpoint()
        except Exception:  # a later one copies the rest; the WAL keeps every commit meanwhile
            log.warning("job store checkpoint failed", exc_info=True)

    async def _in_thread(self, batch: list[tuple[Callable[[], Any], asyncio.Future[Any]]], alone: bool = False) -> None:
        try:
            if not alone:
                try:
                    results = await asyncio.to_thread(self.store.transact, [op for op, _ in batch])
                except Exception:  # noqa: BLE001 - as in _commit
                    alone = True
                else:
                    for (_, fut), res in zip(batch, results, strict=True):
                        if not fut.done():
                            fut.set_result(res)
            if alone:
                for op, fut in batch:
                    try:
                        (res,) = await asyncio.to_thread(self.store.transact, [op])
                    except Exception as exc:  # noqa: BLE001 - handed to the op's caller
                        if not fut.done():
                            fut.set_exception(exc)
                    else:
                        if not fut.done():
                            fut.set_result(res)
        finally:
            self._behind = None
            if self._pending and not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._commit)


