"""`proctor stop|resume|check-task|decide|ledger verify`: the policy half's thin commands.

Each parses its input, calls one function of stop/gate/ledger and prints JSON on stdout. Exit 0 when a
decision was reached (a refusal included), 2 with one line on stderr for unusable input, never a traceback.
`ledger verify` exits 1 when the ledger has problems, naming the first bad row.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
from pydantic import BaseModel, ValidationError

from proctor.cli import main
from proctor.home import proctor_home
from proctor.ledger import LEDGER_FILE, Ledger
from proctor.policy.gate import Gate, plan
from proctor.policy.stop import StopSwitch
from proctor.policy.task import AgentTask, ToolCall
from proctor.policy.trusted import Policy, PolicyError
from proctor.terminal import json_safe, visible


def _unusable(message: str) -> NoReturn:
    click.echo(f"proctor: {visible(message)}", err=True)
    sys.exit(2)


def _emit(data: Any) -> None:
    # ensure_ascii (the default) writes every non-ASCII character, C1 and bidi included, as \uXXXX;
    # json_safe keeps that true should the setting ever change.
    click.echo(json_safe(json.dumps(data, indent=2, sort_keys=False)))


def _load(path: str, model: type[BaseModel], what: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _unusable(f"{what} file {path!r} cannot be read: {getattr(exc, 'strerror', None) or exc}")
    try:
        data = json.loads(text)
    except ValueError as exc:
        _unusable(f"{what} file {path!r} is not valid JSON: {exc}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or what
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        _unusable(f"{what} file {path!r}: {loc}: {err['msg']}{more}")


def _policy() -> Policy:
    try:
        return Policy.load()
    except PolicyError as exc:
        _unusable(str(exc))


@main.command("stop")
@click.option("--reason", default="", help="Why; shown by every run it stops.")
def stop_cmd(reason: str) -> None:
    """Stop every run and refuse every decision until `proctor resume`."""
    switch = StopSwitch()
    try:
        switch.engage(reason)
    except OSError as exc:
        _unusable(f"cannot write the stop file {switch.path}: {exc.strerror}")
    _emit({"stopped": True, "reason": switch.reason(), "path": str(switch.path)})


@main.command("resume")
def resume_cmd() -> None:
    """Release the stop switch."""
    switch = StopSwitch()
    was = switch.reason()
    try:
        switch.release()
    except OSError as exc:
        _unusable(f"cannot remove the stop file {switch.path}: {exc.strerror}")
    _emit({"stopped": False, "was": was, "path": str(switch.path)})


@main.command("check-task")
@click.option("--task-file", required=True, help="The task as JSON.")
def check_task_cmd(task_file: str) -> None:
    """Print the task as proctor would run it: capped limits, each tool's standing. Nothing is run."""
    task = _load(task_file, AgentTask, "task")
    _emit(plan(task, _policy()).model_dump(mode="json"))


@main.command("decide")
@click.option("--task-file", required=True, help="The task as JSON.")
@click.option("--call-file", required=True, help="The call as JSON: {tool, arguments, paths, call_id}.")
@click.option("--live", is_flag=True, help="Decide as for a live run (outward calls `run`, not `dry_run`).")
def decide_cmd(task_file: str, call_file: str, live: bool) -> None:
    """Decide one call of a task with a fresh gate; exit 0 whatever the verdict."""
    task = _load(task_file, AgentTask, "task")
    call = _load(call_file, ToolCall, "call")
    _emit(Gate(task, policy=_policy(), dry_run=not live, stop=StopSwitch().reason).decide(call).to_dict())


@main.command("approve")
@click.argument("job")
@click.argument("call_id")
@click.option("--reason", default="", help="Why; recorded with the grant.")
def approve_cmd(job: str, call_id: str, reason: str) -> None:
    """Grant, once, a tool call the gate held for a person: the next run of the job's ticket that makes the
    same call (tool and input) has it run; the grant is used up there."""
    path = proctor_home() / LEDGER_FILE
    if not path.exists():
        _unusable(f"no ledger at {path}")
    with Ledger(path) as ledger:
        held = [r for r in ledger.rows(kind="gate.call", job_id=job)
                if r.payload.get("call_id") == call_id and r.payload.get("code") == "APPROVAL_REQUIRED"]
        if not held:
            _unusable(f"job {job!r} has no call {call_id!r} held for a person (see `proctor show {job}`)")
        p = held[-1].payload
        grant = {"jobId": job, "call_id": call_id, "ticket": p.get("ticket"), "repo": p.get("repo"),
                 "tool": p.get("tool"), "input_sha256": p.get("input_sha256"), "reason": reason,
                 "by": os.environ.get("USER") or str(os.getuid())}
        row = ledger.append("gate.grant", grant, job_id=job)
    _emit({"granted": True, "row": row, **grant})


@main.group("ledger")
def ledger_group() -> None:
    """The hash-chained ledger of jobs, decisions and breaker transitions."""


def _open_ledger() -> Ledger | None:
    path = proctor_home() / LEDGER_FILE
    if not path.exists():
        return None
    try:
        return Ledger(path)
    except Exception as exc:  # noqa: BLE001 - a damaged file is unusable input, not a traceback
        _unusable(f"ledger {path} cannot be opened: {exc}")


@ledger_group.command("verify")
def ledger_verify_cmd() -> None:
    """Check every row's hash and the chain; exit 1 naming the first bad row."""
    ledger = _open_ledger()
    if ledger is None:
        _emit({"ok": True, "rows": 0, "problems": [], "path": str(proctor_home() / LEDGER_FILE)})
        return
    with ledger:
        problems = ledger.verify()
        count = len(ledger.rows())
        _emit({"ok": not problems, "rows": count, "problems": problems, "path": str(ledger.path)})
    if problems:
        click.echo(f"proctor: ledger tampered: {visible(problems[0])}", err=True)
        sys.exit(1)
