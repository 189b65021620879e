"""The sending side: sign and enqueue jobs, look them up, cancel them, wait for and verify their results.

Owns sender-side validation (a malformed run_agent payload dies here, with the same checks as `run-agent`)
and the sender's record of where each job went (`sent.SentStore`, in this home). It never runs a job and
never trusts an unverified result, nor a result for another envelope, nor anything the server's job record
says: a result is accepted only if it names this sender's own envelope digest and is signed by the host that
envelope named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proctor.contract import parse_request
from proctor.mechanisms.queue.backend import (
    QueueBackend,
    answer_key,
    check_name,
    message_id,
    record_key,
    valid_job_id,
)
from proctor.mechanisms.queue.envelope import (
    CANCEL_DOMAIN,
    ENVELOPE_VERSION,
    EnvelopeError,
    Sealed,
    Signer,
    job_fields,
    seal,
    unseal,
)
from proctor.mechanisms.queue.results import SignedResult, open_result
from proctor.mechanisms.queue.sent import SentJob, SentStore
from proctor.mechanisms.queue.signers import TrustStore

DEFAULT_TTL_S = 24 * 3600.0


@dataclass(frozen=True)
class Rejected:
    """The job was not enqueued; `errors` are one readable line each (exit 2 at the CLI, 422 over HTTP)."""

    errors: list[str]


QUEUED = "QUEUED"
DUPLICATE = "DUPLICATE"
DUPLICATE_JOB_ID = "DUPLICATE_JOB_ID"


@dataclass(frozen=True)
class Enqueued:
    """A job the queue holds. `code` DUPLICATE: this very envelope was already in the queue's dedupe window,
    so the server kept the first copy and queued nothing; its one result is still this envelope's answer."""

    job_id: str
    target: str
    lane: str
    kind: str
    digest: str = ""  # the envelope's (envelope.envelope_digest): what its result must name
    code: str = QUEUED
    accepted_at: float | None = None  # DUPLICATE: when the server's job record says the first copy came (a hint)

    @property
    def duplicate(self) -> bool:
        return self.code == DUPLICATE

    def notice(self) -> str | None:
        """The line a person reads for a duplicate; None for a job queued now."""
        if not self.duplicate:
            return None
        when = (f"at {datetime.fromtimestamp(self.accepted_at, UTC).isoformat(timespec='seconds')}"
                if self.accepted_at is not None else "earlier")
        return (f"{DUPLICATE}: job {self.job_id} was already accepted {when}; not queued again — wait for or "
                "fetch its result")


@dataclass(frozen=True)
class Refused:
    """Not enqueued, for a reason with a stable code (DUPLICATE_JOB_ID); one readable line."""

    code: str
    message: str


def validate_payload(kind: str, payload: Any) -> list[str]:
    if not isinstance(payload, dict):
        return ["payload must be a JSON object"]
    if kind == "run_agent":
        parsed = parse_request(payload)
        return parsed if isinstance(parsed, list) else []
    if kind == "noop":
        return []
    return [f"unknown kind {kind!r} (known: noop, run_agent)"]


def build(
    *, targets: list[str], kind: str, lane: str, payload: Any, signer: Signer, ttl_s: float = DEFAULT_TTL_S
) -> list[Sealed] | Rejected:
    errors = validate_payload(kind, payload)
    try:
        for t in targets:
            check_name("host", t)
        check_name("lane", lane)
    except ValueError as exc:
        errors.append(str(exc))
    if not targets:
        errors.append("at least one target host is required")
    if errors:
        return Rejected(errors)
    return [
        seal(job_fields(kind=kind, target=t, lane=lane, payload=payload, signer_kid=signer.kid, ttl_s=ttl_s), signer)
        for t in targets
    ]


