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

from proctor.surfaces.cli.main import main
from proctor.home import proctor_home
from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger
from proctor.mechanisms.policy.gate import Gate
from proctor.mechanisms.policy.plan import plan
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask, ToolCall
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.mechanisms.terminal import json_safe, visible


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


# How much of a held call `proctor approve` shows: enough to judge a command or a small write; a longer
# input is cut and says how much was left out (its digest still names all of it).
SHOW_INPUT = 2000
SHOW_PATHS = 10
SHOW_FIELDS = 20
MIN_DIGEST = 12  # hex characters of `--digest` at least, as a short git commit id


@main.command("approve")
@click.argument("job")
@click.argument("call_id")
@click.option("--digest", default="", help="The held call's input digest as shown by `proctor approve JOB CALL` "
              f"(at least {MIN_DIGEST} hex characters): required to grant.")
@click.option("--reason", default="", help="Why; recorded with the grant.")
def approve_cmd(job: str, call_id: str, digest: str, reason: str) -> None:
    """Show a tool call the gate held for a person and, given its digest, grant it once: the next run of the
    job's ticket that makes the same call (tool and input) has it run; the grant is used up there.

    Without --digest nothing is granted: the call is printed (tool, paths, input; escaped and cut) with its
    digest, exit 1. With it, the grant names exactly the call that was shown."""
    path = proctor_home() / LEDGER_FILE
    if not path.exists():
        _unusable(f"no ledger at {path}")
    with Ledger(path) as ledger:
        held = _held(ledger, job, call_id)
        if not digest:
            for p in held:
                click.echo(_show_held(job, call_id, p))
            click.echo(f"proctor: nothing granted: to grant this call once, run `proctor approve {visible(job)} "
                       f"{visible(call_id)} --digest {held[-1].get('input_sha256')}`", err=True)
            sys.exit(1)
        p = _by_digest(held, digest)
        grant = {"jobId": job, "call_id": call_id, "ticket": p.get("ticket"), "repo": p.get("repo"),
                 "tool": p.get("tool"), "input_sha256": p.get("input_sha256"), "reason": reason,
                 "by": os.environ.get("USER") or str(os.getuid())}
        row = ledger.append("gate.grant", grant, job_id=job)
    _emit({"granted": True, "row": row, **grant})


def _held(ledger: Ledger, job: str, call_id: str) -> list[dict[str, Any]]:
    """The job's `gate.call` rows holding `call_id` for a person (one per distinct input), never one its
    CLI's own stream did not show (`gate.forged`: asked on the gate socket by another process)."""
    forged = {c for r in ledger.rows(kind="gate.forged", job_id=job) for c in r.payload.get("call_ids") or []}
    if call_id in forged:
        _unusable(f"job {job!r} call {call_id!r} was never made by the agent's CLI (its own output never showed "
                  "it: forged on the gate socket); it cannot be approved")
    rows = [r.payload for r in ledger.rows(kind="gate.call", job_id=job)
            if r.payload.get("call_id") == call_id and r.payload.get("code") == "APPROVAL_REQUIRED"]
    if not rows:
        _unusable(f"job {job!r} has no call {call_id!r} held for a person (see `proctor show {job}`)")
    return list({str(p.get("input_sha256")): p for p in rows}.values())


def _by_digest(held: list[dict[str, Any]], digest: str) -> dict[str, Any]:
    want = digest.strip().lower()
    if len(want) < MIN_DIGEST or any(c not in "0123456789abcdef" for c in want):
        _unusable(f"--digest must be at least {MIN_DIGEST} hex characters of the call's input digest")
    hits = [p for p in held if str(p.get("input_sha256", "")).startswith(want)]
    if len(hits) != 1:
        _unusable(f"--digest {want} does not name {'one' if hits else 'the'} held call (run without --digest to "
                  "see it and its digest)")
    return hits[0]


def _show_held(job: str, call_id: str, p: dict[str, Any]) -> str:
    """The held call as a person reads it: every field escaped (`visible`: no control or bidi character of
    the agent's reaches the terminal), the input cut at SHOW_INPUT characters."""
    shown = p.get("held") if isinstance(p.get("held"), dict) else {}
    lines = [(f"held call {visible(call_id)} of job {visible(job)} (ticket {visible(p.get('ticket'))}, "
              f"repo {visible(p.get('repo'))})"),
             f"  tool:     {visible(p.get('tool'))}",
             f"  reason:   {visible(p.get('reason'))}"]
    paths = [str(x) for x in shown.get("paths") or []]
    for x in paths[:SHOW_PATHS]:
        lines.append(f"  path:     {visible(x[:300])}")
    if len(paths) > SHOW_PATHS:
        lines.append(f"  path:     (+{len(paths) - SHOW_PATHS} more)")
    if "input" in shown:
        lines.extend(_show_input(str(shown["input"]), int(shown.get("input_chars") or 0)))
        lines.append(f"  worktree: {visible(shown.get('worktree'))} (the same place in the ticket's next worktree "
                     "matches)")
    else:
        lines.append("  input:    (not recorded: held before proctor kept held inputs; judge by the digest)")
    lines.append(f"  digest:   {visible(p.get('input_sha256'))}")
    return "\n".join(lines)


def _show_input(text: str, total: int) -> list[str]:
    """The input's fields one a line (`command`, `file_path`, `content` ...): strings as the tool gets them,
    escaped, not as JSON (whose own escapes `visible` would double); an input kept cut, as text."""
    try:
        args = json.loads(text)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        whole = "" if total <= len(text) else f" (the ledger kept {len(text)} of {total} characters)"
        return [f"  input:    {_cut(text)}{whole}"]
    keys = sorted(args)
    lines = []
    for k in keys[:SHOW_FIELDS]:
        v = args[k]
        lines.append(f"  {_cut(str(k)[:40]) + ':':<9} {_cut(v if isinstance(v, str) else json.dumps(v))}")
    if len(keys) > SHOW_FIELDS:
        lines.append(f"  (+{len(keys) - SHOW_FIELDS} more input fields)")
    return lines


def _cut(text: str) -> str:
    if len(text) <= SHOW_INPUT:
        return visible(text)
    return f"{visible(text[:SHOW_INPUT])} ... (cut: {SHOW_INPUT} of {len(text)} characters shown)"


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
