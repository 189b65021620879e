"""Trusted signers: `$PROCTOR_HOME/signers.toml`, who may send which kinds, and whose results to believe.

Owns reading the trust file into an immutable `TrustStore`. It never verifies a signature itself (envelope
does) and never writes the file: trust is granted by a person editing it.

    [signers.lead-laptop]              # a job signer, looked up by the key id its envelopes carry
    public_key = "ed25519:<b64>"       # or: hmac_key = "fleet" (a shared secret in keys/fleet.key)
    kinds = ["run_agent", "noop"]
    may_set_validate_command = false   # validateCommand is shell on the listener: RCE-equivalent; the same
                                       # privilege lets a request weaken `confine` below the listener's own
                                       # configured confinement (off < auto < required). A real bool only.

    [hosts.GAMINGPC]                   # a listener whose signed results a sender accepts
    public_key = "ed25519:<b64>"

A listener's own `host` key, when present in the same PROCTOR_HOME, is trusted for results of any host: one
home is one user, and that is the single-machine default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.home import proctor_home
from proctor.mechanisms.queue import keys
from proctor.mechanisms.queue.envelope import Ed25519Verifier, HmacKey, Verifier, b64d


class TrustFileError(Exception):
    """signers.toml is unreadable or malformed: an unusable configuration, exit 2 at the CLI."""


@dataclass(frozen=True)
class TrustedSigner:
    name: str
    verifier: Verifier
    kinds: frozenset[str]
    may_set_validate_command: bool = False


@dataclass(frozen=True)
class TrustStore:
    signers: dict[str, TrustedSigner] = field(default_factory=dict)  # by kid
    hosts: dict[str, Verifier] = field(default_factory=dict)  # by host name
    local_host: Verifier | None = None

    def signer(self, kid: Any) -> TrustedSigner | None:
        return self.signers.get(kid) if isinstance(kid, str) else None

    def result_verifier(self, host: str) -> Verifier | None:
        return self.hosts.get(host) or self.local_host


def _verifier(name: str, entry: dict[str, Any], home: Path) -> Verifier:
    pub, hmac_key = entry.get("public_key"), entry.get("hmac_key")
    if isinstance(pub, str) and pub.startswith("ed25519:"):
        try:
            return Ed25519Verifier.from_raw(b64d(pub.removeprefix("ed25519:")))
        except ValueError as exc:
            raise TrustFileError(f"{name}: public_key is not a valid ed25519 key: {exc}") from None
    if isinstance(hmac_key, str):
        try:
            key = keys.load(hmac_key, home)
        except keys.KeyFileError as exc:
            raise TrustFileError(f"{name}: {exc}") from None
        if not isinstance(key, HmacKey):
            raise TrustFileError(f"{name}: key {hmac_key!r} is not an hmac-sha256 key")
        return key
    raise TrustFileError(f'{name}: needs public_key = "ed25519:..." or hmac_key = "<key name under keys/>"')


def load_trust(home: Path | None = None) -> TrustStore:
    home = home or proctor_home()
    path = home / "signers.toml"
    try:
        doc = tomllib.loads(path.read_text()) if path.exists() else {}
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise TrustFileError(f"{path}: {exc}") from None
    signers: dict[str, TrustedSigner] = {}
    for table in ("signers", "hosts"):
        if not isinstance(doc.get(table) or {}, dict) or not all(
            isinstance(e, dict) for e in (doc.get(table) or {}).values()
        ):
            raise TrustFileError(f"{path}: [{table}] must be tables, one per name ([{table}.NAME])")
    for name, entry in (doc.get("signers") or {}).items():
        kinds = entry.get("kinds", [])
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise TrustFileError(f"signers.{name}: kinds must be a list of strings")
        may = entry.get("may_set_validate_command", False)
        if not isinstance(may, bool):
            raise TrustFileError(f"signers.{name}: may_set_validate_command must be true or false, not {may!r}")
        ver = _verifier(f"signers.{name}", entry, home)
        signers[ver.kid] = TrustedSigner(name, ver, frozenset(kinds), may)
    hosts = {name: _verifier(f"hosts.{name}", entry, home) for name, entry in (doc.get("hosts") or {}).items()}
    local = None
    if keys.key_path(keys.HOST_KEY, home).exists():
        try:
            host_key = keys.load(keys.HOST_KEY, home)
        except keys.KeyFileError as exc:
            raise TrustFileError(str(exc)) from None
        local = host_key.verifier() if isinstance(host_key, keys.Ed25519Signer) else host_key
    return TrustStore(signers, hosts, local)
