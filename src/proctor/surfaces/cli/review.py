"""`proctor jobs|show|diff|land|discard|gc`: the review surface's thin commands (proctor.services.review).

Each parses its flags, calls one function of proctor.services.review and prints: JSON on stdout with `--json`, else
a table or summary for a person (rich, every value from a ledger row, a result or a patch passed through
proctor.mechanisms.terminal first: the agent shaped much of it). Exit 0 only when the verb did what was asked; 1 for
a refusal or failure, named by its stable code on one stderr line; 2 for unusable flags. Never a traceback.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from proctor.surfaces.cli.main import main
from proctor.mechanisms.ledger.store import Ledger
from proctor.services.race import pick as pick_mod
from proctor.services.race import races
from proctor.services.review import gc as gc_mod
from proctor.services.review import jobs as jobs_mod
from proctor.services.review import land as land_mod
from proctor.services.review.diff import Diff, diff
from proctor.services.review.outcome import Outcome
from proctor.mechanisms.terminal import json_safe, visible

SHOWN_TAIL_LINES = 25


def _unusable(message: str) -> NoReturn:
    click.echo(f"proctor: {visible(message)}", err=True)
    sys.exit(2)


def _emit(data: Any) -> None:
    click.echo(json_safe(json.dumps(data, indent=2, default=str)))


def _console() -> Console:
    # Piped, a table keeps one row a line (rich would wrap at 80 columns); values are escaped before rich.
    tty = sys.stdout.isatty()
    return Console(markup=False, emoji=False, highlight=False, soft_wrap=not tty, width=None if tty else 10_000)


def _open() -> Ledger:
    try:
        return Ledger.default()
    except Exception as exc:  # noqa: BLE001 - an unusable ledger is a clear message, not a traceback
        _unusable(f"the ledger cannot be opened: {exc}")


def _fail(verb: str, out: Outcome, as_json: bool) -> NoReturn:
    if as_json:
        _emit(out.to_dict())
    click.echo(f"proctor: {verb} refused ({out.code.value}): {visible(out.reason)}", err=True)
    sys.exit(1)


def _job(ledger: Ledger, ident: str, verb: str, as_json: bool) -> jobs_mod.Job:
    found = jobs_mod.find(ledger, ident)
    if isinstance(found, Outcome):
        jobs_mod.note(ledger, f"review.{verb}", {"ok": False, "job": ident, "code": found.code.value})
        _fail(verb, found, as_json)
    return found


def _warn(problem: str | None) -> None:
    if problem:
        click.echo(f"proctor: warning: {visible(problem)}", err=True)


def _cell(value: Any, missing: str = "") -> Text:
    return Text(visible(value) if value not in (None, "") else missing)


# -- jobs ----------------------------------------------------------------------------------------------

@main.command("jobs")
@click.option("--repo", help="Only jobs of this repo (a path).")
@click.option("--status", "statuses", multiple=True,
              help="Only jobs with this status (completed, failed, running, interrupted, ...) or review state "
                   "(open, landed, discarded); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def jobs_cmd(repo: str | None, statuses: tuple[str, ...], as_json: bool) -> None:
    """List run-agent jobs: a job that started and never ended is `running` while its host lives, else
    `interrupted`. `needs-review`: the result's needs_human_review (yes unless it completed, validated,
    changed something and raised no risk); the review state (landed, discarded) follows the status."""
    with _open() as ledger:
        found = jobs_mod.select(jobs_mod.load_jobs(ledger), repo=repo, statuses=statuses)
        _warn(jobs_mod.note(ledger, "review.jobs", {"ok": True, "repo": repo, "statuses": list(statuses),
                                                    "count": len(found)}))
    if as_json:
        _emit([j.to_dict() for j in found])
        return
    if not found:
        click.echo("no jobs")
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    # "needs-review", not "review?": `show` prints the review state (open, landed, discarded) as `state`.
    linked = any(j.race or j.continues for j in found)  # a race's jobs and a chain's, shown together
    for col in ("job", "repo", "ticket", "agent", "status", "code", "needs-review", "age", *(("with",) if linked else ())):
        table.add_column(col, no_wrap=True, overflow="fold")
    for j in found:
        status = j.status if j.state == "open" else f"{j.status}, {j.state}"
        review = {True: "yes", False: "no"}.get(j.needs_human_review, "?")  # type: ignore[arg-type]
        link = (f"in {j.race}" if j.race else "") + (f" after {j.continues}" if j.continues else "")
        table.add_row(_cell(j.job_id), _cell(j.repo), _cell(j.ticket), _cell(j.agent, "?"), _cell(status, "?"),
                      _cell(j.code), Text(review), Text(jobs_mod.age_text(j.age_s())),
                      *((_cell(link.strip()),) if linked else ()))
    _console().print(table)


# -- show ----------------------------------------------------------------------------------------------

@main.command("show")
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show_cmd(job: str, as_json: bool) -> None:
    """A job's result, validation output, risks, ledger rows and gate decisions."""
    with _open() as ledger:
        found = _job(ledger, job, "show", as_json)
        data = jobs_mod.show(ledger, found)
        _warn(jobs_mod.note(ledger, "review.show", {"ok": True, "jobId": found.job_id}, found.job_id))
    if as_json:
        _emit(data)
        return
    _print_show(data)