async def publish(backend: QueueBackend, sealed: Sealed, *, sent: SentStore | None = None) -> Enqueued:
    """Record the envelope in this home's sent store (what `wait`, `job` and `cancel` trust later), then
    enqueue it and write the server's job record (a lookup hint for anyone, trusted by no one)."""
    job = SentJob.from_sealed(sealed)
    (sent or SentStore()).put(job)
    record = json.dumps({"jobId": job.job_id, "target": job.target, "lane": job.lane, "kind": job.kind,
                         "envelope": job.digest, "enqueuedAt": time.time(), "expiresAt": job.expires_at}).encode()
    # The job first, then the record: a job id must never be readable on the server before its job is in
    # the stream, so that anyone squatting on the id (a different envelope with it) comes later in the stream
    # and the listener can tell which envelope owns the id (store.JobStore).
    if await _publish(backend, job, sealed):
        # The first copy's record stays as it was: a second one would date the job from this re-send.
        return Enqueued(job.job_id, job.target, job.lane, job.kind, job.digest, DUPLICATE,
                        await _accepted_at(backend, job))
    await backend.put_job(job.job_id, record)
    return Enqueued(job.job_id, job.target, job.lane, job.kind, job.digest)


class PublishRefused(Exception):
    """The queue server refused this sender's publish (its NATS permissions): the reason is the server's."""


class QueueFull(Exception):
    """The queue is at its quota (the stream's bytes, or the target lane's waiting jobs: jetstream.STREAM_LIMITS):
    nothing was queued; it frees as jobs run or expire."""


REFUSAL_POLL_S = 0.05


async def _publish(backend: QueueBackend, job: SentJob, sealed: Sealed) -> bool:
    """`backend.publish`, except that a publish the server refuses ends at once with why. NATS answers a
    denied publish only with an asynchronous `-ERR 'Permissions Violation ...'` (the client's `last_error`);
    the JetStream publish itself would wait for an ack that never comes (measured: a generic timeout after
    6-8 s, then an asyncio warning from the abandoned request). A backend without `nc` (memory) is just
    awaited."""
    task = asyncio.ensure_future(backend.publish(job.target, job.lane, message_id(job.job_id, job.digest),
                                                 sealed.to_wire()))
    client = getattr(backend, "nc", None)
    before = getattr(client, "last_error", None)
    while client is not None and not task.done():
        await asyncio.wait({task}, timeout=REFUSAL_POLL_S)
        err = getattr(client, "last_error", None)
        if err is not None and err is not before and "permissions violation" in str(err).lower():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise PublishRefused(
                f"the queue server refused to take job {job.job_id} for {job.target}/{job.lane}: "
                f"{str(err).removeprefix('nats: ')}; this sender's NATS user may not enqueue for {job.target} "
                "(the fleet's sender grants name the hosts each sender may reach)")
    try:
        return await task
    except Exception as exc:
        said = str(getattr(exc, "description", "") or "")
        if said.startswith("maximum") and "exceeded" in said:  # the stream's quota (discard new), not an outage
            raise QueueFull(f"the queue is full for {job.target}/{job.lane}: {said}; nothing was queued") from None
        raise


async def _accepted_at(backend: QueueBackend, job: SentJob) -> float | None:
    try:
        rec = await job_record(backend, job.job_id)
    except Exception:  # noqa: BLE001 - only the notice's time is lost; the duplicate stands
        return None
    when = rec.get("enqueuedAt") if rec and rec.get("envelope") == job.digest else None
    return float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None


def reused_id(sealed: Sealed, sent: SentStore | None = None) -> Refused | None:
    """Refused when this home already sent a *different* envelope under the same job id: queueing it would
    only get it refused by the listener (DUPLICATE_JOB_ID), and recording it would rebind the id here. The
    same envelope again is no reuse (publish reports it as DUPLICATE)."""
    job = SentJob.from_sealed(sealed)
    prior = (sent or SentStore()).get(job.job_id)
    if prior is None or prior.digest == job.digest:
        return None
    return Refused(DUPLICATE_JOB_ID, f"job id {job.job_id} was already used by another envelope sent from this "
                                     f"home (envelope {prior.digest[:16]}, for {prior.target}); not queued — sign "
                                     "a new job")


