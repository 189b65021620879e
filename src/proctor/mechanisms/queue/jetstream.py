"""The JetStream backend: one stream of job subjects, one durable pull consumer per host+lane, KV records.

Owns the mapping of the QueueBackend seam onto NATS, the same code for the bundled loopback server and a
shared fleet server. It never verifies envelopes (the listener does) and never starts a server (server.py).

Layout:
- stream `PROCTOR_JOBS`, subjects `proctor.jobs.<host>.<lane>`, work-queue retention, `Nats-Msg-Id: jobId`
  so a re-sent job inside the duplicate window is dropped by the server;
- durable consumer `jobs_<host>_<lane>`: `ack_wait` is the lease, `in_progress()` extends it,
  `max_ack_pending` = the lane's slots (the server bounds concurrency);
- KV buckets `proctor_jobs` (sender records by jobId), `proctor_results`, `proctor_running`, `proctor_cancel`
  (keys `<host>.<jobId>`).

Per-host NKEY credentials (`host_permissions`): a fleet server's config gives each listener one NKEY user
whose permissions reach only its own subjects: creating (with its own filter only), fetching from and acking
its own consumers, writing its own
`results`/`running` keys, reading KV, and replies on its own inbox prefix `_INBOX_<host>`. It cannot publish
jobs, read another host's consumer or write another host's result. This narrows what a stolen host seed can
do; it does not replace the envelope signature, which the listener checks regardless. The listener connects
with `nkeys_seed=<file>` and `inbox_prefix=_INBOX_<host>`; the client needs the `nkeys` package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DiscardPolicy, KeyValueConfig, RetentionPolicy, StreamConfig
from nats.js.kv import KeyValue

from proctor.mechanisms.queue.backend import QUOTA_KEY_TTL_S, check_name
from proctor.mechanisms.queue.envelope import MAX_ENVELOPE_BYTES, MAX_TTL_S

T = TypeVar("T")
STREAM = "PROCTOR_JOBS"
SUBJECT_PREFIX = "proctor.jobs"
BUCKETS = ("proctor_jobs", "proctor_results", "proctor_running", "proctor_cancel")
RECORD_TTL_S = 14 * 24 * 3600.0
# The principals' shares (take_slot): made on first use by a sender that counts one, never by a listener.
QUOTA_BUCKET = "proctor_quota"
QUOTA_RACES = 64  # compare-and-set attempts before a share is called uncountable
# The stream's quota (issue 41: 150 envelopes of ~1 MB for a host that does not exist grew it to 146 MB, kept
# for ever): no message outlives the longest envelope (and an hour), the whole stream holds at most 1 GiB,
# and one host's lane (a subject) at most 10,000 waiting jobs; past either, a new publish is refused
# (discard new, the sender's QUEUE_FULL), never an older job dropped.
STREAM_LIMITS: dict[str, Any] = {
    "max_age": float(MAX_TTL_S + 3600), "max_bytes": 1 << 30, "max_msgs_per_subject": 10_000,
    "max_msg_size": MAX_ENVELOPE_BYTES + 64 * 1024, "discard": DiscardPolicy.NEW, "discard_new_per_subject": True,
}
# How long a KV operation keeps trying through a cluster's failover: a killed node's clients reconnect and
# its streams elect new leaders in about 10 s on loopback (measured), well inside a listener's lease margin.
FAILOVER_S = 30.0
TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
             nats.js.errors.NoStreamResponseError, nats.errors.ConnectionReconnectingError, asyncio.TimeoutError)
PLACEMENT_WAIT_S = 10.0  # a forming cluster's JetStream peers join within this (measured ~5 s on loopback)
ACK_TRIES_S = 15.0  # a confirmed ack is retried this long; past it, a redelivery finds the job done


def job_subject(host: str, lane: str) -> str:
    return f"{SUBJECT_PREFIX}.{check_name('host', host)}.{check_name('lane', lane)}"


def consumer_name(host: str, lane: str) -> str:
    return f"jobs_{check_name('host', host)}_{check_name('lane', lane)}"


def host_permissions(host: str, lanes: list[str]) -> dict[str, Any]:
    """nats-server `permissions` block for one listener's NKEY user (see the module docstring)."""
    check_name("host", host)
    api = "$JS.API"
    publish = [
        f"{api}.INFO",
        f"{api}.STREAM.INFO.{STREAM}",
        *(f"{api}.STREAM.INFO.KV_{b}" for b in BUCKETS),
        *(f"{api}.STREAM.MSG.GET.KV_{b}" for b in BUCKETS),
        *(f"{api}.DIRECT.GET.KV_{b}.>" for b in BUCKETS),
        f"$KV.proctor_results.{host}.>",
        f"$KV.proctor_running.{host}.>",
        # the spend tally (proctor.mechanisms.policy.tally): every host reads and compare-and-sets every budget's key
        f"{api}.STREAM.INFO.KV_proctor_usage", f"{api}.STREAM.MSG.GET.KV_proctor_usage",
        f"{api}.DIRECT.GET.KV_proctor_usage.>", "$KV.proctor_usage.>",
        # the cancel-flag watch: an ordered push consumer on the cancel bucket (read-only, as DIRECT.GET is)
        f"{api}.CONSUMER.CREATE.KV_proctor_cancel",
        f"{api}.CONSUMER.CREATE.KV_proctor_cancel.>",
        f"{api}.CONSUMER.INFO.KV_proctor_cancel.*",
        f"{api}.CONSUMER.DELETE.KV_proctor_cancel.*",
        "$JS.FC.KV_proctor_cancel.>",
    ]
    for lane in lanes:
        name = consumer_name(host, lane)
        publish += [
            f"{api}.CONSUMER.CREATE.{STREAM}.{name}.{job_subject(host, lane)}",
            f"{api}.CONSUMER.INFO.{STREAM}.{name}",
            f"{api}.CONSUMER.MSG.NEXT.{STREAM}.{name}",
            f"$JS.ACK.{STREAM}.{name}.>",
        ]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [f"_INBOX_{host}.>"]}}