def _print_show(data: dict[str, Any]) -> None:
    con = _console()
    j = data["job"]
    needs = {True: "yes", False: "no"}.get(j.get("needs_human_review"), "?")  # type: ignore[arg-type]
    con.print(Text.assemble((visible(j["jobId"]), "bold"), f"  {visible(j['status'])} ({visible(j['code'])})  "
                            f"state: {visible(j['state'])}  needs-review: {needs}"))
    for key in ("repo", "ticket", "agent", "base", "branch", "commit", "worktreePath", "started", "ended"):
        if j.get(key) is not None:
            con.print(Text(f"  {key}: {visible(j[key])}"))
    result = data["result"] or {}
    if result.get("summary"):
        con.print(Text(f"  summary: {visible(result['summary'])}"))
    if result.get("changed_files"):
        con.print(Text(f"  changed: {visible(', '.join(result['changed_files']))}"))
    if data["result"] is None:
        con.print(Text("  (no result.json: the job is running, was interrupted, or ran before proctor kept one)"))
    con.print(Text("risks:", style="bold"))
    for r in data["risks"] or ["none"]:
        con.print(Text(f"  - {visible(r)}"))
    con.print(Text("validation:", style="bold"))
    for v in data["validation"] or [{"label": "none run"}]:
        took = f", {v['duration_s']} s" if v.get("duration_s") is not None else ""
        late = " (timed out)" if v.get("timed_out") else ""
        ended = _ended_as(v.get("exit_code"), j.get("code"))
        con.print(Text(f"  {visible(v.get('label'))} => {visible(ended)}{late}{took}"))
        tail = (v.get("output_tail") or "").splitlines()[-SHOWN_TAIL_LINES:]
        for line in tail:
            con.print(Text(f"    | {visible(line)}", style="dim"))
    if data["validation_log"]:
        con.print(Text(f"  full output: {visible(data['validation_log'])}"))
    con.print(Text("ledger:", style="bold"))
    for row in data["ledger"]:
        payload = {k: v for k, v in row["payload"].items() if k != "jobId"}
        con.print(Text(f"  {visible(row['ts'])} {visible(row['kind'])} "
                       f"{visible(json.dumps(payload, default=str))[:300]}"))
    con.print(Text(f"gate decisions: {len(data['gate'])}", style="bold"))
    for row in data["gate"]:
        p = row["payload"]
        con.print(Text(f"  {visible(row['kind'])}: {visible(p.get('verdict') or p.get('allowed'))} "
                       f"{visible(p.get('tool') or p.get('host') or '')} {visible(p.get('code') or '')} "
                       f"{visible(p.get('reason') or '')}"))


def _ended_as(exit_code: object, job_code: object) -> str:
    """A validation step's end as a person reads it: a negative exit is a signal (`exit -15` read as a
    failure code), and on a cancelled or stopped job that signal was proctor's own."""
    if not isinstance(exit_code, int) or exit_code >= 0:
        return f"exit {exit_code}"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = f"signal {-exit_code}"
    if job_code in ("CANCELLED", "STOPPED"):
        return f"{'cancelled' if job_code == 'CANCELLED' else 'stopped'} (killed by {name})"
    return f"killed by {name}"


# -- diff ----------------------------------------------------------------------------------------------

