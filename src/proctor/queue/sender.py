"""The sending side: sign and enqueue jobs, look them up, cancel them, wait for and verify their results.

Owns sender-side validation (a malformed run_agent payload dies here, with the same checks as `run-agent`)
and the sender's record of where each job went. It never runs a job and never trusts an unverified result.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from proctor.contract import parse_request
from proctor.queue.backend import QueueBackend, check_name, record_key, valid_job_id
from proctor.queue.envelope import EnvelopeError, Sealed, Signer, job_fields, seal
from proctor.queue.results import SignedResult, open_result
from proctor.queue.signers import TrustStore

DEFAULT_TTL_S = 24 * 3600.0


@dataclass(frozen=True)
class Rejected:
    """The job was not enqueued; `errors` are one readable line each (exit 2 at the CLI, 422 over HTTP)."""

    errors: list[str]


@dataclass(frozen=True)
class Enqueued:
    job_id: str
    target: str
    lane: str
    kind: str


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


async def publish(backend: QueueBackend, sealed: Sealed) -> Enqueued:
    f = json.loads(sealed.body)
    record = json.dumps({"jobId": f["jobId"], "target": f["target"], "lane": f["lane"], "kind": f["kind"],
                         "enqueuedAt": time.time(), "expiresAt": f["expiresAt"]}).encode()
    # Both round trips at once, the job first: the record is for lookups (`proctor job`, HTTP) and the
    # listener never reads it, so it should not sit ahead of the job in the server's queue.
    await asyncio.gather(backend.publish(f["target"], f["lane"], f["jobId"], sealed.to_wire()),
                         backend.put_job(f["jobId"], record))
    return Enqueued(f["jobId"], f["target"], f["lane"], f["kind"])


async def job_record(backend: QueueBackend, job_id: str) -> dict[str, Any] | None:
    if not valid_job_id(job_id):
        return None
    raw = await backend.get_job(job_id)
    return json.loads(raw) if raw else None


async def status(backend: QueueBackend, trust: TrustStore, job_id: str) -> dict[str, Any] | None:
    """What is known about a job: queued, running (where, since when) or done (its verified result)."""
    rec = await job_record(backend, job_id)
    if rec is None:
        return None
    key = record_key(rec["target"], job_id)
    out: dict[str, Any] = {**rec, "state": "queued"}
    running = await backend.get_running(key)
    if running:
        out.update(state="running", running=json.loads(running))
    raw = await backend.get_result(key)
    if raw:
        res = open_result(raw, trust, host=rec["target"], job_id=job_id)
        out.update(state="done", **result_view(res))
    cancel = await backend.get_cancel(key)
    if cancel:
        out["cancelRequested"] = cancel
    return out


def result_view(res: SignedResult | EnvelopeError) -> dict[str, Any]:
    if isinstance(res, EnvelopeError):
        return {"verified": False, "error": f"{res.code}: {res.reason}"}
    return {"verified": True, "signer": res.signer, "refusal": res.refusal, "delivery": res.delivery,
            "result": res.result.model_dump(mode="json", by_alias=True)}


async def wait(
    backend: QueueBackend, trust: TrustStore, job_id: str, timeout_s: float
) -> SignedResult | EnvelopeError | None:
    rec = await job_record(backend, job_id)
    if rec is None:
        return EnvelopeError("UNKNOWN_JOB", f"no job {job_id} was enqueued on this queue")
    raw = await backend.wait_result(record_key(rec["target"], job_id), timeout_s)
    return None if raw is None else open_result(raw, trust, host=rec["target"], job_id=job_id)


async def cancel(backend: QueueBackend, job_id: str, reason: str) -> bool:
    rec = await job_record(backend, job_id)
    if rec is None:
        return False
    await backend.set_cancel(record_key(rec["target"], job_id), reason)
    return True
