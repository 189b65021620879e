"""The listener: takes this host's jobs off its lanes, verifies each before anything runs, runs it at most once
at a time, holds its lease, and answers with a result signed by the host key.

Owns the order of checks and the lease. Verification, in order: signature over the exact bytes by a key in
signers.toml; that signer trusted for the kind; target is this host and lane is the lane it came on; not
expired (nor issued in the future, past the skew); nonce never seen in another message; the payload a valid
request; `validateCommand`, or a `confine` weaker than this listener's configured confinement (off < auto <
required), only from a signer allowed `may_set_validate_command` (both are RCE-equivalent on this host). A refused job is recorded in the audit log and
answered with a `failed` result naming why. It never judges an agent's work (run_agent does).

Lease: the broker's `ack_wait` is the lease; a confirmed `in_progress` heartbeat every `ack_wait/4` extends
it. A listener that has had no confirmed heartbeat for `lease_margin * ack_wait` cancels its own job (the
run's tree is killed) and releases it in the store, so the broker's redelivery after `ack_wait` never
overlaps a live run. A released or finished job that the store does not show as ours is never acked or
answered (fencing by delivery number).

Every result names the digest of the envelope it answers (`results`), and the store binds a job id to one
envelope: a second, different envelope with a known job id (another signer's noop squatting on a queued
run_agent's id, say) is refused as DUPLICATE_JOB_ID and never claims, finishes or answers the first. If the
squatter got here first (the real job still queued behind a busy lane), the real one, earlier in the stream,
displaces it when it arrives and runs (`store.JobStore`, `queue.displaced` in the ledger).

Where answers go: the envelope that owns a job id is answered at `<host>.<jobId>`; any other envelope, at
`<host>.<jobId>.env-<digest>` (`backend.answer_key`): a refused second envelope with a known id, and one whose
signature does not verify, so neither can overwrite or pre-empt the owner's answer. A replay is answered at
`<host>.<jobId>.replay-<seq>`, a copy that came on another lane than its envelope's at
`<host>.<jobId>.misrouted-<seq>`: both are facts about one message, so neither becomes the job's outcome. Ledger rows a reader checks (`queue.end`, `queue.refused`, `queue.released`)
are committed before the answer is published or the job handed back, so whoever holds an answer can read
its rows. (A listener killed between the store's `done` and the `queue.end` commit leaves a job whose stored
result a redelivery re-publishes without an end row; the store, not the ledger, is the authority there.)

Cancel flags (`proctor_cancel` KV) are signed requests (`sender.cancel`): one is honoured only if it
verifies with a trusted signer's key, names this host, the job and its envelope digest, and comes from the
job's own signer or one allowed `may_set_validate_command`. Anything else on the server (an unsigned flag, a
job record) is never acted on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status, parse_request
from proctor.mechanisms.queue.backend import Delivery, QueueBackend, answer_key, check_name, record_key, valid_job_id
from proctor.mechanisms.queue.envelope import (
    CANCEL_DOMAIN,
    EnvelopeError,
    Opened,
    Signer,
    Unsealed,
    envelope_digest,
    unseal,
    verify,
)
from proctor.services.listen.kinds import AgentJob, KindRunner
from proctor.mechanisms.queue.results import seal_result
from proctor.mechanisms.queue.signers import TrustStore
from proctor.mechanisms.queue.store import Claim, ClaimOutcome, JobStore, StoreBusy

log = logging.getLogger(__name__)
# How soon to look again at a job whose dead owner's runner is still killing the agent (a TERM grace, ~2 s).
DRAIN_RETRY_S = 0.5
# Commits the event loop makes to the job store between two WAL checkpoints (in a worker thread): a few
# hundred kilobytes of WAL at a no-op job's 8-10 pages a job.
CHECKPOINT_EVERY = 100
# A job still running this long after it started gets its running record (`proctor job` shows where it runs).
RUNNING_RECORD_AFTER_S = 0.1
# Confinement strength: a request may tighten the listener's setting freely, weaken it only with privilege.
CONFINE_ORDER = {"off": 0, "auto": 1, "required": 2}


class Refusal(StrEnum):
    """Stable codes for a job the listener would not run; carried in the signed result's `refusal`."""

    MALFORMED = "MALFORMED"
    UNTRUSTED_SIGNER = "UNTRUSTED_SIGNER"
    FORGED = "FORGED"
    KIND_NOT_ALLOWED = "KIND_NOT_ALLOWED"
    UNKNOWN_KIND = "UNKNOWN_KIND"
    MISTARGETED = "MISTARGETED"
    MISROUTED = "MISROUTED"
    EXPIRED = "EXPIRED"
    NOT_YET_VALID = "NOT_YET_VALID"
    REPLAYED = "REPLAYED"
    OVER_PRIVILEGED = "OVER_PRIVILEGED"
    INVALID_REQUEST = "INVALID_REQUEST"
    CANCELLED = "CANCELLED"
    DUPLICATE_JOB_ID = "DUPLICATE_JOB_ID"  # the job id belongs to another envelope on this host