@main.command("diff")
@click.argument("job")
@click.option("--stat", "stat_only", is_flag=True, help="Only the diffstat.")
@click.option("--binary", is_flag=True, help="Binary patches (for git apply).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: base, commit, files, stat, patch.")
def diff_cmd(job: str, stat_only: bool, binary: bool, as_json: bool) -> None:
    """The job's commit against its base, from objects alone (nothing of the repo's or agent's runs).
    On a terminal every control character is shown escaped; piped, the patch is exact."""
    with _open() as ledger:
        found = _job(ledger, job, "diff", as_json)
        got = diff(found, binary=binary)
        ok = isinstance(got, Diff)
        _warn(jobs_mod.note(ledger, "review.diff", {"ok": ok, "jobId": found.job_id,
                                                    **({"code": got.code.value} if not ok else {})}, found.job_id))
    if isinstance(got, Outcome):
        _fail("diff", got, as_json)
    if as_json:
        _emit({"ok": True, "jobId": found.job_id, "base": got.base, "commit": got.commit, "files": got.files,
               "stat": got.stat, **({} if stat_only else {"patch": got.patch.decode("utf-8", "replace")})})
        return
    data = got.stat.encode() if stat_only else got.patch
    if not sys.stdout.isatty():
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    con = _console()
    for line in data.decode("utf-8", "replace").splitlines():
        # Tabs stay tabs (a patch's indentation); every other control character is escaped.
        shown = "\t".join(visible(part) for part in line.split("\t"))
        style = ("green" if line.startswith("+") and not line.startswith("+++") else
                 "red" if line.startswith("-") and not line.startswith("---") else
                 "cyan" if line.startswith("@@") else "bold" if line.startswith("diff ") else "")
        con.print(Text(shown, style=style))


# -- land ----------------------------------------------------------------------------------------------

@main.command("land")
@click.argument("job")
@click.option("--pick", help="For a race (JOB is its race-... id): the job of it to land (default: its winner).")
@click.option("--keep-rest", is_flag=True, help="For a race: keep its other jobs (default: discarded once the "
              "pick has landed).")
@click.option("--into", help="Target branch (default: the job's base branch).")
@click.option("--squash", is_flag=True, help="One commit on the target with the job's (merged) tree.")
@click.option("--merge", "merge_", is_flag=True, help="A merge commit, even where a fast-forward would do.")
@click.option("--ff-only", is_flag=True, help="Refuse unless the target can fast-forward to the job's commit.")
@click.option("--force", is_flag=True, help="Land a job whose validation did not pass (needs --reason).")
@click.option("--reason", default="", help="Why --force; recorded in the ledger.")
@click.option("--allow-trust-line", is_flag=True, help="Land a job that changes what runs or is obeyed outside the "
              "tests (git hooks, CI, agent instruction files, .proctor.toml): after reading it.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def land_cmd(job: str, pick: str | None, keep_rest: bool, into: str | None, squash: bool, merge_: bool,
             ff_only: bool, force: bool, reason: str, allow_trust_line: bool, as_json: bool) -> None:
    """Land a completed, validated job into a branch of its repo. Default: fast-forward when the target has
    not moved since the job's base, else a merge commit whose tree is validated again before the ref moves.
    JOB may be a race (`race-...`): its winner, or the job --pick names, lands and the rest are discarded."""
    if squash + merge_ + ff_only > 1:
        _unusable("give at most one of --squash, --merge, --ff-only")
    if reason and not force:
        _unusable("--reason goes with --force")
    mode: land_mod.Mode = "squash" if squash else "merge" if merge_ else "ff-only" if ff_only else "auto"
    if (pick or keep_rest) and not races.is_race_id(job):
        _unusable("--pick and --keep-rest go with a race's id (race-...)")
    with _open() as ledger:
        if races.is_race_id(job):
            out = pick_mod.land_race(ledger, job, pick, keep_rest=keep_rest, into=into, mode=mode, force=force,
                                     reason=reason, allow_trust_line=allow_trust_line)
        else:
            found = _job(ledger, job, "land", as_json)
            out = land_mod.land(ledger, found, into=into, mode=mode, force=force, reason=reason,
                                allow_trust_line=allow_trust_line)
    _warn(out.details.get("ledger_warning"))
    _warn(out.details.get("checkout_warning"))
    if as_json:
        _emit(out.to_dict())
    else:
        _print_revalidation(out)
        if out.ok:
            click.echo(visible(out.reason) + _land_tail(out))
            for gone in out.details.get("discarded") or []:
                click.echo(f"  discarded {visible(gone)} (the race's other job)")
            for kept in out.details.get("not_discarded") or []:
                click.echo(f"  kept {visible(kept)}")
    if not out.ok:
        click.echo(f"proctor: land refused ({out.code.value}): {visible(out.reason)}", err=True)
        sys.exit(1)


