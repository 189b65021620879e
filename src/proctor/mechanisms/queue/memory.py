"""An in-memory QueueBackend for unit tests (yours too): one process, no server, no persistence.

Owns a faithful-enough model of the engine's semantics the listener relies on: per host+lane FIFO, a lease
of `ack_wait` per delivery, redelivery with an incremented delivery number after the lease lapses or a nak,
dedupe of a re-published job id. It never stands in for the contract or crash tests: those run a real
nats-server. Tests can set `partitioned = True` to make heartbeats fail as a cut network would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Message:
    seq: int
    data: bytes
    delivery: int = 0
    leased_until: float = 0.0
    visible_at: float = 0.0
    done: bool = False


@dataclass
class MemoryDelivery:
    backend: MemoryBackend
    message: _Message
    lane_key: tuple[str, str]
    delivery: int

    @property
    def data(self) -> bytes:
        return self.message.data

    @property
    def seq(self) -> int:
        return self.message.seq

    def _current(self) -> bool:
        return self.message.delivery == self.delivery and not self.message.done

    async def ack(self) -> None:
        if self._current():
            self.message.done = True

    async def term(self) -> None:
        await self.ack()

    async def nak(self, delay_s: float) -> None:
        if self._current():
            self.message.leased_until = 0.0
            self.message.visible_at = self.backend.now() + delay_s

    async def heartbeat(self, timeout_s: float) -> bool:
        if self.backend.partitioned:
            await asyncio.sleep(timeout_s)
            return False
        if self._current():
            self.message.leased_until = self.backend.now() + self.backend.ack_wait[self.lane_key]
        return True


@dataclass
class MemoryBackend:
    partitioned: bool = False
    lanes: dict[tuple[str, str], list[_Message]] = field(default_factory=dict)
    ack_wait: dict[tuple[str, str], float] = field(default_factory=dict)
    seen_ids: set[str] = field(default_factory=set)
    kv: dict[str, dict[str, bytes]] = field(default_factory=dict)
    cancel_watchers: list[tuple[str, Callable[[str, str], None]]] = field(default_factory=list)
    next_seq: int = 1

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def publish(self, target: str, lane: str, job_id: str, data: bytes) -> bool:
        if job_id in self.seen_ids:
            return True
        self.seen_ids.add(job_id)
        self.lanes.setdefault((target, lane), []).append(_Message(self.next_seq, data))
        self.next_seq += 1
        return False

    async def publish_raw(self, target: str, lane: str, data: bytes) -> None:
        """Publish without dedupe, as an attacker replaying captured bytes would."""
        self.lanes.setdefault((target, lane), []).append(_Message(self.next_seq, data))
        self.next_seq += 1

    async def ensure_lane(
        self, host: str, lane: str, *, slots: int, ack_wait_s: float, max_deliver: int = -1
    ) -> None:
        self.lanes.setdefault((host, lane), [])
        self.ack_wait[(host, lane)] = ack_wait_s

    async def has_listener(self, host: str, lane: str) -> bool:
        return (host, lane) in self.ack_wait

    async def take_slot(self, key: str, limit: int) -> bool:
        slots = self.kv.setdefault("quota", {})
        count = int(slots.get(key, b"0"))
        if count >= limit:
            return False
        slots[key] = str(count + 1).encode()
        return True

    async def fetch(self, host: str, lane: str, max_n: int, timeout_s: float) -> list[MemoryDelivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        key = (host, lane)
        while True:
            now = loop.time()
            ready = [
                m for m in self.lanes.get(key, [])
                if not m.done and m.leased_until <= now and m.visible_at <= now
            ][:max_n]
            if ready or now >= deadline:
                break
            await asyncio.sleep(0.01)
        out = []
        for m in ready:
            m.delivery += 1
            m.leased_until = now + self.ack_wait[key]
            out.append(MemoryDelivery(self, m, key, m.delivery))
        return out

    def _bucket(self, name: str) -> dict[str, bytes]:
        return self.kv.setdefault(name, {})

    async def put_job(self, job_id: str, data: bytes) -> None:
        self._bucket("jobs").setdefault(job_id, data)  # create-only, as the JetStream backend's

    async def get_job(self, job_id: str) -> bytes | None:
        return self._bucket("jobs").get(job_id)

    async def put_result(self, key: str, data: bytes, *, only_if_absent: bool = False) -> bool:
        results = self._bucket("results")
        if only_if_absent and key in results:
            return False
        results[key] = data
        return True

    async def get_result(self, key: str) -> bytes | None:
        return self._bucket("results").get(key)

    async def wait_result(self, key: str, timeout_s: float) -> bytes | None:
        deadline = self.now() + timeout_s
        while (data := await self.get_result(key)) is None and self.now() < deadline:
            await asyncio.sleep(0.01)
        return data

    async def put_running(self, key: str, data: bytes) -> None:
        self._bucket("running")[key] = data

    async def get_running(self, key: str) -> bytes | None:
        return self._bucket("running").get(key)

    async def set_cancel(self, key: str, reason: str) -> None:
        self._bucket("cancel")[key] = reason.encode()
        for host, on_cancel in self.cancel_watchers:
            if key.startswith(f"{host}."):
                on_cancel(key, reason)

    async def get_cancel(self, key: str) -> str | None:
        data = self._bucket("cancel").get(key)
        return data.decode() if data else None

    async def watch_cancels(self, host: str, on_cancel: Callable[[str, str], None]) -> None:
        for key, reason in self._bucket("cancel").items():
            if key.startswith(f"{host}."):
                on_cancel(key, reason.decode())
        self.cancel_watchers.append((host, on_cancel))

    async def close(self) -> None:
        return None
