"""`proctor serve`: the HTTP API (FastAPI + uvicorn) and the review page, on 127.0.0.1 unless told otherwise.

Served through `proctor.surfaces.api.guard.server_config`: only the bound names (and `--allow-host`) are answered, bodies
are capped before they are read, headers and bodies have deadlines, and open connections are capped. The
review page (proctor.surfaces.web) is at /review. Nothing is printed until it is true: the socket is bound and
listening first (a taken port is one line naming it, exit 2), and only then does the sign-in address go to
stderr, with a one-time code, never the token (measured before: with the port taken by another user's
server, the address and token were printed anyway, and the reviewer's browser sent them to her).
"""

from __future__ import annotations

import errno
import os
import socket

import click

from proctor.surfaces.cli.main import main
from proctor.surfaces.cli.queue import connect, fail, queue_option, resolve_queue
from proctor.mechanisms.queue.signers import TrustFileError, load_trust

BACKLOG = 2048  # as guard.server_config asks uvicorn for


def listen(bind: str, port: int) -> socket.socket:
    """A listening socket on bind:port, or a clear exit 2 naming what was asked for and why it failed."""
    try:
        infos = socket.getaddrinfo(bind or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        fail(f"cannot listen on {bind}:{port}: the address does not resolve ({exc.strerror})")
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only: a live listener still refuses
    try:
        if family == socket.AF_INET6 and bind in ("", "::"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        why = ("it is taken by another process (perhaps another user's)" if exc.errno == errno.EADDRINUSE
               else exc.strerror or str(exc))
        fail(f"cannot listen on {bind}:{port}: {why}; nothing was started (choose another with --port)")
    sock.set_inheritable(False)
    return sock


@main.command("serve")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free one, printed).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Another name clients use in Host (e.g. this machine's DNS name when binding 0.0.0.0); "
                   "127.0.0.1, localhost, [::1] and --bind are always allowed. Repeatable.")
@click.option("--no-queue", is_flag=True, help="Serve only the review page: no queue is started or reached, "
              "and the /v1 job routes answer 503 QUEUE_DISABLED.")
@queue_option
def serve_cmd(bind: str, port: int, allow_hosts: tuple[str, ...], no_queue: bool, queue_url: str | None) -> None:
    """Accept signed job envelopes over HTTP (OpenAPI at /openapi.json) and serve the review page at /review."""
    import uvicorn

    from proctor.surfaces.api.app import create_app
    from proctor.surfaces.api.guard import HttpLimits, server_config
    from proctor.surfaces.web.access import Access, TokenError, load_token
    from proctor.surfaces.web.app import PREFIX, Site

    from proctor.mechanisms.config.load import ConfigError, load_config

    try:
        trust = load_trust()
        token = load_token()
        # Who may connect over loopback: the install's user, and the uids config names; never a job.
        peers = (os.geteuid(), *load_config().serve.allow_uids)
    except (TrustFileError, TokenError, ConfigError) as exc:
        fail(str(exc))
    url = None if no_queue else resolve_queue(queue_url)
    limits = HttpLimits()
    access = Access(token)
    app = create_app((lambda: connect(url)) if url else None, trust, bind=bind, allow_hosts=allow_hosts,
                     limits=limits, review=Site(access), read_token=token)
    sock = listen(bind, port)
    port = sock.getsockname()[1]
    shown = f"[{bind}]" if ":" in bind else ("127.0.0.1" if bind in ("", "0.0.0.0") else bind)
    click.echo(f"proctor: listening on {shown}:{port}", err=True)
    # The code is typed into the page, never put in the address: a URL opened the usual way sits in the
    # browser's command line, readable by every local user (proctor.surfaces.web.access).
    click.echo(f"proctor: review page: http://{shown}:{port}{PREFIX}/login  sign-in code: {access.new_code()} "
               "(type it into the page: one use, 15 minutes; after that, the token in $PROCTOR_HOME/review-token)",
               err=True)
    uvicorn.Server(server_config(app, bind, port, limits, peers=peers, timeout_graceful_shutdown=5)).run(sockets=[sock])
