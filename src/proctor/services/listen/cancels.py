"""Cancel flags: the signed cancel requests the backend pushes (`proctor_cancel` KV), and which of them to honour.

Cancel flags are signed requests (`sender.cancel`): one is honoured only if it verifies with a trusted
signer's key, names this host, the job and its envelope digest, and comes from the job's own signer or one
allowed `may_set_validate_command`. Anything else on the server (an unsigned flag, a job record) is never
acted on. Owns the flags as pushed and the memo of each one's verdict; it never stops a run itself (the
listener cancels the run's lease with the reason given here).
"""

from __future__ import annotations

import logging

from proctor.mechanisms.queue.envelope import CANCEL_DOMAIN, EnvelopeError, unseal, verify
from proctor.mechanisms.queue.signers import TrustStore
from proctor.services.listen.checks import Accepted

log = logging.getLogger(__name__)


class CancelFlags:
    """The flags pushed so far (record key -> signed cancel request), each distinct flag verified once per
    envelope."""

    def __init__(self) -> None:
        self.flags: dict[str, str] = {}  # record key -> signed cancel request, pushed
        # (record key, envelope digest) -> (flag, reason or None): each distinct flag is verified once per envelope
        self._checked: dict[tuple[str, str], tuple[str, str | None]] = {}

    def push(self, key: str, flag: str) -> None:
        """The backend's `watch_cancels` callback."""
        self.flags[key] = flag

    def forget(self, key: str, digest: str) -> None:
        """The job under `key` ended or was refused: its flag and its verdict go."""
        self.flags.pop(key, None)
        self._checked.pop((key, digest), None)

    def reason(self, key: str, accepted: Accepted, *, trust: TrustStore, host: str) -> str | None:
        """The reason of a valid signed cancel request for this job's envelope, else None (see the module
        docstring). Checked once per distinct flag value."""
        flag = self.flags.get(key)
        if not flag:
            return None
        memo = (key, accepted.opened.digest)
        seen = self._checked.get(memo)
        if seen is not None and seen[0] == flag:
            return seen[1]
        reason = verify_cancel(flag, accepted, trust=trust, host=host)
        if reason is None:
            log.warning("job %s: ignoring a cancel flag that is not a valid signed request for its envelope", key)
        self._checked[memo] = (flag, reason)
        return reason


def verify_cancel(flag: str, accepted: Accepted, *, trust: TrustStore, host: str) -> str | None:
    """The reason `flag` gives when it is a cancel request `host` may honour for `accepted`'s envelope, else None."""
    env = unseal(flag.encode(errors="replace"))
    if isinstance(env, EnvelopeError):
        return None
    signer = trust.signer(env.claimed.get("signer"))
    opened = verify(env, signer.verifier if signer else None, CANCEL_DOMAIN)
    if isinstance(opened, EnvelopeError) or signer is None:
        return None
    c, f = opened.fields, accepted.fields
    if (c.get("kind") != "cancel" or c.get("target") != host or c.get("jobId") != f["jobId"]
            or c.get("envelope") != accepted.opened.digest):
        return None
    if opened.kid != accepted.opened.kid and not signer.may_set_validate_command:
        return None
    return str(c.get("reason") or "cancelled")[:1000]
