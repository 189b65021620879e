"""`proctor run-request`: read a command request file, call `run_request`, print the result as JSON.

Exit status: 0 the command ran, exited 0 and wrote nothing undeclared; 1 it ran and did not (nonzero exit,
timeout, leftover processes, undeclared writes: the full result is printed); 2 refused or unusable (a JSON
with `code` and `message`); 3 the ledger or a dispatch file changed during the run (the full result, `ran`
true, the changed files in `tampered`), or the ledger's chain was broken before it (nothing ran). Never a
traceback.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn

import click

from proctor.surfaces.cli.main import main
from proctor.services.commands import (
    LedgerTamperedError,
    ProposalError,
    RequestCode,
    UndeclaredWritesError,
    run_request,
)
from proctor.services.commands.result import CommandResult
from proctor.mechanisms.terminal import json_safe, visible


def _refusal(code: RequestCode, message: str, status: int, raw: Any = None) -> NoReturn:
    body: dict[str, Any] = {"code": code.value, "message": message, "ran": False}
    if isinstance(raw, dict):
        body["agent"] = raw.get("agent")
        body["argv"] = raw.get("argv")
    click.echo(json_safe(json.dumps(body, indent=2)))
    sys.exit(status)


def _result(result: CommandResult) -> NoReturn:
    # pydantic writes DEL, C1 and bidi characters raw (the command's stdout is in the result): escaped here.
    click.echo(json_safe(result.to_json()))
    sys.exit(0 if result.ok else 1)


@main.command("run-request")
@click.option("--request-file", required=True, help="The command request, as JSON.")
@click.option("--project", required=True, help="The project (a git worktree's top level) it runs in.")
@click.option("--policy", "policy_file", help="Allowlist TOML (default: $PROCTOR_HOME/commands.toml).")
@click.option("--dry-run", is_flag=True, help="Run every check, but not the command; record nothing.")
@click.option("--confine", is_flag=True, help="Run under OS confinement (Landlock/bwrap), or refuse.")
@click.option("--timeout-cap", type=click.FloatRange(min=0, min_open=True), help="Lower the entry's timeout (s).")
def run_request_cmd(request_file, project, policy_file, dry_run, confine, timeout_cap) -> None:
    """Run one allowlisted command an agent asked for; print {agent, argv, exit, ..., ran} as JSON."""
    try:
        with open(request_file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except RecursionError:
        _refusal(RequestCode.REQUEST_UNREADABLE, f"request file {request_file!r} is nested too deeply to read", 2)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        _refusal(RequestCode.REQUEST_UNREADABLE, f"request file {request_file!r} cannot be read as JSON: {why}", 2)
    try:
        result = run_request(
            raw, project=os.path.abspath(project), policy=policy_file, dry_run=dry_run, confine=confine, timeout_cap=timeout_cap
        )
    except ProposalError as exc:
        _refusal(exc.code, exc.message, 2, raw)
    except UndeclaredWritesError as exc:
        _result(exc.result)
    except LedgerTamperedError as exc:
        if exc.result is not None:  # it ran: its full result, the tamper in `code` and `tampered`
            click.echo(json_safe(exc.result.to_json()))
            click.echo(f"proctor: {exc.code}: {visible(exc.message)}", err=True)
            sys.exit(3)
        _refusal(exc.code, exc.message, 3, raw)
    except Exception as exc:  # the edge: a bug or an OS error becomes a message, never a traceback
        _refusal(RequestCode.HOST_ERROR, f"{type(exc).__name__}: {exc}", 2, raw)
    _result(result)
