"""`proctor mcp`: the MCP server on stdio (proctor.surfaces.mcp.server), for an MCP host such as Claude Code.

Owns the flags, the config check before serving (an unusable config is one line on stderr and exit 2,
before any frame), and turning SIGTERM or SIGINT into the server's orderly end: running jobs cancelled,
their end rows written, exit 0. stdout is the MCP wire from the first byte; every log line goes to stderr.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import click

from proctor.surfaces.cli.main import main
from proctor.mechanisms.terminal import visible


class Stop:
    """SIGTERM/SIGINT: cancel the running jobs (the host kills each tree and writes its end row), wait for
    them, exit 0. Done in the handler itself: the event loop cannot unwind while a worker thread is blocked
    reading the client's stdin, which stays open (measured: a KeyboardInterrupt hung the server)."""

    def __init__(self, jobs: Any) -> None:
        self.jobs = jobs
        self.received: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            return  # already stopping
        self.received = signal.Signals(signum).name
        cancelled = self.jobs.shutdown(f"the MCP server received {self.received}")
        logging.getLogger("proctor.mcp").warning("%s: cancelled %d running job(s)%s", self.received,
                                                 len(cancelled), ": " + ", ".join(cancelled) if cancelled else "")
        sys.stderr.flush()
        os._exit(0)


@main.command("mcp")
@click.option("--config", "config_file", help="Config TOML for the jobs (else $PROCTOR_CONFIG, else "
                                              "$PROCTOR_HOME/config.toml); read again by every run_agent.")
@click.option("--max-jobs", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Jobs this server runs at once; run_agent refuses more (TOO_MANY_JOBS).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Of the log lines on stderr.")
@click.option("--allow-verb", "verbs", multiple=True, type=click.Choice(["land", "discard"]),
              help="Offer this review verb to the client (repeatable). Off by default: the model that asked for "
                   "the work is not the one to land it. Each use is a ledger row naming the client.")
@click.option("--may-set-validate-command", is_flag=True,
              help="Let run_agent requests set validateCommand, holdout and a confine weaker than the config's, "
                   "as a signer with may_set_validate_command may (all RCE-equivalent on this host).")
def mcp_cmd(config_file: str | None, max_jobs: int, log_level: str, verbs: tuple[str, ...],
            may_set_validate_command: bool) -> None:
    """Serve MCP on stdio: run_agent, job_status, job_result, list_jobs, diff, cancel_job, check_task, decide
    (and land, discard when allowed). Running jobs are cancelled (and recorded) when the client disconnects
    or on SIGTERM."""
    from proctor.surfaces.mcp.server import Grants, Jobs, config_problem, serve

    logging.basicConfig(stream=sys.stderr, level=log_level.upper(),
                        format="proctor mcp: %(levelname)s %(name)s: %(message)s")
    problem = config_problem(config_file)
    if problem:
        click.echo(f"proctor: {visible(problem)}", err=True)
        sys.exit(2)
    jobs = Jobs(config_file, max_jobs)
    Stop(jobs).install()
    serve(jobs, Grants(frozenset(verbs), may_set_validate_command))