@dataclass
class JetStreamDelivery:
    msg: Msg
    nc: Client

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def seq(self) -> int:
        return self.msg.metadata.sequence.stream

    @property
    def delivery(self) -> int:
        return self.msg.metadata.num_delivered

    async def ack(self) -> None:
        # Confirmed, not fire-and-forget: an ack lost in a failover would hold the lane's slot until the
        # lease ran out (30 s measured on a 1-slot lane) although the job was done.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACK_TRIES_S
        while True:
            try:
                await self.nc.request(self.msg.reply, b"+ACK", timeout=2.0)
                return
            except (*TRANSIENT, OSError):
                if loop.time() >= deadline:
                    log.warning("ack of %s not confirmed in %.0f s; a redelivery will find it done",
                                self.msg.reply, ACK_TRIES_S)
                    return
                await asyncio.sleep(0.25)

    async def nak(self, delay_s: float) -> None:
        await self.msg.nak(delay=delay_s)

    async def term(self) -> None:
        await self.msg.term()

    async def heartbeat(self, timeout_s: float) -> bool:
        # `Msg.in_progress()` is fire-and-forget; a request gets the server's reply, so a partitioned listener
        # learns that its lease was not extended instead of assuming it was.
        try:
            await self.nc.request(self.msg.reply, b"+WPI", timeout=timeout_s)
        except (nats.errors.Error, asyncio.TimeoutError, OSError):
            return False
        return True


log = logging.getLogger(__name__)


async def _log_error(exc: Exception) -> None:
    # One line per connection error (nats-py's default prints a traceback for every retry).
    log.warning("nats: %s", exc)


