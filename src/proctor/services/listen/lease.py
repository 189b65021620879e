"""The lease on a running job: its cancel hook (`Lease`, why it stopped: `Stop`), and keeping it (`keep`).

The broker's `ack_wait` is the lease; a confirmed `in_progress` heartbeat every `ack_wait/4` extends it. A
listener that has had no confirmed heartbeat for `lease_margin * ack_wait` cancels its own job (the run's
tree is killed) and releases it in the store, so the broker's redelivery after `ack_wait` never overlaps a
live run. Owns the heartbeat, the fencing look at the store and the watch on the cancel flag while a run
lasts; it never releases, acks or answers a job (listener.py does, by the `Stop` it reads here).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

from proctor.mechanisms.queue.backend import Delivery


class Stop(StrEnum):
    """Why a run was stopped early; `released` ones are handed back for another delivery to take over."""

    CANCELLED = "cancelled"  # a user asked: the job ends with code CANCELLED
    LEASE_LOST = "lease_lost"  # partitioned or fenced: released, not acked, the broker redelivers
    STOPPING = "stopping"  # the listener shuts down: released and nak'd for the next listener at once


class Lease:
    """The run's cancel hook, shared with its thread or child: the first reason wins and is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.why: Stop | None = None

    def cancel(self, reason: str, why: Stop = Stop.CANCELLED) -> None:
        with self._lock:
            if self.reason is None:
                self.reason, self.why = reason, why

    def get(self) -> str | None:
        with self._lock:
            return self.reason


async def keep(
    lease: Lease, d: Delivery, work: asyncio.Task[Any], *, ack_wait_s: float, heartbeat_s: float,
    lease_margin: float, still_owner: Callable[[], Awaitable[bool]], requested: Callable[[], str | None],
) -> None:
    """Heartbeat the lease, fence against the store, and watch the cancel flag until the work ends.

    `still_owner()`: whether the store still shows this delivery as the job's owner; `requested()`: the
    reason of a valid cancel request for the job, else None."""
    loop = asyncio.get_running_loop()
    confirmed = next_beat = loop.time()
    while not work.done():
        now = loop.time()
        if now >= next_beat:
            next_beat = now + heartbeat_s
            # Bounded by what is left of the lease margin, so a hung heartbeat cannot delay the self-kill.
            left = lease_margin * ack_wait_s - (now - confirmed)
            try:
                ok = await asyncio.wait_for(d.heartbeat(heartbeat_s / 2), max(0.01, min(heartbeat_s, left)))
            except asyncio.TimeoutError:
                ok = False
            if ok:
                confirmed = now  # the time it was sent: the server reset its timer no earlier than this
            if not await still_owner():
                lease.cancel("fenced: the store shows another delivery owns this job", Stop.LEASE_LOST)
        if loop.time() - confirmed > lease_margin * ack_wait_s:
            lease.cancel(f"lease lost: no confirmed heartbeat for {loop.time() - confirmed:.1f}s "
                         f"(ack_wait {ack_wait_s:.0f}s)", Stop.LEASE_LOST)
        reason = requested()
        if reason:
            lease.cancel(f"cancelled by request: {reason}")
        await asyncio.wait({work}, timeout=min(0.1, heartbeat_s / 4))
