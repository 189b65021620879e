"""The checks a fetched job must pass before anything of it runs, in their documented order.

Verification, in order: signature over the exact bytes by a key in signers.toml; that signer trusted for the
kind; target is this host and lane is the lane it came on; not expired (nor issued in the future, past the
skew); nonce present (whether it was seen in another message is the store's claim, `listener.py`); the payload
a valid request; `validateCommand`, held-out test dirs, or a `confine` weaker than this listener's configured
confinement (off < auto < required), only from a signer allowed `may_set_validate_command` (all are
RCE-equivalent on this host). Nothing in a body is used before its signature has been verified.

Owns the refusal codes. It never
claims, runs or answers a job (listener.py does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from proctor.contract import RunAgentRequest, parse_request
from proctor.mechanisms.confine import CONFINE_ORDER
from proctor.mechanisms.queue.backend import valid_job_id
from proctor.mechanisms.queue.envelope import (MAX_TTL_S, EnvelopeError, Opened, Unsealed, envelope_digest, unseal,
                                             verify)
from proctor.mechanisms.queue.signers import TrustStore

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
    privileged: bool = False  # the signer may set validateCommand: its job may read what validation reads


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
    if exp - iat > MAX_TTL_S:
        return Refused(Refusal.MALFORMED, f"envelope lives {exp - iat:.0f} s, past the limit of {MAX_TTL_S} s", True, f)
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
    return Accepted(opened, f, parsed, signer.may_set_validate_command)
