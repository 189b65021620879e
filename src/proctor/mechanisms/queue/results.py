"""Signed results: what a listener sends back for a job, and the sender's check that its host really said it.

Owns the result body `{v, jobId, host, envelope, signer, issuedAt, startedAt, finishedAt, delivery, refusal,
result}` sealed under the result domain with the listener's host key. It never decides a job's outcome.

`envelope` is the digest of the exact job envelope the result answers (`envelope.envelope_digest`): a result
answers one envelope, not a job id. A sender checks it against the envelope it sent itself, and checks the
signature with the key of the host that envelope named, never a host read from a record on the server.
A result without `envelope` (from a listener older than this field) is unbound and is not accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from proctor.contract import RunAgentResult
from proctor.mechanisms.queue.envelope import (
    ENVELOPE_VERSION,
    RESULT_DOMAIN,
    EnvelopeError,
    Sealed,
    Signer,
    seal,
    unseal,
    verify,
)
from proctor.mechanisms.queue.signers import TrustStore


@dataclass(frozen=True)
class SignedResult:
    job_id: str
    host: str
    result: RunAgentResult
    refusal: str | None
    started_at: float | None
    finished_at: float
    delivery: int
    signer: str
    envelope: str | None = None


def seal_result(
    *,
    job_id: str,
    host: str,
    result: RunAgentResult,
    signer: Signer,
    envelope: str | None,
    refusal: str | None = None,
    started_at: float | None = None,
    delivery: int = 0,
) -> Sealed:
    now = time.time()
    fields: dict[str, Any] = {
        "v": ENVELOPE_VERSION,
        "jobId": job_id,
        "host": host,
        "envelope": envelope,
        "signer": signer.kid,
        "issuedAt": now,
        "startedAt": started_at,
        "finishedAt": now,
        "delivery": delivery,
        "refusal": refusal,
        "result": result.model_dump(mode="json", by_alias=True),
    }
    return seal(fields, signer, RESULT_DOMAIN)


def open_result(
    raw: bytes, trust: TrustStore, *, host: str, job_id: str, envelope: str | None
) -> SignedResult | EnvelopeError:
    """Verify a result against `host`'s trusted key and bind it to the envelope asked about: a valid result
    for another envelope (another job, or another envelope that reused this job id) or from another host is
    as wrong as a forged one. `host`, `job_id` and `envelope` must come from the sender's own envelope.

    `envelope=None` skips the binding (diagnostics only: such a result proves who signed it, not what it
    answers); every sender path passes the digest."""
    env = unseal(raw)
    if isinstance(env, EnvelopeError):
        return env
    opened = verify(env, trust.result_verifier(host), RESULT_DOMAIN)
    if isinstance(opened, EnvelopeError):
        return opened
    f = opened.fields
    if f.get("host") != host or f.get("jobId") != job_id:
        return EnvelopeError("MISMATCHED", f"result is for {f.get('host')}/{f.get('jobId')}, not {host}/{job_id}")
    if envelope is not None and f.get("envelope") != envelope:
        got = f.get("envelope")
        return EnvelopeError(
            "MISMATCHED" if got else "UNBOUND",
            f"result answers envelope {str(got)[:16]}..., not {envelope[:16]}... (another envelope with this job id)"
            if got else "result names no envelope digest (a listener older than result binding): not accepted",
        )
    try:
        result = RunAgentResult.model_validate(f.get("result"))
    except ValidationError as exc:
        return EnvelopeError("MALFORMED", f"result body is not a run_agent result: {exc.error_count()} errors")
    return SignedResult(
        job_id, host, result, f.get("refusal"), f.get("startedAt"), float(f.get("finishedAt") or 0.0),
        int(f.get("delivery") or 0), opened.kid, f.get("envelope"),
    )
