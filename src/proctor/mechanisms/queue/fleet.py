"""A fleet server's authorization: one NKEY user per host and per sender, each allowed only its own subjects,
and TLS for every client connection. Owns the permission blocks and the nats-server config that holds them.

    admin    creates the stream and buckets (`proctor listen` / `enqueue` with `manage`); everything
    host     its own lanes' consumers, its own `results`/`running` keys, reading KV, the cancel watch
             (jetstream.host_permissions): never a job's publish, another host's subjects or a cancel flag
    sender   publishing jobs (to the targets it is given, default every host), its job records and cancel
             flags, reading results; never a result or running record, never a consumer, never stream admin

Replies go to each identity's own inbox prefix (`_INBOX_<name>`), so no user reads another's replies.
Permissions narrow what a stolen seed does; they never replace the envelope and result signatures, which
listeners and senders check regardless. It never starts a server (server.py) or connects (jetstream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proctor.mechanisms.queue.backend import check_name
from proctor.mechanisms.queue.jetstream import BUCKETS, STREAM, SUBJECT_PREFIX, host_permissions

API = "$JS.API"
READ_KV = [f"{API}.INFO", *(f"{API}.STREAM.INFO.KV_{b}" for b in BUCKETS),
           *(f"{API}.STREAM.MSG.GET.KV_{b}" for b in BUCKETS), *(f"{API}.DIRECT.GET.KV_{b}.>" for b in BUCKETS)]


def inbox(name: str) -> str:
    return f"_INBOX_{check_name('host', name)}"


def sender_permissions(name: str, targets: list[str] | None = None) -> dict[str, Any]:
    """nats-server `permissions` for one sender's NKEY user (see the module docstring)."""
    jobs = [f"{SUBJECT_PREFIX}.{check_name('host', t)}.>" for t in targets] if targets else [f"{SUBJECT_PREFIX}.>"]
    # CONSUMER.INFO: whether a target's lane has a listener at all (the HTTP API takes no job for one without).
    publish = [f"{API}.STREAM.INFO.{STREAM}", f"{API}.CONSUMER.INFO.{STREAM}.*", *READ_KV, *jobs,
               "$KV.proctor_jobs.>", "$KV.proctor_cancel.>"]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [f"{inbox(name)}.>"]}}


@dataclass(frozen=True)
class Tls:
    """The server's certificate and key, and the CA that signed the clients' certificates (`verify`: a
    client must present one; without it, clients authenticate by NKEY alone, over TLS)."""

    cert_file: str
    key_file: str
    ca_file: str
    verify: bool = True


@dataclass
class Fleet:
    admin: str  # NKEY public keys (U...)
    hosts: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # name -> (public key, lanes)
    senders: dict[str, tuple[str, list[str] | None]] = field(default_factory=dict)  # name -> (key, targets)
    tls: Tls | None = None

    def server_config(self) -> dict[str, Any]:
        """The nats-server config (JSON is valid nats-server config syntax) for `-c`."""
        users: list[dict[str, Any]] = [{"nkey": self.admin}]
        users += [{"nkey": key, "permissions": host_permissions(name, lanes)}
                  for name, (key, lanes) in self.hosts.items()]
        users += [{"nkey": key, "permissions": sender_permissions(name, targets)}
                  for name, (key, targets) in self.senders.items()]
        out: dict[str, Any] = {"authorization": {"users": users}}
        if self.tls is not None:
            out["tls"] = {"cert_file": self.tls.cert_file, "key_file": self.tls.key_file,
                          "ca_file": self.tls.ca_file, "verify": self.tls.verify, "timeout": 2}
        return out
