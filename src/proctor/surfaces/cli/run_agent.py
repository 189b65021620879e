"""`proctor run-agent`: parse flags into a RunAgentRequest, call the host, print the result JSON.

Owns the flags, their names in refusals (`--ticket is required`, never pydantic's field message), the
one human line on stderr beside the JSON, and turning SIGINT/SIGTERM into the host's `cancel`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, NoReturn

import click
from pydantic import ValidationError

from proctor.surfaces.cli.main import main
from proctor.mechanisms.config.load import ConfigError, load_config, plain_error
from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.services.job.record import refused
from proctor.services.review import auto
from proctor.services.job.run_agent import run_agent
from proctor.services.job.progress import NullProgress
from proctor.surfaces.cli.closing import closing
from proctor.surfaces.cli.progress import RichProgress, for_stderr
from proctor.mechanisms.terminal import json_safe

# 128 + SIGINT: what a shell reports for a command ended by Ctrl-C; scripts test for it.
EXIT_CANCELLED = 130

# Request fields (wire and Python names) as the flags a user typed.
FLAGS = {"agent": "--agent", "task": "--task", "repo": "--repo", "ticket": "--ticket", "branch": "--branch",
         "mode": "--mode", "timeoutSec": "--timeout", "timeout_sec": "--timeout", "validateCommand": "--validate-cmd",
         "validate_command": "--validate-cmd", "confine": "--confine", "taskDecl": "--task-decl",
         "task_decl": "--task-decl", "mustPass": "--must-pass", "must_pass": "--must-pass",
         "continues": "--continue"}
REQUIRED = {"task": "--task or --task-file"}


class Interrupt:
    """SIGINT/SIGTERM during a job, handed to the host as its `cancel`.

    The handler only records the signal: the host polls `cancel` every 0.1 s while the agent or validation
    runs and once more right before each spawn, kills the whole tree and ends the job `failed`/`CANCELLED`
    with its `job.end` row. Python's default SIGINT raised KeyboardInterrupt through the host instead: no
    JSON, click's `Aborted!`, the tree left to the next job's orphan sweep and the job `interrupted` in the
    ledger. The handler touches nothing else (no lock, no terminal): it runs between any two bytecodes.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, progress: RichProgress | NullProgress) -> None:
        self.progress = progress
        self.received: str | None = None
        self._said = False

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def cancel(self) -> str | None:
        if self.received is None:
            return None
        if not self._said:
            # Said from the host's poll (the main thread, outside any drawing), once.
            self._said = True
            self.progress.say(f"proctor: {self.received}: cancelling the job (killing its process tree)")
        return f"{self.received} received"


def request_violations(exc: ValidationError) -> list[str]:
    """pydantic's errors as one line each, naming the flag: `--ticket is required`, `--timeout 'soon' is
    not a finite number` (the request's own checks name its fields, `timeoutSec`, which no user typed)."""
    out = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        flag = FLAGS.get(field, field or "request")
        if err["type"] == "missing":
            out.append(f"invalid request: {REQUIRED.get(field, flag)} is required")
            continue
        what = plain_error(err)
        # "timeoutSec 'soon' is ..." -> "'soon' is ...": a field name the user never typed is dropped, the
        # flag already leads the line ("ticket ..." stays: it reads as the flag's own word).
        internal = next((name for name, f in FLAGS.items() if f == flag and name != flag.lstrip("-")
                         and what.startswith(f"{name} ")), None)
        out.append(f"invalid request: {flag}: {what.removeprefix(f'{internal} ') if internal else what}")
    return out


def human_line(result: RunAgentResult, interrupt: str | None) -> str | None:
    """The one line beside the JSON for a refusal or a cancel; None when the progress line said enough."""
    if interrupt and result.code is Code.CANCELLED:
        return f"proctor: cancelled ({interrupt}): job {result.job_id or '-'} ended failed (CANCELLED)"
    # A budget's denial is rate_limited, and refused all the same: nothing launched.
    if result.status in (Status.failed, Status.rate_limited) and not result.attempts:
        reasons = "; ".join(r.removeprefix("invalid request: ") for r in result.known_risks) or result.summary
        return f"proctor: refused ({result.code.value}): {reasons}"
    if interrupt:
        return (f"proctor: {interrupt} came after the job's last check; it ended on its own: "
                f"{result.status.value} ({result.code.value})")
    return None


def emit(result: RunAgentResult, progress: RichProgress | NullProgress | None = None,
         interrupt: str | None = None) -> NoReturn:
    progress = progress or NullProgress()
    progress.close()
    # JSON escapes C0 but pydantic writes C1 and bidi characters raw: the agent's summary reaches a terminal.
    click.echo(json_safe(result.to_json()))
    line = human_line(result, interrupt)
    if line:
        progress.say(line)
    else:
        for closing_line in closing(result):
            progress.say(closing_line)
    if interrupt and result.code is Code.CANCELLED:
        sys.exit(EXIT_CANCELLED)
    sys.exit(0 if result.status is Status.completed else 1)


