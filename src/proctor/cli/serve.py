"""`proctor serve`: the HTTP API (FastAPI + uvicorn) and the review page, on 127.0.0.1 unless told otherwise.

Served through `proctor.api.guard.server_config`: only the bound names (and `--allow-host`) are answered, bodies
are capped before they are read, headers and bodies have deadlines, and open connections are capped. The
review page (proctor.web) is at /review; its sign-in address, with this install's token, goes to stderr
once, as the server starts (the token file stays 0600 in $PROCTOR_HOME).
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
@click.option("--no-queue", is_flag=True, help="Serve only the review page: no queue is started or reached, "
              "and the /v1 job routes answer 503 QUEUE_DISABLED.")
@queue_option
def serve_cmd(bind: str, port: int, allow_hosts: tuple[str, ...], no_queue: bool, queue_url: str | None) -> None:
    """Accept signed job envelopes over HTTP (OpenAPI at /openapi.json) and serve the review page at /review."""
    import uvicorn

    from proctor.api.app import create_app
    from proctor.api.guard import HttpLimits, server_config
    from proctor.web.access import Access, TokenError, load_token
    from proctor.web.app import PREFIX, Site

    try:
        trust = load_trust()
        token = load_token()
    except (TrustFileError, TokenError) as exc:
        fail(str(exc))
    url = None if no_queue else resolve_queue(queue_url)
    limits = HttpLimits()
    app = create_app((lambda: connect(url)) if url else None, trust, bind=bind, allow_hosts=allow_hosts,
                     limits=limits, review=Site(Access(token)))
    shown = f"[{bind}]" if ":" in bind else ("127.0.0.1" if bind in ("", "0.0.0.0") else bind)
    click.echo(f"proctor: review page: http://{shown}:{port}{PREFIX}/login?token={token}", err=True)
    uvicorn.Server(server_config(app, bind, port, limits, timeout_graceful_shutdown=5)).run()
