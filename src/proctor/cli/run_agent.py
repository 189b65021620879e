"""`proctor run-agent`: parse flags into a RunAgentRequest, call the host, print the result JSON."""

from __future__ import annotations

import os
import sys
import time

import click

from proctor.cli import main
from proctor.config import ConfigError, load_config
from proctor.contract import Code, RunAgentResult, Status, parse_request
from proctor.job.host import refused, run_agent
from proctor.progress import for_stderr
from proctor.terminal import json_safe


def emit(result: RunAgentResult) -> None:
    # JSON escapes C0 but pydantic writes C1 and bidi characters raw: the agent's summary reaches a terminal.
    click.echo(json_safe(result.to_json()))
    sys.exit(0 if result.status is Status.completed else 1)


@main.command("run-agent")
@click.option("--agent", help="Adapter key: codex, claude, gemini, grok, opencode, patch, or one from config.")
@click.option("--task", help="The brief, as text.")
@click.option("--task-file", help="Read the brief from this file.")
@click.option("--repo", help="Path of the git repo to work on (made absolute).")
@click.option("--ticket", help="Ticket id, [A-Za-z0-9._-]+; part of the branch name.")
@click.option("--branch", help="Base ref (default: master, else main, else HEAD's branch).")
@click.option("--mode", default="build", show_default=True, help="Routing hint, recorded.")
@click.option("--timeout", "timeout", type=str, help="Agent deadline in seconds, clamped to 60-14400 (default 1200).")
@click.option("--validate-cmd", help="Shell command run in the worktree instead of autodetected tests.")
@click.option("--confine", type=click.Choice(["auto", "required", "off"]), help="Confinement policy (default: config's).")
@click.option("--config", "config_file", help="Config TOML (else $PROCTOR_CONFIG, else $PROCTOR_HOME/config.toml).")
def run_agent_cmd(agent, task, task_file, repo, ticket, branch, mode, timeout, validate_cmd, confine, config_file) -> None:
    """Have an agent do a task in a fresh worktree; print the v1 result JSON (exit 0 only if completed)."""
    start = time.monotonic()
    raw: dict = {"agent": agent, "repo": os.path.abspath(repo) if repo else repo, "ticket": ticket,
                 "branch": branch, "mode": mode, "validateCommand": validate_cmd, "confine": confine}
    if timeout is not None:
        raw["timeoutSec"] = timeout
    if task is not None and task_file is not None:
        emit(refused(raw, ["invalid request: give --task or --task-file, not both"], Code.INVALID_REQUEST, start))
    if task_file is not None:
        # Refused before any agent launches: an unreadable brief is never replaced by an empty one.
        try:
            # newline="": a patch for a CRLF file must reach the agent byte for byte.
            with open(task_file, encoding="utf-8", newline="") as fh:
                task = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            emit(refused(raw, [f"task file {task_file!r} cannot be read: {why}"], Code.TASK_UNREADABLE, start))
    raw["task"] = task
    request = parse_request({k: v for k, v in raw.items() if v is not None or k in ("agent", "task", "repo", "ticket")})
    if isinstance(request, list):
        emit(refused(raw, request, Code.INVALID_REQUEST, start))
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        emit(refused(raw, [str(exc)], Code.CONFIG_INVALID, start))
    emit(run_agent(request, config=config, progress=for_stderr()))