async def through_failover(op: Callable[[], Awaitable[T]],
                           final: Callable[[], BaseException | None] = lambda: None) -> T:
    """`op()` again while the cluster fails over (a timeout, no responders, JetStream unavailable), for up
    to FAILOVER_S; anything else, or a failover that outlasts that, is raised. `final()` naming an error
    ends the retries with it at once (a permissions violation is no failover)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FAILOVER_S
    while True:
        try:
            return await op()
        except TRANSIENT:
            stop = final()
            if stop is not None:
                raise stop from None
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.25)


async def open_client(url: str, connect_timeout_s: float = 5.0, **options: Any) -> Client:
    """A NATS connection to any of `url`'s comma-separated servers. Reconnects are unlimited once connected;
    the first connect is bounded, so a wrong URL is a ConnectionError, not a hang (nats-py applies
    max_reconnect_attempts=-1 to the initial connect too)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    nc = nats.NATS()
    options.setdefault("error_cb", _log_error)
    try:
        await asyncio.wait_for(
            nc.connect(servers=servers, connect_timeout=connect_timeout_s, max_reconnect_attempts=-1,
                       reconnect_time_wait=0.5, allow_reconnect=True, **options),
            connect_timeout_s * max(1, len(servers)),
        )
    except asyncio.TimeoutError:
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - it never connected; nothing to flush
            pass
        raise ConnectionError(f"no NATS server answered at {url} within {connect_timeout_s:.0f}s") from None
    return nc


