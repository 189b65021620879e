"""The listener: takes this host's jobs off its lanes, verifies each before anything runs, runs it at most once
at a time, holds its lease, and answers with a result signed by the host key.

Owns the order of things for one delivery: check (`checks.check_envelope`, whose order is documented there),
admit and claim in the store, run under a lease (`lease.py`), answer. A refused job is recorded in the audit
log and answered with a `failed` result naming why. It never judges an agent's work (run_agent does).

A released or finished job that the store does not show as ours is never acked or answered (fencing by
delivery number).

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

Cancel flags are honoured only as signed requests for the job's own envelope (`cancels.py`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from proctor.contract import Code, Requester, RunAgentResult, Status
from proctor.mechanisms.queue.backend import Delivery, QueueBackend, answer_key, check_name, record_key, valid_job_id
from proctor.mechanisms.queue.envelope import Signer
from proctor.mechanisms.queue.results import seal_result
from proctor.mechanisms.queue.signers import TrustStore
from proctor.mechanisms.queue.store import Claim, ClaimOutcome, JobStore, StoreBusy
from proctor.services.listen.audit import AuditLog, record_row
from proctor.services.listen.cancels import CancelFlags
from proctor.services.listen.checks import Accepted, Refusal, Refused, check_envelope
from proctor.services.listen.kinds import AgentJob, KindRunner
from proctor.services.listen.lease import Lease, Stop, keep
from proctor.services.listen.store_loop import StoreOnLoop

log = logging.getLogger(__name__)
# How soon to look again at a job whose dead owner's runner is still killing the agent (a TERM grace, ~2 s).
DRAIN_RETRY_S = 0.5
# A job still running this long after it started gets its running record (`proctor job` shows where it runs).
RUNNING_RECORD_AFTER_S = 0.1


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


_Admitted = tuple[Accepted | Refused, Claim | None]


@dataclass
class Listener:
    settings: Settings
    backend: QueueBackend
    trust: TrustStore
    host_key: Signer
    store: JobStore
    audit: AuditLog
    runners: dict[str, KindRunner]
    running: dict[str, Lease] = field(default_factory=dict)
    cancels: CancelFlags = field(default_factory=CancelFlags)  # pushed by the backend, verified when looked at
    confine: str = "auto"  # this host's configured confinement (proctor.mechanisms.config.load), the floor for requests
    _store_on_loop: StoreOnLoop | None = field(default=None, init=False, repr=False)

    @property
    def _kinds(self) -> frozenset[str]:
        return frozenset(self.runners)

    async def serve(self, stop: asyncio.Event) -> None:
        s = self.settings
        for lane, slots in s.lanes.items():
            await self.backend.ensure_lane(s.host, lane, slots=slots, ack_wait_s=s.ack_wait_s,
                                           max_deliver=s.max_deliver)
        await asyncio.to_thread(self.store.prune, time.time(), s.clock_skew_s)
        await self.backend.watch_cancels(s.host, self.cancels.push)
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

    def _db(self) -> StoreOnLoop:
        if self._store_on_loop is None or self._store_on_loop.store is not self.store:
            self._store_on_loop = StoreOnLoop(self.store)
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
            self.cancels.forget(key, checked.opened.digest)
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
        """The reason of a valid signed cancel request for this job's envelope, else None (`cancels.py`)."""
        return self.cancels.reason(key, accepted, trust=self.trust, host=self.settings.host)

    async def _audit(
        self, kind: str, payload: dict[str, Any], *, job_id: str | None = None, durable: bool = False
    ) -> None:
        """Append an audit row; `durable`: committed when this returns (`audit.record_row`)."""
        await record_row(self.audit, kind, payload, job_id=job_id, durable=durable)

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
        lease = Lease()
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
        signer = Requester(f"queue:{accepted.opened.kid}", accepted.privileged)
        job = AgentJob(job_id, d.delivery, accepted.request, lane, signer) if accepted.request else None
        work = asyncio.create_task(self.runners[kind].run(job, f["payload"], lease.get))
        keeper = asyncio.create_task(keep(
            lease, d, work, ack_wait_s=s.ack_wait_s, heartbeat_s=s.heartbeat_s, lease_margin=s.lease_margin,
            still_owner=lambda: self._db().read(functools.partial(self.store.op_still_owner, job_id, d.delivery)),
            requested=lambda: self._cancel_for(key, accepted)))
        try:
            result = await work
        finally:
            keeper.cancel()
            self.running.pop(job_id, None)
            self.cancels.forget(key, accepted.opened.digest)
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
