"""`proctor serve`: the HTTP API (FastAPI + uvicorn) on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import click

from proctor.cli import main
from proctor.cli.queue import connect, fail, queue_option, resolve_queue
from proctor.queue.signers import TrustFileError, load_trust


@main.command("serve")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=int)
@queue_option
def serve_cmd(bind: str, port: int, queue_url: str | None) -> None:
    """Accept signed job envelopes over HTTP; OpenAPI at /openapi.json."""
    import uvicorn

    from proctor.api.app import create_app

    url = resolve_queue(queue_url)
    try:
        trust = load_trust()
    except TrustFileError as exc:
        fail(str(exc))
    uvicorn.run(create_app(lambda: connect(url), trust), host=bind, port=port, log_level="warning")
