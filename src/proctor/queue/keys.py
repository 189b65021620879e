"""Key files under `$PROCTOR_HOME/keys`: generate, load and describe signing keys.

Owns the on-disk form of a key (`<name>.key`, JSON, mode 0600) and its public description. It never decides
whom to trust: `signers.toml` does (see `signers.py`). By convention the sender's key is `default` and the
listener signs its results with `host`.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from proctor.home import proctor_home
from proctor.queue.envelope import ED25519, HMAC_SHA256, Ed25519Signer, HmacKey, b64d, b64e

SENDER_KEY = "default"
HOST_KEY = "host"


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

    def signers_toml(self, kinds: tuple[str, ...] = ("run_agent",), may_set_validate_command: bool = False) -> str:
        key_line = (
            f'public_key = "{self.public_key}"'
            if self.public_key
            else f'hmac_key = "{self.name}"'
        )
        kinds_s = ", ".join(f'"{k}"' for k in kinds)
        return (
            f"[signers.{self.name}]\n{key_line}\nkinds = [{kinds_s}]\n"
            f"may_set_validate_command = {'true' if may_set_validate_command else 'false'}\n"
        )


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