@dataclass
class JetStreamBackend:
    """Connect with `await JetStreamBackend.connect(url)`; `manage=True` creates the stream and buckets."""

    nc: Client
    kv: dict[str, KeyValue] = field(default_factory=dict)
    subs: dict[tuple[str, str], Any] = field(default_factory=dict)
    watchers: list[tuple[Any, asyncio.Task[None]]] = field(default_factory=list)

    @classmethod
    async def connect(
        cls, url: str, *, manage: bool = True, connect_timeout_s: float = 5.0, replicas: int | None = None,
        **options: Any
    ) -> JetStreamBackend:
        """`url`: one server, or a comma-separated list of a cluster's nodes (the client connects to any that
        answers and fails over to the others, and to the nodes the cluster announces). `replicas`: copies of
        the stream and each bucket (None: 3 on a cluster, as many as it has when it has fewer; 1 alone)."""
        backend = cls(await open_client(url, connect_timeout_s, **options))
        await backend._setup(manage, replicas, connect_timeout_s)
        return backend

    def clustered(self) -> bool:
        return bool((self.nc._server_info or {}).get("cluster"))  # noqa: SLF001 - see cluster_size

    def cluster_size(self) -> int:
        """Nodes of the cluster this connection is on, as the server announced them (1: a lone server)."""
        info = self.nc._server_info or {}  # noqa: SLF001 - nats-py keeps the INFO it got only here
        if not info.get("cluster"):
            return 1
        return max(1, len(set(info.get("connect_urls") or [])))

    async def _setup(self, manage: bool, replicas: int | None, timeout_s: float) -> None:
        # A cluster answers clients before its JetStream meta leader is elected ("JetStream system temporarily
        # unavailable"): retry within the connect timeout rather than fail a listener that started first.
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + max(timeout_s, FAILOVER_S)
        while True:
            try:
                await self._setup_once(manage, replicas or (3 if self.clustered() else 1))
                return
            except nats.js.errors.APIError as exc:
                # No room for three copies: a cluster still forming (its peers not all known yet: wait), or
                # one of fewer than three nodes (then as many as it has). A node's INFO can list fewer peers
                # than the cluster has while routes form, so the count is only the fallback.
                if replicas or not self.clustered() or exc.err_code not in (10005, 10074):
                    raise
                if loop.time() < started + PLACEMENT_WAIT_S:
                    await asyncio.sleep(0.25)
                    continue
                replicas = max(1, min(3, self.cluster_size()))
            except TRANSIENT:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.25)

    async def _retrying(self, op: Callable[[], Any]) -> Any:
        return await through_failover(op)

    async def _setup_once(self, manage: bool, replicas: int) -> None:
        js = self.nc.jetstream()
        if manage:
            try:
                info = await js.stream_info(STREAM)
                limited = {k: v for k, v in STREAM_LIMITS.items() if getattr(info.config, k) != v}
                if (info.config.num_replicas or 1) < replicas or limited:
                    # A stream made on one node grows its copies when the fleet gains nodes (JetStream
                    # scales a stream's replicas in place); one made before the quota gets it.
                    await js.update_stream(dataclasses.replace(
                        info.config, num_replicas=max(replicas, info.config.num_replicas or 1), **limited))
            except nats.js.errors.NotFoundError:
                await js.add_stream(
                    StreamConfig(
                        name=STREAM,
                        subjects=[f"{SUBJECT_PREFIX}.>"],
                        retention=RetentionPolicy.WORK_QUEUE,
                        duplicate_window=120.0,
                        num_replicas=replicas,
                        **STREAM_LIMITS,
                    )
                )
        for bucket in BUCKETS:
            if manage:
                try:
                    self.kv[bucket] = await js.key_value(bucket)
                    info = await js.stream_info(f"KV_{bucket}")
                    if (info.config.num_replicas or 1) < replicas:
                        await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))
                except nats.js.errors.BucketNotFoundError:
                    self.kv[bucket] = await js.create_key_value(
                        KeyValueConfig(bucket=bucket, history=1, ttl=RECORD_TTL_S, replicas=replicas)
                    )
            else:
                self.kv[bucket] = await js.key_value(bucket)

    async def publish(self, target: str, lane: str, job_id: str, data: bytes) -> bool:
        ack = await self.nc.jetstream().publish(job_subject(target, lane), data, headers={"Nats-Msg-Id": job_id})
        # Inside the duplicate window the server drops a message whose id it has seen and says so only here;
        # a caller that ignored it would wait on a message that was never queued a second time. (Were this
        # publish ever retried through a failover, a duplicate on the retry would be its own first attempt.)
        return bool(ack.duplicate)

    async def ensure_lane(
        self, host: str, lane: str, *, slots: int, ack_wait_s: float, max_deliver: int = -1
    ) -> None:
        js = self.nc.jetstream()
        name = consumer_name(host, lane)
        # `name` (not only `durable_name`) puts the filter subject into the API subject, so a host's NKEY
        # permission can allow creating its own consumer and only with its own filter.
        await js.add_consumer(
            STREAM,
            ConsumerConfig(
                name=name,
                durable_name=name,
                filter_subject=job_subject(host, lane),
                ack_wait=ack_wait_s,
                max_ack_pending=slots,
                max_deliver=max_deliver,
            ),
        )
        self.subs[(host, lane)] = await js.pull_subscribe_bind(name, stream=STREAM)

    async def has_listener(self, host: str, lane: str) -> bool:
        try:
            await self.nc.jetstream().consumer_info(STREAM, consumer_name(host, lane), timeout=5.0)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def take_slot(self, key: str, limit: int) -> bool:
        kv = await self._quota_kv()
        for _ in range(QUOTA_RACES):
            try:
                entry = await self._retrying(lambda: kv.get(key))
            except nats.js.errors.KeyNotFoundError:
                entry = None
            count = int(entry.value or b"0") if entry is not None else 0
            if count >= limit:
                return False
            try:
                # Compare-and-set on the key's revision: two servers counting at once cannot both take the
                # last slot. A write whose ack was lost and is retried reads as a lost race and counts again:
                # the share errs short, never long.
                if entry is None:
                    await self._retrying(lambda: kv.create(key, b"1"))
                else:
                    await self._retrying(lambda: kv.update(key, str(count + 1).encode(), last=entry.revision))
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        raise RuntimeError(f"the quota key {key} changed under {QUOTA_RACES} attempts in a row")

    async def _quota_kv(self) -> KeyValue:
        if QUOTA_BUCKET not in self.kv:
            js = self.nc.jetstream()
            try:
                self.kv[QUOTA_BUCKET] = await js.key_value(QUOTA_BUCKET)
            except nats.js.errors.BucketNotFoundError:
                try:
                    self.kv[QUOTA_BUCKET] = await js.create_key_value(KeyValueConfig(
                        bucket=QUOTA_BUCKET, history=1, ttl=QUOTA_KEY_TTL_S, replicas=min(3, self.cluster_size())))
                except nats.js.errors.APIError:  # another server made it first (its replicas may differ)
                    self.kv[QUOTA_BUCKET] = await js.key_value(QUOTA_BUCKET)
        return self.kv[QUOTA_BUCKET]

    async def fetch(self, host: str, lane: str, max_n: int, timeout_s: float) -> list[JetStreamDelivery]:
        try:
            msgs = await self.subs[(host, lane)].fetch(max_n, timeout=timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        return [JetStreamDelivery(m, self.nc) for m in msgs]

    async def _get(self, bucket: str, key: str) -> bytes | None:
        try:
            entry = await self._retrying(lambda: self.kv[bucket].get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value

    async def put_job(self, job_id: str, data: bytes) -> None:
        # Create, never overwrite: the first record of a job id stays (a sender that may write records
        # cannot rewrite another job's; a record is a display hint all the same, trusted by no reader).
        try:
            await self._retrying(lambda: self.kv["proctor_jobs"].create(job_id, data))
        except nats.js.errors.KeyWrongLastSequenceError:
            log.warning("job %s already has a record on the server; the first one stays", job_id)

    async def get_job(self, job_id: str) -> bytes | None:
        return await self._get("proctor_jobs", job_id)

    async def put_result(self, key: str, data: bytes, *, only_if_absent: bool = False) -> bool:
        kv = self.kv["proctor_results"]
        if not only_if_absent:
            await self._retrying(lambda: kv.put(key, data))
            return True
        try:
            await self._retrying(lambda: kv.create(key, data))
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def get_result(self, key: str) -> bytes | None:
        return await self._get("proctor_results", key)

    async def wait_result(self, key: str, timeout_s: float) -> bytes | None:
        # Polling with backoff rather than a KV watch: a watch needs an ordered consumer, which a restricted
        # user may not create, and `send` waits minutes, so 200 ms of extra latency is immaterial.
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + timeout_s, 0.005
        while True:
            data = await self.get_result(key)
            if data is not None or loop.time() >= deadline:
                return data
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, 0.2)

    async def put_running(self, key: str, data: bytes) -> None:
        await self._retrying(lambda: self.kv["proctor_running"].put(key, data))

    async def get_running(self, key: str) -> bytes | None:
        return await self._get("proctor_running", key)

    async def set_cancel(self, key: str, reason: str) -> None:
        await self._retrying(lambda: self.kv["proctor_cancel"].put(key, reason.encode()))

    async def get_cancel(self, key: str) -> str | None:
        data = await self._get("proctor_cancel", key)
        return data.decode(errors="replace") if data else None

    async def watch_cancels(self, host: str, on_cancel: Callable[[str, str], None]) -> None:
        watcher = await self.kv["proctor_cancel"].watch(f"{check_name('host', host)}.>")
        # The flags already set arrive first, then a None marker: return only once they are all known.
        while (entry := await watcher.updates(timeout=10.0)) is not None:
            if entry.value:
                on_cancel(entry.key, entry.value.decode(errors="replace"))

        async def pump() -> None:
            async for entry in watcher:
                if entry is not None and entry.value:
                    on_cancel(entry.key, entry.value.decode(errors="replace"))

        self.watchers.append((watcher, asyncio.create_task(pump())))

    async def close(self) -> None:
        for watcher, task in self.watchers:
            task.cancel()
            try:
                await watcher.stop()
            except nats.errors.Error:
                pass  # the connection is going anyway
        await self.nc.close()
