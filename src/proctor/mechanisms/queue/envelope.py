"""Signed envelopes for jobs and results: canonical JSON, Ed25519 or HMAC-SHA256, key ids.

Owns the wire shape `{"v": 1, "alg", "body": b64, "sig": b64}` and the check that a signature covers the exact
body bytes. It never decides whether a signer is trusted for a kind, or whether a job is for this host: the
listener does, with `signers.TrustStore`.

Why the exact bytes: verifying a re-serialization would let two JSON texts that parse alike (duplicate keys,
number spellings) carry one signature. Fields are read only from the bytes that were verified.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from proctor.mechanisms.ledger.rows import canonical_json as ledger_canonical_json

ENVELOPE_VERSION = 1
JOB_DOMAIN = b"proctor/job/v1\n"
RESULT_DOMAIN = b"proctor/result/v1\n"
CANCEL_DOMAIN = b"proctor/cancel/v1\n"
ED25519 = "ed25519"
HMAC_SHA256 = "hmac-sha256"
# Wire bodies are small (a task brief plus metadata); a cap keeps a hostile message from costing a parse.
MAX_ENVELOPE_BYTES = 1_048_576
# The longest an envelope may live (expiresAt - issuedAt): the stream keeps no message longer than this (and
# an hour's slack), so an envelope for a host that never comes is not kept for ever (issue 41).
MAX_TTL_S = 7 * 24 * 3600


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: one byte string per value, so a sender can sign deterministically."""
    return ledger_canonical_json(obj).encode()


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def ed25519_kid(public_raw: bytes) -> str:
    return "ed25519:" + hashlib.sha256(public_raw).hexdigest()[:16]


def hmac_kid(secret: bytes) -> str:
    # Derived through a second hash with a label so the kid reveals nothing usable about the secret.
    return "hmac:" + hashlib.sha256(b"proctor/kid\n" + secret).hexdigest()[:16]


class Signer(Protocol):
    @property
    def kid(self) -> str: ...
    @property
    def alg(self) -> str: ...
    def sign(self, data: bytes) -> bytes: ...


class Verifier(Protocol):
    @property
    def kid(self) -> str: ...
    @property
    def alg(self) -> str: ...
    def verify(self, data: bytes, sig: bytes) -> bool: ...


@dataclass(frozen=True)
class Ed25519Signer:
    private: Ed25519PrivateKey

    @property
    def alg(self) -> str:
        return ED25519

    # Cached: every sealed job and result names the kid, and deriving it is a public-key export and a hash
    # (~6 us, measured, on each result a listener signs).
    @functools.cached_property
    def kid(self) -> str:
        return ed25519_kid(self.public_raw)

    @functools.cached_property
    def public_raw(self) -> bytes:
        return self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    def verifier(self) -> Ed25519Verifier:
        return Ed25519Verifier.from_raw(self.public_raw)


@dataclass(frozen=True)
class Ed25519Verifier:
    public: Ed25519PublicKey
    kid: str

    @classmethod
    def from_raw(cls, raw: bytes) -> Ed25519Verifier:
        return cls(Ed25519PublicKey.from_public_bytes(raw), ed25519_kid(raw))

    @property
    def alg(self) -> str:
        return ED25519

    def verify(self, data: bytes, sig: bytes) -> bool:
        try:
            self.public.verify(sig, data)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class HmacKey:
    """A shared secret signs and verifies: anyone who can verify can also forge, so trust it fleet-wide only."""

    secret: bytes

    @property
    def alg(self) -> str:
        return HMAC_SHA256

    @property
    def kid(self) -> str:
        return hmac_kid(self.secret)

    def sign(self, data: bytes) -> bytes:
        return hmac.new(self.secret, data, hashlib.sha256).digest()

    def verify(self, data: bytes, sig: bytes) -> bool:
        return hmac.compare_digest(self.sign(data), sig)


@dataclass(frozen=True)
class Sealed:
    """A signed envelope as it travels: the body bytes and the signature over domain + body."""

    alg: str
    body: bytes
    sig: bytes

    def to_wire(self) -> bytes:
        return canonical_json({"v": ENVELOPE_VERSION, "alg": self.alg, "body": b64e(self.body), "sig": b64e(self.sig)})

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.to_wire())


