"""Key files under `$PROCTOR_HOME/keys`: generate, load and describe signing keys.

Owns the on-disk form of a key (`<name>.key`, JSON, mode 0600) and its public description. It never decides
whom to trust: `signers.toml` does (see `signers.py`). By convention the sender's key is `default` and the
listener signs its results with `host`; the entry a key's description suggests follows that role: a sender's
key goes in a listener's `[signers.NAME]`, a host's in a sender's `[hosts.HOSTNAME]`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from proctor.home import proctor_home
from proctor.mechanisms.queue.envelope import ED25519, HMAC_SHA256, Ed25519Signer, HmacKey, b64d, b64e

SENDER_KEY = "default"
HOST_KEY = "host"
SENDER, HOST = "sender", "host"
ROLES = (SENDER, HOST)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def role_of(name: str) -> str | None:
    """A key's role by the convention its name follows; None for any other name (only a person knows)."""
    return {SENDER_KEY: SENDER, HOST_KEY: HOST}.get(name)


def _toml_key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name)


class KeyFileError(Exception):
    """A key file is missing or unreadable: an unusable call, turned into exit 2 at the CLI."""


def keys_dir(home: Path | None = None) -> Path:
    return (home or proctor_home()) / "keys"


def key_path(name: str, home: Path | None = None) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"key name {name!r} must be a plain file name")
    return keys_dir(home) / f"{name}.key"


@dataclass(frozen=True)
class KeyInfo:
    name: str
    alg: str
    kid: str
    public_key: str | None  # "ed25519:<b64>"; None for a shared secret, which has no public half

    def _key_line(self) -> str:
        return f'public_key = "{self.public_key}"' if self.public_key else f"hmac_key = {json.dumps(self.name)}"

    def signers_toml(self, kinds: tuple[str, ...] = ("run_agent",), may_set_validate_command: bool = False) -> str:
        """The entry a listener's signers.toml needs to run jobs this key signs (a sender's key)."""
        kinds_s = ", ".join(json.dumps(k) for k in kinds)
        return (
            f"[signers.{_toml_key(self.name)}]\n{self._key_line()}\nkinds = [{kinds_s}]\n"
            f"may_set_validate_command = {'true' if may_set_validate_command else 'false'}\n"
        )

    def hosts_toml(self, host: str) -> str:
        """The entry a sender's signers.toml needs to accept results this key signs for listener `host` (the
        name it runs as, `proctor listen --host`, which is what envelopes target). It lets the key sign no job."""
        return f"[hosts.{_toml_key(host)}]\n{self._key_line()}\n"

    def grants(self, role: str, host: str, kinds: tuple[str, ...] = ("run_agent",)) -> str:
        if role == HOST:
            also = (f" (the sender needs the same secret as keys/{self.name}.key)" if not self.public_key else "")
            return (f"in a sender's signers.toml: the sender accepts the results listener {host!r} signs with this "
                    f"key{also}; it does not let the key sign jobs")
        return (f"in a listener's signers.toml: the listener runs jobs this key signs, of kinds {list(kinds)}; "
                "it does not make anyone accept results signed by it")

    def trust_entries(self, role: str | None, *, host: str, kinds: tuple[str, ...] = ("run_agent",),
                      may_set_validate_command: bool = False) -> list[dict[str, str]]:
        """The signers.toml entry for this key's role, or both (labelled) when the role is not known."""
        out = []
        for r in ((role,) if role else ROLES):
            toml = self.hosts_toml(host) if r == HOST else self.signers_toml(kinds, may_set_validate_command)
            out.append({"role": r, "grants": self.grants(r, host, kinds), "toml": toml})
        return out

    def trust_toml(self, role: str | None, *, host: str, kinds: tuple[str, ...] = ("run_agent",),
                   may_set_validate_command: bool = False) -> str:
        """The text to paste. With the role unknown both entries are there, commented out, each under what it
        grants: pasted whole it grants nothing until a person uncomments the one they mean."""
        entries = self.trust_entries(role, host=host, kinds=kinds, may_set_validate_command=may_set_validate_command)
        if role:
            return entries[0]["toml"]
        parts = [f"# The role of key {self.name!r} is not known (pass --role {'|'.join(ROLES)}): uncomment ONE.\n"]
        for e in entries:
            body = "".join(f"# {line}\n" for line in e["toml"].splitlines())
            parts.append(f"#\n# As a {e['role']} key: {e['grants']}.\n{body}")
        return "".join(parts)


def generate(name: str, *, alg: str = ED25519, home: Path | None = None, overwrite: bool = False) -> KeyInfo:
    path = key_path(name, home)
    if path.exists() and not overwrite:
        raise KeyFileError(f"key {name!r} already exists at {path}; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if alg == ED25519:
        raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        doc = {"alg": ED25519, "private": b64e(raw)}
    elif alg == HMAC_SHA256:
        doc = {"alg": HMAC_SHA256, "secret": b64e(secrets.token_bytes(32))}
    else:
        raise KeyFileError(f"unknown key algorithm {alg!r}")
    # Opened with mode 0600 from the start: a key must never exist world-readable.
    # O_EXCL after an unlink: a leftover .tmp (or a link planted there) is never reused with its old mode.
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)
    return info(name, home)


def load(name: str, home: Path | None = None) -> Ed25519Signer | HmacKey:
    path = key_path(name, home)
    try:
        doc = json.loads(path.read_text())
        if doc["alg"] == ED25519:
            return Ed25519Signer(Ed25519PrivateKey.from_private_bytes(b64d(doc["private"])))
        if doc["alg"] == HMAC_SHA256:
            return HmacKey(b64d(doc["secret"]))
    except FileNotFoundError:
        raise KeyFileError(f"no key {name!r} at {path}; run `proctor keys generate --name {name}`") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"key file {path} is unreadable: {exc}") from None
    raise KeyFileError(f"key file {path} has unknown alg {doc.get('alg')!r}")


def load_or_generate(name: str, home: Path | None = None) -> Ed25519Signer | HmacKey:
    if not key_path(name, home).exists():
        generate(name, home=home)
    return load(name, home)


def describe(key: Ed25519Signer | HmacKey, name: str) -> KeyInfo:
    public = f"ed25519:{b64e(key.public_raw)}" if isinstance(key, Ed25519Signer) else None
    return KeyInfo(name, key.alg, key.kid, public)


def info(name: str, home: Path | None = None) -> KeyInfo:
    return describe(load(name, home), name)