def _land_tail(out: Outcome) -> str:
    d = out.details
    bits = []
    rv = d.get("revalidation")
    if rv:
        bits.append("re-validated: " + ("; ".join(rv.get("tests_attempted") or []) or rv.get("reason") or "-"))
    if d.get("forced_past_revalidation"):
        bits.append(f"FORCED past a failed re-validation: {d['forced_past_revalidation']}")
    bits.append("main checkout updated" if d.get("checkout_updated") else "main checkout untouched")
    return "; " + visible("; ".join(bits))


def _print_revalidation(out: Outcome) -> None:
    attempts = out.details.get("revalidation_output") or []
    if out.ok or not attempts:
        return
    con = _console()
    for a in attempts:
        con.print(Text(f"{visible(a.get('label'))} => exit {visible(a.get('exit_code'))}"))
        for line in (a.get("output_tail") or "").splitlines()[-SHOWN_TAIL_LINES:]:
            con.print(Text(f"  | {visible(line)}", style="dim"))


# -- discard, gc -----------------------------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 1048576:.1f} MiB" if n >= 1048576 else f"{n / 1024:.1f} KiB"


@main.command("discard")
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def discard_cmd(job: str, as_json: bool) -> None:
    """Remove a job's worktree, its branch and its objects (its record in the ledger stays)."""
    with _open() as ledger:
        found = _job(ledger, job, "discard", as_json)
        out = gc_mod.discard(ledger, found)
    _warn(out.details.get("ledger_warning"))
    if not out.ok:
        _fail("discard", out, as_json)
    if as_json:
        _emit(out.to_dict())
        return
    freed = out.details["freed"]
    click.echo(f"{visible(out.reason)}: freed {_mib(freed['bytes'])}"
               + "".join(f"\n  removed {visible(p)}" for p in freed["paths"] + freed["registrations"])
               + "".join(f"\n  deleted branch {visible(b)}" for b in freed["branches"]))


def _gc_line(out: Outcome, dry_run: bool) -> str:
    """What gc did, with the age it used: a person who ran `gc` and saw nothing freed learns why."""
    d = out.details
    total = d.get("would_free_bytes", 0) if dry_run else d.get("freed_bytes", 0)
    age = d.get("older_than", "?")
    line = (f"{'would free' if dry_run else 'freed'} {_mib(total)} of {len(d.get('jobs', []))} job(s) that "
            f"ended more than {age} ago")
    kept = d.get("kept_younger") or 0
    if kept:
        line += f"; {kept} ended job(s) younger than {age} kept (--older-than 0 takes them too)"
    return line


@main.command("gc")
@click.option("--older-than", default=gc_mod.DEFAULT_AGE, show_default=True, help="Only jobs that ended this "
              "long ago (s, m, h, d, w; 0 for every ended job).")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed and how much it frees.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def gc_cmd(older_than: str, dry_run: bool, as_json: bool) -> None:
    """Remove the worktrees, branches, objects and leftover TMPDIRs of jobs that ended (or whose host
    died) more than --older-than ago: 7 days unless given."""
    age = gc_mod.parse_age(older_than)
    if age is None:
        _unusable(f"--older-than {older_than!r}: give a number with s, m, h, d or w (7d)")
    with _open() as ledger:
        out = gc_mod.gc(ledger, older_than_s=age, dry_run=dry_run)
    _warn(out.details.get("ledger_warning"))
    if as_json:
        _emit(out.to_dict())
    else:
        table = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("job", "status", "why", "frees", "paths"):
            table.add_column(col, no_wrap=True, overflow="fold")
        for j in out.details.get("jobs", []):
            table.add_row(_cell(j["jobId"]), _cell(j["status"]), _cell(j["why"]), Text(_mib(j["bytes"])),
                          _cell(", ".join(j["paths"] + [f"branch {b}" for b in j["branches"]])))
        if out.details.get("jobs"):
            _console().print(table)
        click.echo(_gc_line(out, dry_run))
    if not out.ok:
        click.echo(f"proctor: gc incomplete ({out.code.value}): {visible(out.reason)}", err=True)
        sys.exit(1)
