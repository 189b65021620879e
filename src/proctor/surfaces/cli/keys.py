"""`proctor keys`: the signing keys under $PROCTOR_HOME/keys, and the signers.toml entry that trusts each for
its role. It never prints a private half."""

from __future__ import annotations

import json
import socket
from typing import Any

import click

from proctor.home import ensure_home
from proctor.mechanisms.queue import keys
from proctor.mechanisms.queue.backend import check_name
from proctor.mechanisms.queue.envelope import ED25519, HMAC_SHA256
from proctor.surfaces.cli.main import main
from proctor.surfaces.cli.queue import fail


KNOWN_KINDS = ("run_agent", "noop")


@main.group("keys")
def keys_group() -> None:
    """Signing keys under $PROCTOR_HOME/keys (`default` signs jobs, `host` signs a listener's results)."""


def trust_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--role", type=click.Choice(keys.ROLES), default=None,
                     help="What the key is for: `sender` signs jobs, `host` signs a listener's results "
                          "(default: by its name, `default` or `host`; any other name prints both entries)."),
        click.option("--host", "host_name", default=None,
                     help="For a host key: the name its listener runs as (`proctor listen --host`); "
                          "default: this machine's hostname."),
        click.option("--kinds", default="run_agent", show_default=True,
                     help="For a sender key: the job kinds listeners should run (comma-separated)."),
    ]):
        f = opt(f)
    return f


@keys_group.command("generate")
@click.option("--name", default=keys.SENDER_KEY, show_default=True)
@click.option("--hmac", "use_hmac", is_flag=True, help="A shared HMAC-SHA256 secret instead of Ed25519.")
@click.option("--force", is_flag=True, help="Replace an existing key.")
@trust_options
def keys_generate(name, use_hmac, force, role, host_name, kinds) -> None:
    """Create a key; print its id and the signers.toml entry that trusts it for its role."""
    trust = _trust_args(name, role, host_name, kinds)  # before the key exists: a bad flag makes nothing
    try:
        info = keys.generate(name, alg=HMAC_SHA256 if use_hmac else ED25519, home=ensure_home(), overwrite=force)
    except keys.KeyFileError as exc:
        fail(str(exc))
    _show(info, *trust)


@keys_group.command("show")
@click.option("--name", default=keys.SENDER_KEY, show_default=True)
@trust_options
def keys_show(name, role, host_name, kinds) -> None:
    """Print a key's id, public key and the signers.toml entry for its role (never the private half)."""
    trust = _trust_args(name, role, host_name, kinds)
    try:
        info = keys.info(name)
    except keys.KeyFileError as exc:
        fail(str(exc))
    _show(info, *trust)


def _trust_args(name: str, role: str | None, host_name: str | None,
                kinds_spec: str) -> tuple[str | None, str, str, tuple[str, ...]]:
    role = role or keys.role_of(name)
    kinds = tuple(k.strip() for k in kinds_spec.split(",") if k.strip())
    if not kinds or any(k not in KNOWN_KINDS for k in kinds):
        fail(f"--kinds {kinds_spec!r}: each must be one of {', '.join(KNOWN_KINDS)}")
    # Senders look a result's key up by the host name their envelope targets: the listener's --host.
    host_from = "--host"
    if host_name is None:
        host_name = socket.gethostname().split(".")[0]
        host_from = "this machine's hostname (pass --host NAME if its listener runs under another name)"
    if role != keys.SENDER:
        try:
            check_name("host", host_name)
        except ValueError as exc:
            fail(f"{exc}; pass --host NAME, the name this key's listener runs as")
    return role, host_name, host_from, kinds


def _show(info: keys.KeyInfo, role: str | None, host_name: str, host_from: str, kinds: tuple[str, ...]) -> None:
    out: dict[str, Any] = {"name": info.name, "alg": info.alg, "kid": info.kid, "publicKey": info.public_key,
                           "role": role}
    if role != keys.SENDER:
        out.update(hostName=host_name, hostNameFrom=host_from)
    out["entries"] = info.trust_entries(role, host=host_name, kinds=kinds)
    out["signersToml"] = info.trust_toml(role, host=host_name, kinds=kinds)
    click.echo(json.dumps(out, indent=2))
