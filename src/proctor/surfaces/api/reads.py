"""Who may read a job through `/v1`: the job id is never a capability (it shows in `ps` and in the
`{repo}-agents` folder names; measured before: any local user read a whole signed result with it).

Owns the two credentials a `/v1` read accepts, checked before the job is looked up:

    Authorization: Bearer T      this install's token ($PROCTOR_HOME/review-token, 0600): its owner reads all
    Proctor-Signer: KID          a signed read request: the key that signed the job's envelope (the sender's
    Proctor-Date: UNIX-SECONDS   key, trusted in signers.toml) signs READ_DOMAIN + canonical JSON of
    Proctor-Signature: B64       {method, path, signer, ts}; only that job's own sender may read it, within
                                 READ_SKEW_S of the server's clock

A refusal is an `ApiError` 401 `UNAUTHENTICATED` (no credential, or one that does not verify) or 403
`NOT_YOUR_JOB` (a trusted key, but not the one that sent this job). It never decides what a job may do.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass

from proctor.mechanisms.queue.envelope import Signer as KeySigner
from proctor.mechanisms.queue.envelope import b64d, b64e, canonical_json
from proctor.mechanisms.queue.signers import TrustStore

READ_DOMAIN = b"proctor/read/v1\n"
READ_SKEW_S = 300.0
SIGNER, DATE, SIGNATURE = "proctor-signer", "proctor-date", "proctor-signature"


@dataclass(frozen=True)
class ReadRefusal:
    status: int
    code: str
    reason: str


def _message(method: str, path: str, signer: str, ts: int) -> bytes:
    return READ_DOMAIN + canonical_json({"method": method.upper(), "path": path, "signer": signer, "ts": ts})


def sign_read(key: KeySigner, method: str, path: str, now: float | None = None) -> dict[str, str]:
    """The headers of a signed read of `path` (the request's path, without the query) by `key`."""
    ts = int(time.time() if now is None else now)
    sig = key.sign(_message(method, path, key.kid, ts))
    return {SIGNER: key.kid, DATE: str(ts), SIGNATURE: b64e(sig)}


def check_read(headers: Mapping[str, str], method: str, path: str, *, sender: str | None, trust: TrustStore,
               token: str | None, now: float | None = None) -> ReadRefusal | None:
    """None when the request may read the job `sender` (its envelope's signer kid; None: not known here) sent."""
    auth = headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        if token and hmac.compare_digest(auth[7:].strip().encode(), token.encode()):
            return None
        return ReadRefusal(401, "UNAUTHENTICATED", "the bearer token is not this install's")
    kid, date, sig = headers.get(SIGNER), headers.get(DATE), headers.get(SIGNATURE)
    if not (kid and date and sig):
        return ReadRefusal(401, "UNAUTHENTICATED", "a /v1 read needs this install's token (Authorization: Bearer) "
                           f"or a read signed by the job's sender ({SIGNER}, {DATE}, {SIGNATURE})")
    signer = trust.signer(kid)
    if signer is None:
        return ReadRefusal(401, "UNAUTHENTICATED", "the read is signed by a key this server does not trust")
    try:
        ts, raw = int(date), b64d(sig)
    except ValueError:
        return ReadRefusal(401, "UNAUTHENTICATED", f"{DATE} must be unix seconds and {SIGNATURE} base64")
    clock = time.time() if now is None else now
    if abs(clock - ts) > READ_SKEW_S:
        return ReadRefusal(401, "UNAUTHENTICATED", f"the signed read is dated {ts}, more than {READ_SKEW_S:.0f} s "
                           f"from this server's clock ({clock:.0f})")
    if not signer.verifier.verify(_message(method, path, kid, ts), raw):
        return ReadRefusal(401, "UNAUTHENTICATED", f"the read's signature does not verify with key {kid}")
    if sender is None or not hmac.compare_digest(sender.encode(), kid.encode()):
        return ReadRefusal(403, "NOT_YOUR_JOB", "this job was not sent with the key that signed the read")
    return None
