"""The QueueBackend seam: what the sender, the listener and the HTTP API need from a message engine.

Owns the Protocols and the naming rules for hosts and lanes. It never knows which engine is behind it:
`jetstream.JetStreamBackend` in every placement, `memory.MemoryBackend` in unit tests.

Keys of the per-job records are `<host>.<jobId>` so that an engine with subject permissions (NATS) can let a
host write only its own records (see `jetstream.host_permissions`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

NAME_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
# A job id is one KV key token: no dots (they split keys), nothing the engine would refuse.
JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_name(what: str, name: str) -> str:
    """Hosts and lanes are one subject token each; `_` is kept out because it joins them in consumer names."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"{what} {name!r} must match [A-Za-z0-9-]{{1,64}}")
    return name


def valid_job_id(job_id: object) -> bool:
    return isinstance(job_id, str) and JOB_ID_RE.fullmatch(job_id) is not None


def record_key(host: str, job_id: str) -> str:
    return f"{host}.{job_id}"


def answer_key(host: str, job_id: str, digest: str) -> str:
    """Where a listener answers an envelope that does not own its job id (a refused second envelope with a
    known id, a forgery): beside the owner's `<host>.<jobId>`, never over it. 128 bits of the digest keep
    keys apart; the full digest inside the signed result is what binds it."""
    return f"{host}.{job_id}.env-{digest[:32]}"


def message_id(job_id: str, digest: str) -> str:
    """The engine's dedupe id for a job message: the same envelope re-sent is dropped, but a different
    envelope that reuses the job id is not, so it reaches the listener and is refused there, in the open,
    instead of silently shadowing (or being shadowed by) the real job."""
    return f"{job_id}.{digest[:32]}"


QUOTA_KEY_TTL_S = 600.0  # a quota key counts one window (a minute); kept a while past it, then dropped


class Delivery(Protocol):
    """One delivery of one job message. `seq` is stable across redeliveries; `delivery` counts from 1."""

    @property
    def data(self) -> bytes: ...
    @property
    def seq(self) -> int: ...
    @property
    def delivery(self) -> int: ...
    async def ack(self) -> None: ...
    async def nak(self, delay_s: float) -> None: ...
    async def term(self) -> None: ...
    async def heartbeat(self, timeout_s: float) -> bool:
        """Extend the lease; True only when the engine confirmed it (a lost lease must be noticed)."""
        ...


class QueueBackend(Protocol):
    async def publish(self, target: str, lane: str, job_id: str, data: bytes) -> bool:
        """Enqueue once: a re-publish with the same id inside the engine's dedupe window is dropped. Senders
        pass `message_id(jobId, digest)`, so only the same envelope is deduped. Returns True when the engine
        dropped it as such a duplicate (nothing was queued: the message it already has stands), else False."""
        ...

    async def ensure_lane(
        self, host: str, lane: str, *, slots: int, ack_wait_s: float, max_deliver: int = -1
    ) -> None: ...

    async def has_listener(self, host: str, lane: str) -> bool:
        """Whether a listener of `host` has ever opened `lane` (its durable consumer exists): a job for any
        other host or lane is kept for no one, so the HTTP API takes none (issue 41)."""
        ...

    async def take_slot(self, key: str, limit: int) -> bool:
        """Count one against `key` when fewer than `limit` were counted there, atomically for every client of
        the engine (a principal's share across all the fleet's API servers: surfaces.api.quota). False: the
        key is full and nothing was counted. Keys are forgotten after `QUOTA_KEY_TTL_S`."""
        ...

    async def fetch(self, host: str, lane: str, max_n: int, timeout_s: float) -> list[Delivery]: ...

    async def put_job(self, job_id: str, data: bytes) -> None:
        """The sender's record of where a job went (target, lane, kind); read by `proctor job` and HTTP.
        Create-only: a job id's first record stays."""
        ...

    async def get_job(self, job_id: str) -> bytes | None: ...
    async def put_result(self, key: str, data: bytes, *, only_if_absent: bool = False) -> bool: ...
    async def get_result(self, key: str) -> bytes | None: ...
    async def wait_result(self, key: str, timeout_s: float) -> bytes | None: ...
    async def put_running(self, key: str, data: bytes) -> None: ...
    async def get_running(self, key: str) -> bytes | None: ...
    async def set_cancel(self, key: str, reason: str) -> None: ...
    async def get_cancel(self, key: str) -> str | None: ...

    async def watch_cancels(self, host: str, on_cancel: Callable[[str, str], None]) -> None:
        """Call `on_cancel(key, reason)` for every cancel flag of `host`, those set already before this
        returns, later ones as they are set (pushed, so a listener checks a flag without a round trip)."""
        ...

    async def close(self) -> None: ...