class AuditLog(Protocol):
    """`append` may buffer (BatchedAudit); an audit with a `flush()` method is flushed before the listener
    publishes anything a reader may check against it. One without (a plain Ledger) writes at once. One with an
    async `commit()` (BatchedAudit) is appended to on the event loop and group-committed by `commit()`; any
    other is written from a worker thread."""

    def append(self, kind: str, payload: dict[str, Any], *, job_id: str | None = None) -> int: ...


@dataclass(frozen=True)
class Settings:
    host: str
    lanes: dict[str, int]
    ack_wait_s: float = 60.0
    # Attempts per job, crashes and busy waits included; past it the broker stops redelivering (the
    # sender's wait then times out), so a job that kills its listener cannot loop forever.
    max_deliver: int = 10
    lease_margin: float = 0.6
    clock_skew_s: float = 60.0
    fetch_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        check_name("host", self.host)
        if not (math.isfinite(self.ack_wait_s) and self.ack_wait_s > 0):
            raise ValueError(f"ack_wait must be a positive number of seconds, got {self.ack_wait_s}")
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise ValueError(f"heartbeat interval must be positive, got {self.heartbeat_s}")
        for lane, slots in self.lanes.items():
            check_name("lane", lane)
            if slots < 1:
                raise ValueError(f"lane {lane} needs at least one slot, got {slots}")
        if not 0.1 <= self.lease_margin < 0.9:
            raise ValueError("lease_margin must leave time to kill the job before the lease expires (0.1-0.9)")

    @property
    def heartbeat_s(self) -> float:
        return self.ack_wait_s / 4


@dataclass(frozen=True)
class Refused:
    code: Refusal
    reason: str
    authentic: bool
    claimed: dict[str, Any]
    digest: str | None = None  # of the envelope's body bytes, when it had one: what the refusal answers


@dataclass(frozen=True)
class Accepted:
    opened: Opened
    fields: dict[str, Any]
    request: RunAgentRequest | None = None  # the parsed payload of a run_agent job


def check_envelope(
    raw: bytes, *, trust: TrustStore, host: str, lane: str, kinds: frozenset[str], now: float, skew_s: float,
    confine: str = "auto", admitted: Callable[[str, str], bool] | None = None,
) -> Accepted | Refused:
    """Every check in the documented order; nothing in the body is used before its signature has been verified.

    `confine` is this listener's configured confinement; `admitted(job_id, digest)` says whether the store
    already has this envelope's row for the job: a job once admitted is not refused as expired on redelivery
    (the claim decides)."""
    env = unseal(raw)
    if isinstance(env, EnvelopeError):
        return Refused(Refusal.MALFORMED, env.reason, False, {})
    checked = _check(env, trust=trust, host=host, lane=lane, kinds=kinds, now=now, skew_s=skew_s, confine=confine,
                     admitted=admitted)
    if isinstance(checked, Refused):
        return dataclasses.replace(checked, digest=envelope_digest(env.body))
    return checked


