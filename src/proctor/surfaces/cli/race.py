"""`proctor race`: one task to several agents side by side, each its own job; print the race's JSON.

Owns the flags (those of run-agent a race shares, `--agent` repeated, `--attempts`, `--parallel`) and a line
on stderr as each job enters a phase, so all of them are seen while they run. Exit 0 when the first-ranked
job's verdict needs no person (`winner`), 1 otherwise, 130 when cancelled.
"""

from __future__ import annotations

import os
import sys
import time

import click
from pydantic import ValidationError

from proctor.contract import Code, RaceResult, RunAgentRequest, Status
from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.terminal import json_safe, visible
from proctor.services.race.race import DEFAULT_PARALLEL, Lane, race
from proctor.surfaces.cli.main import main
from proctor.surfaces.cli.run_agent import EXIT_CANCELLED, Interrupt, request_violations
from proctor.services.job.progress import NullProgress


def _emit(out: RaceResult, cancelled: bool = False) -> None:
    click.echo(json_safe(out.to_json()))
    if out.status is not Status.completed:
        click.echo(visible(f"proctor: race {out.race_id or '-'}: {out.code.value}: {out.summary}"), err=True)
    sys.exit(EXIT_CANCELLED if cancelled else 0 if out.winner else 1)


class RaceCommand(click.Command):
    """As run-agent's: a flag the race does not know is a refused race (JSON, exit 1), not usage text."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _emit(RaceResult(raceId="", status=Status.failed, code=Code.INVALID_REQUEST,
                             summary=f"invalid request: {exc.format_message()}"))
            raise  # not reached: _emit exits


@main.command("race", cls=RaceCommand)
@click.option("--agent", "agents", multiple=True, help="An adapter key; repeat it, once a run (two of the same "
              "agent are two attempts).")
@click.option("--attempts", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Runs of each --agent.")
@click.option("--task", help="The brief, as text.")
@click.option("--task-file", help="Read the brief from this file.")
@click.option("--repo", help="Path of the git repo to work on (made absolute).")
@click.option("--ticket", help="Ticket id, [A-Za-z0-9._-]+; part of each job's branch name.")
@click.option("--branch", help="Base ref (default: master, else main, else HEAD's branch).")
@click.option("--timeout", "timeout", type=str, help="Each agent's deadline in seconds (60-14400).")
@click.option("--validate-cmd", help="Shell command run in each worktree instead of autodetected tests.")
@click.option("--must-pass", "must_pass", multiple=True, help="A test id that must pass; repeatable.")
@click.option("--parallel", type=click.IntRange(1, 16), default=DEFAULT_PARALLEL, show_default=True,
              help="Jobs at once.")
@click.option("--config", "config_file", help="Config TOML (as run-agent's).")
@click.option("--targets", help="Race over the queue: comma-separated hosts whose listeners run the jobs (one "
              "signed run_agent job each, the hosts in turn); --repo is then a path on those hosts.")
@click.option("--lane", default="default", show_default=True, help="With --targets: the hosts' lane.")
@click.option("--key", "key_name", default=None, help="With --targets: the signing key (default: the sender's).")
@click.option("--queue", "queue_url", help="With --targets: the queue's URL (default: config's, else local).")
@click.option("--wait", "wait_s", default=14_400 + 600, show_default=True, type=float,
              help="With --targets: seconds to wait for the results.")
def race_cmd(agents, attempts, task, task_file, repo, ticket, branch, timeout, validate_cmd, must_pass, parallel,
             config_file, targets, lane, key_name, queue_url, wait_s) -> None:
    """Give one task to several agents, each in its own job, and rank them by the host's verdicts; print the
    race as JSON: the ranking with its reasons and every job's result (each stays reviewable). With
    --targets, the jobs go to those hosts' listeners through the queue."""
    start = time.monotonic()
    interrupt = Interrupt(NullProgress())
    interrupt.install()

    def refused(code: Code, why: str) -> None:
        _emit(RaceResult(raceId="", status=Status.failed, code=code, summary=why,
                         durationSeconds=round(time.monotonic() - start, 3)))

    if (task is None) == (task_file is None):
        refused(Code.INVALID_REQUEST, "give --task or --task-file, one of them")
    if task_file is not None:
        try:
            with open(task_file, encoding="utf-8", newline="") as fh:
                task = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            refused(Code.TASK_UNREADABLE, f"task file {task_file!r} cannot be read: "
                    f"{getattr(exc, 'strerror', None) or exc}")
    if repo and not targets:
        repo = os.path.abspath(repo)
    raw = {"task": task, "repo": repo, "ticket": ticket, "branch": branch,
           "timeoutSec": timeout, "validateCommand": validate_cmd, "mustPass": list(must_pass) or None}
    requests = []
    for agent in [a for a in agents for _ in range(attempts)]:
        try:
            requests.append(RunAgentRequest.model_validate({k: v for k, v in {**raw, "agent": agent}.items()
                                                            if v is not None}))
        except ValidationError as exc:
            refused(Code.INVALID_REQUEST, "; ".join(request_violations(exc)))
    if targets:
        _emit(_over_queue(requests, targets, lane, key_name, queue_url, config_file, wait_s))
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        refused(Code.CONFIG_INVALID, "; ".join(exc.problems))

    def on_phase(lane: Lane, phase: str) -> None:
        click.echo(visible(f"[{lane.number} {lane.agent} {lane.job_id}] {phase}"), err=True)

    out = race(requests, parallel=parallel, config=config, on_phase=on_phase, cancel=interrupt.cancel)
    _emit(out, cancelled=interrupt.received is not None)


def _over_queue(requests: list[RunAgentRequest], targets: str, lane: str, key_name: str | None,
                queue_url: str | None, config_file: str | None, wait_s: float) -> RaceResult:
    import asyncio

    from proctor.mechanisms.queue import keys, sender
    from proctor.mechanisms.queue.sent import SentStore
    from proctor.services.race.fleet import race_over_queue
    from proctor.surfaces.cli.queue import _signer, _trust, connect, resolve_queue

    url = resolve_queue(queue_url, config_file)
    signer = _signer(key_name or keys.SENDER_KEY)

    async def go() -> RaceResult:
        backend = await connect(url, config_file)
        try:
            return await race_over_queue(backend, _trust(), requests, lane=lane, signer=signer, wait_s=wait_s,
                                         targets=[t.strip() for t in targets.split(",") if t.strip()],
                                         ttl_s=sender.DEFAULT_TTL_S, sent=SentStore())
        finally:
            await backend.close()

    return asyncio.run(go())
