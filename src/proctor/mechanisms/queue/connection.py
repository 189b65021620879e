"""How this machine reaches the queue: which servers, over what (TLS), as whom (NKEY seed or the local token).

Owns turning `--queue` / `$PROCTOR_QUEUE` / `[queue]` of config.toml / the bundled server into a URL list and
the nats-py options that go with it: an SSL context that verifies the servers against `tls_ca` (with this
machine's client certificate when one is configured), the NKEY seed (`$PROCTOR_QUEUE_NKEY_SEED` over
`nkey_seed`), and, for this home's bundled server, the token only this user can read. It never connects
(jetstream.py does) and never starts a server but the bundled one (server.py).
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

from proctor.mechanisms.config.model import QueueSettings
from proctor.mechanisms.queue import server


class QueueConnectionError(Exception):
    """Settings that cannot make a connection (a tls:// URL without a CA, unreadable files)."""


def servers(explicit: str | None, settings: QueueSettings, home: Path) -> str:
    """The URL (comma-separated for a cluster) this command uses: explicit, else config, else bundled."""
    if explicit:
        return explicit
    if settings.servers:
        return ",".join(settings.servers)
    return server.ensure_local(home)


def tls_context(settings: QueueSettings) -> ssl.SSLContext:
    """Verifies the server's certificate and name against `tls_ca` only (not the system store: a fleet's CA
    is its own), and presents this machine's certificate when one is configured."""
    if not settings.tls_ca:
        raise QueueConnectionError("a tls:// queue needs [queue] tls_ca: the CA file that signed the servers' certificates")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(Path(settings.tls_ca).expanduser()))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.tls_cert:
        ctx.load_cert_chain(str(Path(settings.tls_cert).expanduser()),
                            str(Path(settings.tls_key).expanduser()) if settings.tls_key else None)
    return ctx


def options(url: str, settings: QueueSettings, home: Path) -> dict[str, Any]:
    """nats-py connect options for `url` under `settings`."""
    out: dict[str, Any] = {}
    if settings.tls_ca or any(u.strip().startswith("tls://") for u in url.split(",")):
        try:
            out["tls"] = tls_context(settings)
        except (OSError, ssl.SSLError) as exc:
            raise QueueConnectionError(f"the queue's TLS files cannot be used: {exc}") from None
    seed = os.environ.get("PROCTOR_QUEUE_NKEY_SEED") or settings.nkey_seed
    if seed:
        out["nkeys_seed"] = str(Path(seed).expanduser())
    token = server.local_token(home, url)
    if token:
        out["token"] = token
    return out