def _check(
    env: Unsealed, *, trust: TrustStore, host: str, lane: str, kinds: frozenset[str], now: float, skew_s: float,
    confine: str, admitted: Callable[[str, str], bool] | None,
) -> Accepted | Refused:
    signer = trust.signer(env.claimed.get("signer"))
    opened = verify(env, signer.verifier if signer else None)
    if isinstance(opened, EnvelopeError):
        return Refused(Refusal(opened.code), opened.reason, False, env.claimed)
    assert signer is not None
    f = opened.fields
    kind, job_id = f.get("kind"), f.get("jobId")
    if not valid_job_id(job_id) or not isinstance(f.get("payload"), dict):
        return Refused(Refusal.MALFORMED, "envelope body needs a jobId ([A-Za-z0-9_-]{1,128}) and an object "
                       "payload", True, f)
    if kind not in signer.kinds:
        return Refused(Refusal.KIND_NOT_ALLOWED, f"signer {signer.name} may not send kind {kind!r}", True, f)
    if kind not in kinds:
        return Refused(Refusal.UNKNOWN_KIND, f"this listener runs kinds {sorted(kinds)}, not {kind!r}", True, f)
    if f.get("target") != host:
        return Refused(Refusal.MISTARGETED, f"job is for host {f.get('target')!r}, this is {host!r}", True, f)
    if f.get("lane") != lane:
        return Refused(Refusal.MISROUTED, f"job is for lane {f.get('lane')!r}, it came on {lane!r}", True, f)
    exp, iat = f.get("expiresAt"), f.get("issuedAt")
    if not isinstance(exp, (int, float)) or not isinstance(iat, (int, float)):
        return Refused(Refusal.MALFORMED, "issuedAt and expiresAt must be numbers", True, f)
    if now > exp + skew_s and not (admitted is not None and admitted(job_id, opened.digest)):
        return Refused(Refusal.EXPIRED, f"job expired at {exp:.0f}, now {now:.0f} (skew {skew_s:.0f}s)", True, f)
    if iat - skew_s > now:
        return Refused(Refusal.NOT_YET_VALID, f"job issued at {iat:.0f}, in the future (now {now:.0f})", True, f)
    if not isinstance(f.get("nonce"), str) or not f["nonce"]:
        return Refused(Refusal.MALFORMED, "envelope body needs a nonce", True, f)
    if kind != "run_agent":
        return Accepted(opened, f)
    parsed = parse_request(f["payload"])
    if isinstance(parsed, list):
        return Refused(Refusal.INVALID_REQUEST, "; ".join(parsed), True, f)
    if parsed.validate_command is not None and not signer.may_set_validate_command:
        return Refused(
            Refusal.OVER_PRIVILEGED, f"signer {signer.name} may not set validateCommand (shell on this host)", True, f
        )
    if parsed.holdout and not signer.may_set_validate_command:
        return Refused(
            Refusal.OVER_PRIVILEGED, f"signer {signer.name} may not name held-out test dirs (paths on this host): "
            "that needs may_set_validate_command", True, f
        )
    if (parsed.confine is not None and CONFINE_ORDER[parsed.confine] < CONFINE_ORDER.get(confine, 1)
            and not signer.may_set_validate_command):
        return Refused(
            Refusal.OVER_PRIVILEGED, f"signer {signer.name} may not weaken confinement to {parsed.confine!r} "
            f"(this host's is {confine!r}): that needs may_set_validate_command (RCE-equivalent)", True, f
        )
    return Accepted(opened, f, parsed)


class Stop(StrEnum):
    """Why a run was stopped early; `released` ones are handed back for another delivery to take over."""

    CANCELLED = "cancelled"  # a user asked: the job ends with code CANCELLED
    LEASE_LOST = "lease_lost"  # partitioned or fenced: released, not acked, the broker redelivers
    STOPPING = "stopping"  # the listener shuts down: released and nak'd for the next listener at once