def resend_problems(sealed: Sealed) -> list[str]:
    """What stops a signed envelope from being queued as it is (`enqueue --envelope-file`): the checks
    `build` makes on a job it signs, and its expiry. Its signature is the listener's to judge."""
    try:
        f = json.loads(sealed.body)
    except ValueError:
        return ["the envelope's body is not JSON"]
    if not isinstance(f, dict):
        return ["the envelope's body is not a JSON object"]
    kind, target, lane = f.get("kind"), f.get("target"), f.get("lane")
    if not all(isinstance(x, str) for x in (kind, target, lane)) or not valid_job_id(f.get("jobId")):
        return ["the envelope needs string kind, target, lane and a jobId [A-Za-z0-9_-]"]
    problems = validate_payload(kind, f.get("payload"))
    for what, name in (("host", target), ("lane", lane)):
        try:
            check_name(what, name)
        except ValueError as exc:
            problems.append(str(exc))
    expires = f.get("expiresAt")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or expires < time.time():
        problems.append("the envelope has expired")
    return problems


JobRef = str | Enqueued | SentJob | Sealed


def _resolve(job: JobRef, sent: SentStore | None) -> SentJob | None:
    """The sender's own knowledge of a job: from the envelope in hand, else this home's sent store. Never
    from the server's job record."""
    if isinstance(job, SentJob):
        return job
    if isinstance(job, Sealed):
        return SentJob.from_sealed(job)
    if isinstance(job, Enqueued) and job.digest:
        return SentJob(job.job_id, job.target, job.lane, job.kind, job.digest, "", 0.0)
    job_id = job.job_id if isinstance(job, Enqueued) else job
    return (sent or SentStore()).get(job_id)


async def job_record(backend: QueueBackend, job_id: str) -> dict[str, Any] | None:
    """The server's record of a job: a hint for display (anyone reaching the server may rewrite it)."""
    if not valid_job_id(job_id):
        return None
    raw = await backend.get_job(job_id)
    if not raw:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return {"jobId": job_id, "recordError": "the server's job record is not JSON"}
    return rec if isinstance(rec, dict) else {"jobId": job_id, "recordError": "the job record is not an object"}


async def _answer(backend: QueueBackend, trust: TrustStore, mine: SentJob) -> SignedResult | EnvelopeError | None:
    """The verified answer to `mine`, if one is stored: at the owner's key or at this envelope's own key
    (where a listener answers an envelope that reused a known job id). A result there for another envelope,
    or signed by another host than `mine.target`, is an error, never the answer."""
    err: EnvelopeError | None = None
    for key in (record_key(mine.target, mine.job_id), answer_key(mine.target, mine.job_id, mine.digest)):
        raw = await backend.get_result(key)
        if raw is None:
            continue
        res = open_result(raw, trust, host=mine.target, job_id=mine.job_id, envelope=mine.digest)
        if not isinstance(res, EnvelopeError):
            return res
        err = err or res
    return err


async def status(
    backend: QueueBackend, trust: TrustStore, job_id: str, *, sent: SentStore | None = None
) -> dict[str, Any] | None:
    """What is known about a job: queued, running (where, since when) or done (its verified result).

    Target, lane, kind and envelope come from this home's record of what it sent; the server's job record
    only fills in a job sent from elsewhere, and then no result is shown as verified (nothing the sender
    itself knows binds it)."""
    mine = _resolve(job_id, sent) if valid_job_id(job_id) else None
    rec = await job_record(backend, job_id)
    if mine is None and rec is None:
        return None
    if mine is None:
        assert rec is not None
        out: dict[str, Any] = {"jobId": job_id, "target": str(rec.get("target")), "lane": str(rec.get("lane")),
                               "kind": str(rec.get("kind")), "state": "unknown", "verified": False,
                               "error": "UNBOUND: this job was not sent from this home; the server's record of "
                                        "it is a hint, so no result is verified against it", "record": rec}
        return out
    out = {"jobId": job_id, "target": mine.target, "lane": mine.lane, "kind": mine.kind, "envelope": mine.digest,
           "expiresAt": mine.expires_at, "state": "queued"}
    if rec is not None:
        out["enqueuedAt"] = rec.get("enqueuedAt")
        differs = [k for k, v in (("target", mine.target), ("lane", mine.lane), ("kind", mine.kind),
                                  ("envelope", mine.digest)) if k in rec and rec.get(k) != v]
        if differs:
            out["recordMismatch"] = {k: rec.get(k) for k in differs}  # someone rewrote the server's record
    key = record_key(mine.target, job_id)
    running = await backend.get_running(key)
    if running:
        try:
            out.update(state="running", running=json.loads(running))  # a hint: unsigned, for display
        except ValueError:
            pass
    res = await _answer(backend, trust, mine)
    if isinstance(res, SignedResult):
        out.update(state="done", **result_view(res))
    elif res is not None:
        out.update(result_view(res))  # something stored that is not this envelope's answer: never "done"
    cancel_flag = await backend.get_cancel(key)
    if cancel_flag:
        out["cancelRequested"] = cancel_reason_hint(cancel_flag)
    return out