@dataclass(frozen=True)
class Opened:
    """An envelope whose signature checked out against `kid`; `fields` come from the verified bytes only."""

    kid: str
    fields: dict[str, Any]
    digest: str


@dataclass(frozen=True)
class Unsealed:
    """An envelope whose outer shape parsed; the signature is not checked yet (`claimed` is untrusted)."""

    alg: str
    body: bytes
    sig: bytes
    claimed: dict[str, Any]


@dataclass(frozen=True)
class EnvelopeError:
    """Why an envelope could not be read or verified. `code` is stable (see listener refusal codes)."""

    code: str
    reason: str


def seal(fields: dict[str, Any], signer: Signer, domain: bytes = JOB_DOMAIN) -> Sealed:
    body = canonical_json(fields)
    return Sealed(signer.alg, body, signer.sign(domain + body))


def unseal(raw: bytes | dict[str, Any]) -> Unsealed | EnvelopeError:
    """Parse the outer wire shape and the (still unverified) body. Never raises on hostile input."""
    try:
        if isinstance(raw, (bytes, bytearray)):
            if len(raw) > MAX_ENVELOPE_BYTES:
                return EnvelopeError("MALFORMED", f"envelope is {len(raw)} bytes, limit {MAX_ENVELOPE_BYTES}")
            outer = json.loads(raw)
        else:
            outer = raw
        if not isinstance(outer, dict) or outer.get("v") != ENVELOPE_VERSION:
            return EnvelopeError("MALFORMED", f"envelope must be an object with v={ENVELOPE_VERSION}")
        alg, body_b64, sig_b64 = outer.get("alg"), outer.get("body"), outer.get("sig")
        if alg not in (ED25519, HMAC_SHA256) or not isinstance(body_b64, str) or not isinstance(sig_b64, str):
            return EnvelopeError("MALFORMED", "envelope needs alg (ed25519|hmac-sha256), body and sig strings")
        body, sig = b64d(body_b64), b64d(sig_b64)
        claimed = json.loads(body)
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError) as exc:
        return EnvelopeError("MALFORMED", f"envelope is not valid JSON/base64: {exc}")
    if not isinstance(claimed, dict):
        return EnvelopeError("MALFORMED", "envelope body must be a JSON object")
    return Unsealed(alg, body, sig, claimed)


def envelope_digest(body: bytes) -> str:
    """What a result answers: sha256 of the exact signed body bytes (signer, nonce, kind, jobId, target, lane,
    expiry, payload). Two envelopes that differ in any signed field have different digests."""
    return hashlib.sha256(body).hexdigest()


def verify(env: Unsealed, verifier: Verifier | None, domain: bytes = JOB_DOMAIN) -> Opened | EnvelopeError:
    kid = env.claimed.get("signer")
    if verifier is None:
        return EnvelopeError("UNTRUSTED_SIGNER", f"signer {kid!r} is not a trusted key id")
    if verifier.alg != env.alg:
        return EnvelopeError("FORGED", f"envelope alg {env.alg} does not match key {verifier.kid} ({verifier.alg})")
    if not verifier.verify(domain + env.body, env.sig):
        return EnvelopeError("FORGED", f"signature does not verify with key {verifier.kid}")
    return Opened(verifier.kid, env.claimed, envelope_digest(env.body))


def new_job_id() -> str:
    return uuid.uuid4().hex


def job_fields(
    *,
    kind: str,
    target: str,
    lane: str,
    payload: dict[str, Any],
    signer_kid: str,
    ttl_s: float,
    job_id: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The body of a job envelope, per DESIGN §8 / issue 6: bound to one target, lane, kind and expiry (at most
    MAX_TTL_S after it was issued; a ValueError past it)."""
    if ttl_s > MAX_TTL_S:
        raise ValueError(f"an envelope lives at most {MAX_TTL_S // 3600} hours, not {ttl_s / 3600:.0f}")
    issued = int(now if now is not None else time.time())
    return {
        "v": ENVELOPE_VERSION,
        "kind": kind,
        "jobId": job_id or new_job_id(),
        "target": target,
        "lane": lane,
        "issuedAt": issued,
        "expiresAt": issued + max(1, int(ttl_s)),
        "nonce": secrets.token_urlsafe(16),
        "signer": signer_kid,
        "payload": payload,
    }