class _Lease:
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


_Admitted = tuple[Accepted | Refused, Claim | None]


class _StoreOnLoop:
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


@dataclass
class Listener:
    settings: Settings
    backend: QueueBackend
    trust: TrustStore
    host_key: Signer
    store: JobStore
    audit: AuditLog
    runners: dict[str, KindRunner]
    running: dict[str, _Lease] = field(default_factory=dict)
    cancels: dict[str, str] = field(default_factory=dict)  # record key -> signed cancel request, pushed
    # (record key, envelope digest) -> (flag, reason or None): each distinct flag is verified once per envelope
    _cancel_checked: dict[tuple[str, str], tuple[str, str | None]] = field(default_factory=dict)
    confine: str = "auto"  # this host's configured confinement (proctor.mechanisms.config.load), the floor for requests
    _store_on_loop: _StoreOnLoop | None = field(default=None, init=False, repr=False)

    @property
    def _kinds(self) -> frozenset[str]:
        return frozenset(self.runners)

    async def serve(self, stop: asyncio.Event) -> None:
        s = self.settings
        for lane, slots in s.lanes.items():
            await self.backend.ensure_lane(s.host, lane, slots=slots, ack_wait_s=s.ack_wait_s,
                                           max_deliver=s.max_deliver)
        await asyncio.to_thread(self.store.prune, time.time(), s.clock_skew_s)
        await self.backend.watch_cancels(s.host, self.cancels.__setitem__)
        lanes = [asyncio.create_task(self._lane(lane, slots, stop)) for lane, slots in s.lanes.items()]
        await stop.wait()
        for lease in list(self.running.values()):
            lease.cancel("the listener is stopping", Stop.STOPPING)
        await asyncio.gather(*lanes)

    async def _lane(self, lane: str, slots: int, stop: asyncio.Event) -> None:
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            free = slots - len(tasks)
            if free <= 0:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks = {t for t in tasks if not t.done()}
                continue
            batch = await self.backend.fetch(self.settings.host, lane, free, self.settings.fetch_timeout_s)
            if not batch:
                continue
            for d, admitted in zip(batch, await self._check_and_admit(lane, batch), strict=True):
                task = asyncio.create_task(self._handle_logged(lane, d, admitted))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)

    async def _handle_logged(self, lane: str, d: Delivery, admitted: _Admitted | BaseException) -> None:
        try:
            if isinstance(admitted, BaseException):
                raise admitted
            await self.handle(lane, d, admitted)
        except Exception:
            # Unacked, so the broker redelivers it; the store decides again then. Never kill the lane for one.
            log.exception("job delivery %s/%s failed; left for redelivery", d.seq, d.delivery)

    def _db(self) -> _StoreOnLoop:
        if self._store_on_loop is None or self._store_on_loop.store is not self.store:
            self._store_on_loop = _StoreOnLoop(self.store)
        return self._store_on_loop

    def _verify(self, lane: str, d: Delivery, now: float, *, wait: bool) -> Accepted | Refused:
        s, store = self.settings, self.store

        def admitted(job_id: str, digest: str) -> bool:
            return bool(store.read(functools.partial(store.op_admitted, job_id, digest), wait=wait))

        return check_envelope(
            d.data, trust=self.trust, host=s.host, lane=lane, kinds=self._kinds, now=now, skew_s=s.clock_skew_s,
            confine=self.confine, admitted=admitted,
        )

    async def _check_and_admit(self, lane: str, batch: list[Delivery]) -> list[_Admitted | BaseException]:
        """Verify each envelope of a fetched batch, in order, then record the nonces and claim the jobs of the
        accepted ones in one store transaction (one commit for the batch, made before any of them starts).

        On the event loop, without a thread hop: a signature check is ~0.1 ms of CPU, which a worker thread
        would not take off this loop (measured: the hop costs as much, and the check holds the GIL); the
        store is used from here only while it is free (`StoreBusy`: a worker thread waits for it instead).
        The order of checks is `check_envelope`'s, unchanged."""
        s, now = self.settings, time.time()
        checked: list[Accepted | Refused | BaseException] = []
        for d in batch:
            try:
                try:
                    checked.append(self._verify(lane, d, now, wait=False))
                except StoreBusy:  # only an expired envelope reads the store (was it admitted already?)
                    checked.append(await asyncio.to_thread(self._verify, lane, d, now, wait=True))
            except Exception as exc:  # noqa: BLE001 - this delivery alone is left for redelivery
                checked.append(exc)
        db = self._db()
        claims: dict[int, asyncio.Future[Any]] = {}
        for i, (d, c) in enumerate(zip(batch, checked, strict=True)):
            if isinstance(c, Accepted):
                f = c.fields
                claims[i] = db.submit(functools.partial(
                    self.store.op_admit, f["jobId"], nonce=f["nonce"], seq=d.seq, delivery=d.delivery, lane=lane,
                    kind=f["kind"], expires_at=float(f["expiresAt"]),
                    keep_until=float(f["expiresAt"]) + s.clock_skew_s, digest=c.opened.digest))
        db.commit_now()
        out: list[_Admitted | BaseException] = []
        for i, c in enumerate(checked):
            if isinstance(c, BaseException):
                out.append(c)
            elif i in claims:
                try:
                    out.append((c, await claims[i]))
                except Exception as exc:  # noqa: BLE001 - as above
                    out.append(exc)
            else:
                out.append((c, None))
        return out

    async def handle(self, lane: str, d: Delivery, admitted: _Admitted | None = None) -> None:
        s = self.settings
        if admitted is None:
            (one,) = await self._check_and_admit(lane, [d])
            if isinstance(one, BaseException):
                raise one
            admitted = one
        checked, claim = admitted
        if isinstance(checked, Refused):
            await self._refuse(d, lane, checked)
            return
        assert claim is not None
        f = checked.fields
        job_id = f["jobId"]
        key = record_key(s.host, job_id)
        if claim.outcome is ClaimOutcome.CONFLICT:
            await self._refuse(d, lane, Refused(
                Refusal.DUPLICATE_JOB_ID, f"job id {job_id} already belongs to another envelope on {s.host} "
                f"(digest {str(claim.owner_digest)[:16]}..., this one {checked.opened.digest[:16]}...): "
                "refused, the other job is untouched", True, f, checked.opened.digest), conflict=True)
        elif claim.outcome is ClaimOutcome.REPLAYED:
            await self._refuse(d, lane, Refused(Refusal.REPLAYED, f"nonce {f['nonce']} was already used by job "
                                                f"{job_id} in another message", True, f, checked.opened.digest),
                               replay=True)
        elif claim.outcome is ClaimOutcome.DONE:
            if claim.result is not None:
                await self.backend.put_result(key, claim.result)
            await d.ack()
        elif claim.outcome is ClaimOutcome.BUSY:
            # The owner is alive (its lease lapsed under load, or a second listener here): wait it out.
            await self._audit("queue.busy", {"delivery": d.delivery, "lane": lane}, job_id=job_id)
            await d.nak(s.ack_wait_s)
        elif claim.outcome is ClaimOutcome.DRAINING:
            await self._audit("queue.draining", {"delivery": d.delivery}, job_id=job_id)
            await d.nak(DRAIN_RETRY_S)
        elif claim.outcome is ClaimOutcome.STALE:
            await self._audit("queue.stale", {"delivery": d.delivery}, job_id=job_id)
        elif requested := self._cancel_for(key, checked):
            self.cancels.pop(key, None)
            self._cancel_checked.pop((key, checked.opened.digest), None)
            await self._refuse(d, lane, Refused(Refusal.CANCELLED, f"cancelled before it started: {requested}",
                                                True, f, checked.opened.digest), claimed=True)
        else:
            if claim.owner_digest is not None:
                await self._displaced(job_id, claim.owner_digest, claim.displaced, checked)
            try:
                await self._run(d, lane, checked, list(claim.abandoned))
            except Exception as exc:  # noqa: BLE001 - never strand a claimed job as running with a live owner
                log.exception("job %s delivery %s failed in the listener; released for redelivery", job_id, d.delivery)
                await self._db().write(functools.partial(self.store.op_release, job_id, d.delivery,
                                                         f"listener error: {exc!r}"))
                await self._audit("queue.released", {"delivery": d.delivery, "reason": f"listener error: {exc!r}"},
                                  job_id=job_id, durable=True)
                await d.nak(0)

    async def _displaced(self, job_id: str, digest: str, answer: bytes | None, accepted: Accepted) -> None:
        """The job id passed from a later envelope (a squatter that got here first) to this one, which was in
        the stream before it: record it, and move the squatter's answer to its own envelope's key."""
        await self._audit("queue.displaced", {"digest": digest, "by": accepted.opened.digest,
                                              "answered": answer is not None}, job_id=job_id, durable=True)
        if answer is not None:
            await self.backend.put_result(answer_key(self.settings.host, job_id, digest), answer)

    def _cancel_for(self, key: str, accepted: Accepted) -> str | None:
        """The reason of a valid signed cancel request for this job's envelope, else None (see the module
        docstring). Checked once per distinct flag value."""
        flag = self.cancels.get(key)
        if not flag:
            return None
        memo = (key, accepted.opened.digest)
        seen = self._cancel_checked.get(memo)
        if seen is not None and seen[0] == flag:
            return seen[1]
        reason = self._verify_cancel(flag, accepted)
        if reason is None:
            log.warning("job %s: ignoring a cancel flag that is not a valid signed request for its envelope", key)
        self._cancel_checked[memo] = (flag, reason)
        return reason

    def _verify_cancel(self, flag: str, accepted: Accepted) -> str | None:
        env = unseal(flag.encode(errors="replace"))
        if isinstance(env, EnvelopeError):
            return None
        signer = self.trust.signer(env.claimed.get("signer"))
        opened = verify(env, signer.verifier if signer else None, CANCEL_DOMAIN)
        if isinstance(opened, EnvelopeError) or signer is None:
            return None
        c, f = opened.fields, accepted.fields
        if (c.get("kind") != "cancel" or c.get("target") != self.settings.host or c.get("jobId") != f["jobId"]
                or c.get("envelope") != accepted.opened.digest):
            return None
        if opened.kid != accepted.opened.kid and not signer.may_set_validate_command:
            return None
        return str(c.get("reason") or "cancelled")[:1000]

    async def _audit(
        self, kind: str, payload: dict[str, Any], *, job_id: str | None = None, durable: bool = False
    ) -> None:
        """Append an audit row; `durable`: committed (with every row before it) when this returns, for rows
        that must be readable by the time anything is published."""
        commit = getattr(self.audit, "commit", None)
        if commit is not None:  # BatchedAudit: a list append here, and a group commit when it must be durable
            self.audit.append(kind, payload, job_id=job_id)
            if durable:
                await commit()
            return

        def write() -> None:
            self.audit.append(kind, payload, job_id=job_id)
            flush = getattr(self.audit, "flush", None)
            if durable and flush is not None:
                flush()

        await asyncio.to_thread(write)

    async def _refuse(
        self, d: Delivery, lane: str, refused: Refused, *, replay: bool = False, claimed: bool = False,
        conflict: bool = False,
    ) -> None:
        s, f = self.settings, refused.claimed
        job_id = f["jobId"] if valid_job_id(f.get("jobId")) else f"seq-{d.seq}"
        await self._audit(
            "queue.refused",
            {"code": refused.code.value, "reason": refused.reason, "seq": d.seq, "delivery": d.delivery,
             "lane": lane, "signer": f.get("signer"), "nonce": f.get("nonce"), "authentic": refused.authentic,
             "kind": f.get("kind"), "digest": refused.digest},
            job_id=job_id, durable=True,
        )
        result = RunAgentResult(
            status=Status.failed,
            code=Code.CANCELLED if refused.code is Refusal.CANCELLED else Code.INVALID_REQUEST,
            summary=f"refused by {s.host}: {refused.code.value}: {refused.reason}",
            known_risks=[f"job refused before anything ran ({refused.code.value})"],
            agent=str((f.get("payload") or {}).get("agent", "")) if isinstance(f.get("payload"), dict) else "",
            job_id=job_id,
        )
        sealed = seal_result(job_id=job_id, host=s.host, result=result, signer=self.host_key,
                             envelope=refused.digest, refusal=refused.code.value, delivery=d.delivery).to_wire()
        key = record_key(s.host, job_id)
        if replay:
            await self.backend.put_result(f"{key}.replay-{d.seq}", sealed)
        elif refused.code is Refusal.MISROUTED:
            # A fact about this message (the subject it came on), not about the envelope: the sender publishes
            # on its envelope's lane, so this is someone's copy, and the real message may still be queued.
            # Answered beside, never stored as the job's outcome (it would answer the real one when it came).
            await self.backend.put_result(f"{key}.misrouted-{d.seq}", sealed)
        elif claimed:
            if await self._db().write(functools.partial(self.store.op_finish, job_id, d.delivery, sealed)):
                await self.backend.put_result(key, sealed)
        elif conflict and refused.digest:
            await self.backend.put_result(answer_key(s.host, job_id, refused.digest), sealed, only_if_absent=True)
        elif refused.authentic:
            # Never overwrite a real result: a replay on another lane or an expired redelivery of a finished
            # job is answered from the store, and written only if absent; another envelope reusing the job id
            # (another kind, another signer) is answered at its own key, beside the owner's.
            answer = await self._db().write(functools.partial(
                self.store.op_finish_refused, job_id, seq=d.seq, lane=lane, kind=str(f.get("kind")),
                expires_at=float(f.get("expiresAt") or time.time()), result=sealed, digest=refused.digest))
            if answer.result is not None and answer.owner:
                await self.backend.put_result(key, answer.result, only_if_absent=True)
            elif answer.result is not None and refused.digest:
                await self.backend.put_result(answer_key(s.host, job_id, refused.digest), answer.result,
                                              only_if_absent=True)
        elif refused.digest:
            # Not authentic: answered at its own envelope's key, never at the owner's (so a forgery can
            # neither overwrite nor pre-empt a real answer).
            await self.backend.put_result(answer_key(s.host, job_id, refused.digest), sealed, only_if_absent=True)
        else:
            await self.backend.put_result(key, sealed, only_if_absent=True)
        await d.term()

    async def _run(self, d: Delivery, lane: str, accepted: Accepted, abandoned: list[str]) -> None:
        s, f = self.settings, accepted.fields
        job_id, kind = f["jobId"], f["kind"]
        key = record_key(s.host, job_id)
        lease = _Lease()
        started = time.time()
        self.running[job_id] = lease
        await self._audit("queue.start", {"kind": kind, "lane": lane, "delivery": d.delivery, "seq": d.seq,
                                          "nonce": f["nonce"], "signer": accepted.opened.kid,
                                          "digest": accepted.opened.digest}, job_id=job_id)
        # The running record is a display hint (`proctor job`), written only for a job still running after
        # RUNNING_RECORD_AFTER_S: a job that ends sooner is shown by its result, and on a cluster each record is
        # one more replicated write (measured: about a sixth of the servers' work for a no-op job).
        begun: list[bool] = []
        marked = asyncio.create_task(self._mark_running(key, json.dumps(
            {"host": s.host, "lane": lane, "delivery": d.delivery, "startedAt": started}).encode(), begun))
        job = AgentJob(job_id, d.delivery, accepted.request, lane) if accepted.request else None
        work = asyncio.create_task(self.runners[kind].run(job, f["payload"], lease.get))
        keeper = asyncio.create_task(self._keep(d, key, accepted, lease, work))
        try:
            result = await work
        finally:
            keeper.cancel()
            self.running.pop(job_id, None)
            self.cancels.pop(key, None)
            self._cancel_checked.pop((key, accepted.opened.digest), None)
            if not begun:
                marked.cancel()  # not due yet: the job ended first (a record being written is let finish)
            try:
                await marked
            except asyncio.CancelledError:
                if not marked.cancelled():
                    raise  # this task itself is being cancelled
            except Exception:  # noqa: BLE001 - the running record is for lookups only; the run's result stands
                log.warning("job %s: could not write its running record", job_id, exc_info=True)
        if lease.why in (Stop.LEASE_LOST, Stop.STOPPING):
            await self._db().write(functools.partial(self.store.op_release, job_id, d.delivery,
                                                     lease.reason or "released"))
            await self._audit("queue.released", {"delivery": d.delivery, "reason": lease.reason}, job_id=job_id,
                              durable=True)
            if lease.why is Stop.STOPPING:
                await d.nak(0)  # not partitioned: let the next listener start at once
            return
        result.job_id = job_id
        result.known_risks = [*abandoned, *result.known_risks]
        if abandoned:
            result.needs_human_review = True
        sealed = seal_result(job_id=job_id, host=s.host, result=result, signer=self.host_key,
                             envelope=accepted.opened.digest, started_at=started, delivery=d.delivery).to_wire()
        if not await self._db().write(functools.partial(self.store.op_finish, job_id, d.delivery, sealed)):
            await self._audit("queue.fenced", {"delivery": d.delivery}, job_id=job_id)
            return
        # The end row is committed before the result is published: whoever holds the result can read it.
        await self._audit("queue.end", {"delivery": d.delivery, "status": result.status.value,
                                        "code": result.code.value, "digest": accepted.opened.digest},
                          job_id=job_id, durable=True)
        await self.backend.put_result(key, sealed)
        await d.ack()

    async def _mark_running(self, key: str, record: bytes, begun: list[bool]) -> None:
        await asyncio.sleep(RUNNING_RECORD_AFTER_S)
        begun.append(True)
        await self.backend.put_running(key, record)

    async def _keep(self, d: Delivery, key: str, accepted: Accepted, lease: _Lease, work: asyncio.Task[Any]) -> None:
        """Heartbeat the lease, fence against the store, and watch the cancel flag until the work ends."""
        s, job_id = self.settings, accepted.fields["jobId"]
        loop = asyncio.get_running_loop()
        confirmed = next_beat = loop.time()
        while not work.done():
            now = loop.time()
            if now >= next_beat:
                next_beat = now + s.heartbeat_s
                # Bounded by what is left of the lease margin, so a hung heartbeat cannot delay the self-kill.
                left = s.lease_margin * s.ack_wait_s - (now - confirmed)
                try:
                    ok = await asyncio.wait_for(d.heartbeat(s.heartbeat_s / 2), max(0.01, min(s.heartbeat_s, left)))
                except asyncio.TimeoutError:
                    ok = False
                if ok:
                    confirmed = now  # the time it was sent: the server reset its timer no earlier than this
                if not await self._db().read(functools.partial(self.store.op_still_owner, job_id, d.delivery)):
                    lease.cancel("fenced: the store shows another delivery owns this job", Stop.LEASE_LOST)
            if loop.time() - confirmed > s.lease_margin * s.ack_wait_s:
                lease.cancel(f"lease lost: no confirmed heartbeat for {loop.time() - confirmed:.1f}s "
                             f"(ack_wait {s.ack_wait_s:.0f}s)", Stop.LEASE_LOST)
            requested = self._cancel_for(key, accepted)
            if requested:
                lease.cancel(f"cancelled by request: {requested}")
            await asyncio.wait({work}, timeout=min(0.1, s.heartbeat_s / 4))