class RequestCommand(click.Command):
    """A command whose flags are a request: a flag it does not know, or one without its value, is an invalid
    request like any other (a failed result JSON naming it, exit 1), not click's usage text and exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            emit(refused({"agent": _flag_value(args, "--agent")}, [f"invalid request: {exc.format_message()}"],
                         Code.INVALID_REQUEST, time.monotonic()))


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


@main.command("run-agent", cls=RequestCommand)
@click.option("--agent", help="Adapter key: codex, claude, gemini, grok, opencode, patch (applies the unified "
              "diff given as the task, offline), or one from config.")
@click.option("--task", help="The brief, as text (for --agent patch: a unified diff, as `git diff` prints).")
@click.option("--task-file", help="Read the brief from this file.")
@click.option("--repo", help="Path of the git repo to work on (made absolute).")
@click.option("--ticket", help="Ticket id, [A-Za-z0-9._-]+; part of the branch name.")
@click.option("--branch", help="Base ref (default: master, else main, else HEAD's branch).")
@click.option("--mode", default="build", show_default=True, help="Routing hint, recorded.")
@click.option("--timeout", "timeout", type=str, help="Agent deadline in seconds, clamped to 60-14400 (default 1200).")
@click.option("--validate-cmd", help="Shell command run in the worktree instead of autodetected tests.")
@click.option("--confine", type=click.Choice(["auto", "required", "off"]), help="Confinement policy (default: config's).")
@click.option("--config", "config_file", help="Config TOML (else $PROCTOR_CONFIG, else $PROCTOR_HOME/config.toml; "
              "$PROCTOR_HOME is ~/.proctor unless set).")
@click.option("--task-decl", "task_decl", help="A declared task (JSON, as check-task reads it) every tool call of "
                                               "the agent's CLI is decided against (default: derived from the job).")
@click.option("--must-pass", "must_pass", multiple=True, help="A test id (as its runner names it: "
              "tests/test_x.py::test_y) that must pass whatever the base did; repeatable.")
@click.option("--continue", "continues", metavar="JOB", help="A follow-up: start from JOB's tree with this "
              "--task as the new brief, judged against JOB's base (what the chain did as a whole); --agent, "
              "--repo and --ticket default to JOB's.")
def run_agent_cmd(agent, task, task_file, repo, ticket, branch, mode, timeout, validate_cmd, confine, config_file,
                  task_decl, must_pass, continues) -> None:
    """Have an agent do a task in a fresh worktree; print the v1 result JSON (exit 0 only if completed,
    130 when SIGINT or SIGTERM cancelled it)."""
    start = time.monotonic()
    # First: a signal from here on cancels the job, and one before it is launched launches nothing.
    interrupt = Interrupt(NullProgress())
    interrupt.install()
    if continues:  # the job continued gives what was not said: the same agent, repo and ticket
        agent, repo, ticket = _continued_defaults(continues, agent, repo, ticket)
    raw: dict = {"agent": agent, "repo": os.path.abspath(repo) if repo else repo, "ticket": ticket,
                 "branch": branch, "mode": mode, "validateCommand": validate_cmd, "confine": confine,
                 "continues": continues}
    if timeout is not None:
        raw["timeoutSec"] = timeout
    if must_pass:
        raw["mustPass"] = list(must_pass)
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
    if task_decl is not None:
        try:
            with open(task_decl, encoding="utf-8") as fh:
                raw["taskDecl"] = json.load(fh)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            emit(refused(raw, [f"invalid request: --task-decl {task_decl!r} cannot be read as JSON: {why}"],
                         Code.INVALID_REQUEST, start))
    try:
        # An absent flag is left out, not None: pydantic then says "missing", which names the flag.
        request = RunAgentRequest.model_validate({k: v for k, v in raw.items() if v is not None})
    except ValidationError as exc:
        emit(refused(raw, request_violations(exc), Code.INVALID_REQUEST, start))
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        emit(refused(raw, exc.problems, Code.CONFIG_INVALID, start))  # every problem a risk of its own
    interrupt.progress = progress = for_stderr()
    result = run_agent(request, config=config, progress=progress, cancel=interrupt.cancel)
    if interrupt.received is None:
        auto.after_job(request.repo, result, config)  # lands it only where the person's config says so
    emit(result, progress, interrupt.received)


def _continued_defaults(ident: str, agent: str | None, repo: str | None,
                        ticket: str | None) -> tuple[str | None, str | None, str | None]:
    """The agent, repo and ticket of the job `ident` names where the flags left them out; unchanged when it
    cannot be read (the host refuses the request then, saying why)."""
    from proctor.mechanisms.ledger.store import Ledger
    from proctor.services.review import jobs

    try:
        ledger = Ledger.default()
    except Exception:  # noqa: BLE001 - the host opens it again and refuses with the reason
        return agent, repo, ticket
    try:
        found = jobs.find(ledger, ident)
    finally:
        ledger.close()
    if not isinstance(found, jobs.Job):
        return agent, repo, ticket
    return agent or found.agent, repo or found.repo, ticket or found.ticket
