"""`proctor serve`: the HTTP API (FastAPI + uvicorn) on 127.0.0.1 unless told otherwise.

Served through `proctor.api.guard.server_config`: only the bound names (and `--allow-host`) are answered, bodies
are capped before they are read, headers and bodies have deadlines, and open connections are capped.
"""

from __future__ import annotations

import click

from proctor.cli import main
from proctor.cli.queue import connect, fail, queue_option, resolve_queue
from proctor.queue.signers import TrustFileError, load_trust


@main.command("serve")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=int)
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Another name clients use in Host (e.g. this machine's DNS name when binding 0.0.0.0); "
                   "127.0.0.1, localhost, [::1] and --bind are always allowed. Repeatable.")
@queue_option
def serve_cmd(bind: str, port: int, allow_hosts: tuple[str, ...], queue_url: str | None) -> None:
    """Accept signed job envelopes over HTTP; OpenAPI at /openapi.json."""
    import uvicorn

    from proctor.api.app import create_app
    from proctor.api.guard import HttpLimits, server_config

    url = resolve_queue(queue_url)
    try:
        trust = load_trust()
    except TrustFileError as exc:
        fail(str(exc))
    limits = HttpLimits()
    app = create_app(lambda: connect(url), trust, bind=bind, allow_hosts=allow_hosts, limits=limits)
    uvicorn.Server(server_config(app, bind, port, limits)).run()