def result_view(res: SignedResult | EnvelopeError) -> dict[str, Any]:
    if isinstance(res, EnvelopeError):
        return {"verified": False, "error": f"{res.code}: {res.reason}"}
    return {"verified": True, "signer": res.signer, "envelope": res.envelope, "refusal": res.refusal,
            "delivery": res.delivery, "result": res.result.model_dump(mode="json", by_alias=True)}


async def wait(
    backend: QueueBackend, trust: TrustStore, job: JobRef, timeout_s: float, *, sent: SentStore | None = None
) -> SignedResult | EnvelopeError | None:
    """Wait for the verified answer to the sender's own envelope (`job`: the envelope, its `Enqueued`, or a
    job id this home sent). A result that does not verify or answers another envelope is skipped, not taken:
    anyone reaching the server can write one, and the real answer may still come. At the deadline: the last
    such error, else None."""
    mine = _resolve(job, sent)
    if mine is None:
        job_id = job.job_id if isinstance(job, Enqueued) else job
        return EnvelopeError("UNKNOWN_JOB", f"no job {job_id} was sent from this home (its envelope is unknown, "
                                            "so no result can be bound to it)")
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + timeout_s, 0.005
    last: EnvelopeError | None = None
    while True:
        res = await _answer(backend, trust, mine)
        if isinstance(res, SignedResult):
            return res
        last = res or last
        if loop.time() >= deadline:
            return last
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(pause * 2, 0.2)


def cancel_reason_hint(flag: str) -> str:
    """The reason inside a cancel flag, for display (the listener verifies the signed request itself)."""
    opened = unseal(flag.encode())
    if isinstance(opened, EnvelopeError):
        return f"(unsigned, ignored by listeners) {flag[:200]}"
    return str(opened.claimed.get("reason", ""))


async def cancel(
    backend: QueueBackend, job_id: str, reason: str, *, signer: Signer, sent: SentStore | None = None
) -> bool:
    """Ask the job's host to cancel it with a request signed by `signer`. The listener honours it only from
    the signer that sent the job or one allowed `may_set_validate_command`, and only for the envelope named.
    Host and envelope come from this home's record; for a job sent elsewhere, from the server's record (a
    wrong hint there only sends a request that the wrong host ignores)."""
    mine = _resolve(job_id, sent) if valid_job_id(job_id) else None
    if mine is not None:
        target, digest = mine.target, mine.digest
    else:
        rec = await job_record(backend, job_id)
        if rec is None or not isinstance(rec.get("target"), str) or not isinstance(rec.get("envelope"), str):
            return False
        target, digest = rec["target"], rec["envelope"]
        try:
            check_name("host", target)
        except ValueError:
            return False
    fields = {"v": ENVELOPE_VERSION, "kind": "cancel", "jobId": job_id, "target": target, "envelope": digest,
              "reason": reason, "issuedAt": time.time(), "nonce": secrets.token_urlsafe(12), "signer": signer.kid}
    await backend.set_cancel(record_key(target, job_id), seal(fields, signer, CANCEL_DOMAIN).to_wire().decode())
    return True
