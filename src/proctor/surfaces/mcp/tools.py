"""The tools: each one's name, description, argument schema and annotations, and calling one (`call_tool`).

    run_agent   start a job in a thread of this server (the host's `run_agent`), return its id at once
    race, race_result                one task to several agents, each its own job here; their ranking
    job_status  a job's state from the ledger (proctor.services.review.jobs), with its live phase while it runs here
    job_result  its result; optionally waits, sending `notifications/progress` (phase, last output line)
    list_jobs, diff                  the review reads (proctor.services.review), rows as the CLI writes them
    land, discard                    the review verbs: offered only when the server was started with
                                     `--allow-verb land|discard`, each a ledger row naming the MCP client
    cancel_job                       stop a job this server runs
    check_task, decide               the policy half (proctor.mechanisms.policy.gate), as `proctor check-task|decide` do

Progress goes out as notifications of the request that waits (`job_result` with a progress token): after
`run_agent` has answered, MCP allows no more notifications on its token. Nothing a tool does raises into the
protocol: an unexpected exception is `HOST_ERROR`, its traceback on stderr only. Blocking service calls run
in a worker thread, so the server keeps answering. It never calls a service itself (surface.py does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import types
from mcp.server.context import ServerRequestContext
from pydantic import BaseModel, ValidationError

from proctor.contract import Code as JobCode
from proctor.contract import RunAgentRequest, request_errors
from proctor.mechanisms.terminal import visible
from proctor.surfaces.mcp.arguments import (
    MAX_WAIT_S,
    CancelArgs,
    CheckTaskArgs,
    DecideArgs,
    DiffArgs,
    JobArgs,
    LandArgs,
    ListArgs,
    RaceArgs,
    RaceResultArgs,
    ResultArgs,
    bad_strings,
)
from proctor.surfaces.mcp.grants import VERBS, Grants
from proctor.surfaces.mcp.results import (
    CALL_INVALID,
    HOST_ERROR,
    INVALID_ARGUMENTS,
    TASK_INVALID,
    UNKNOWN_TOOL,
    Refusal,
    error_result,
    ok_result,
)
from proctor.surfaces.mcp.surface import Surface

log = logging.getLogger("proctor.mcp")

POLL_S = 0.1  # how often a waiting job_result looks at the job (and sends progress when it changed)

Ctx = ServerRequestContext[Any]


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    args: type[BaseModel]
    annotations: types.ToolAnnotations
    run: Callable[[Surface, Ctx, Any], Awaitable[dict[str, Any]]]

    def schema(self) -> dict[str, Any]:
        return self.args.model_json_schema(by_alias=True)


def _read_only(title: str) -> types.ToolAnnotations:
    return types.ToolAnnotations(title=title, read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                                 open_world_hint=False)


def _in_thread(method: Callable[[Surface, Any], dict[str, Any]]):
    """A blocking service call (git, SQLite, a re-validation) off the event loop: the server keeps answering."""

    async def run(surface: Surface, ctx: Ctx, args: Any) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(method, surface, args)

    return run


async def _run_agent(surface: Surface, ctx: Ctx, request: RunAgentRequest) -> dict[str, Any]:
    started = await anyio.to_thread.run_sync(surface.start, request)
    await ctx.session.report_progress(0, None, f"job {started['jobId']} started")
    return started


async def _job_status(surface: Surface, ctx: Ctx, args: JobArgs) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(surface.status, args.job)


async def _job_result(surface: Surface, ctx: Ctx, args: ResultArgs) -> dict[str, Any]:
    deadline = time.monotonic() + min(args.wait_s, MAX_WAIT_S)
    answer, live = await anyio.to_thread.run_sync(surface.result_now, args.job)
    sent, phases, updates = 0, 0, -1
    while not answer["done"] and time.monotonic() < deadline:
        if live is None:
            await anyio.sleep(1.0)  # a job another process runs: its end row is read from the ledger
            answer, live = await anyio.to_thread.run_sync(surface.result_now, args.job)
            continue
        ended = live.finished.is_set()  # before the look below, so the look sees the last phase too
        # Each phase once, then the phase's last output line whenever it changed (sampled every POLL_S).
        messages = [f"{name} ({at} s)" for name, at in live.progress.phases(phases)]
        phases += len(messages)
        snap = live.progress.snapshot()
        if snap["updates"] != updates and snap["lastLine"]:
            messages.append(f"{snap['phase']} ({snap['elapsedS']} s): {snap['lastLine']}")
        updates = snap["updates"]
        for message in messages:
            sent += 1
            await ctx.session.report_progress(sent, None, message)
        if ended:
            answer, live = await anyio.to_thread.run_sync(surface.result_now, args.job)
        else:
            await anyio.sleep(POLL_S)
    return answer


async def _race_result(surface: Surface, ctx: Ctx, args: RaceResultArgs) -> dict[str, Any]:
    deadline = time.monotonic() + min(args.wait_s, MAX_WAIT_S)
    answer = await anyio.to_thread.run_sync(surface.race_result, args.race)
    while not answer["done"] and time.monotonic() < deadline:
        await anyio.sleep(0.5)
        answer = await anyio.to_thread.run_sync(surface.race_result, args.race)
    return answer


def _validate_request(arguments: dict[str, Any]) -> RunAgentRequest:
    try:
        return RunAgentRequest.model_validate(arguments)
    except ValidationError as exc:
        lines = [r.removeprefix("invalid request: ") for r in request_errors(exc)]
        raise Refusal(JobCode.INVALID_REQUEST.value, "invalid request: " + "; ".join(lines)) from exc


TOOLS: dict[str, ToolDef] = {t.name: t for t in (
    ToolDef("run_agent", "Start a job: have an agent CLI (codex, claude, gemini, patch, ...) do a task in a fresh "
            "worktree of a git repo, confined; the host validates and judges the result. Returns the job id at "
            "once; follow it with job_status, or job_result with wait_s (progress notifications while it waits). "
            "The request is the run_agent v1 contract: agent, task, repo (absolute), ticket, and optional branch, "
            "mode, timeoutSec, validateCommand, confine, taskDecl, mustPass (test ids that must pass).",
            RunAgentRequest,
            types.ToolAnnotations(title="Start an agent job", read_only_hint=False, destructive_hint=False,
                                  idempotent_hint=False, open_world_hint=True),
            _run_agent),
    ToolDef("race", "Race agents on one task: each agent (or each attempt of one) does the same task in its own "
            "job, all started now, then ranked by the host's verdicts (accepted first; a job that passed the tests "
            "it saw and failed the held-out ones last). Returns the race id and its job ids at once; follow it "
            "with race_result (wait_s), each job with job_status or job_result.", RaceArgs,
            types.ToolAnnotations(title="Race agents", read_only_hint=False, destructive_hint=False,
                                  idempotent_hint=False, open_world_hint=True),
            _in_thread(Surface.race)),
    ToolDef("race_result", "A race's ranking once it ended (done: true): each job's place, tier and the reasons "
            "for it, and the winner; with wait_s, waits for the end first.", RaceResultArgs,
            _read_only("Race result"), _race_result),
    ToolDef("job_status", "A job's state: status (running, completed, failed, interrupted, ...), code, review "
            "state (open, landed, discarded), worktree, commit; while it runs in this server, its phase and last "
            "output line.", JobArgs, _read_only("Job status"), _job_status),
    ToolDef("job_result", "A job's result JSON (status, summary, changed_files, tests_attempted, known_risks, "
            "needs_human_review, ...) once it ended (done: true); with wait_s, waits for the end first.",
            ResultArgs, _read_only("Job result"), _job_result),
    ToolDef("list_jobs", "The jobs the ledger knows, oldest first, as `proctor jobs --json` lists them.",
            ListArgs, _read_only("List jobs"), _in_thread(Surface.list_jobs)),
    ToolDef("diff", "A job's commit against its base (files, stat, patch), computed from objects alone: nothing "
            "of the repo's or the agent's runs.", DiffArgs, _read_only("Job diff"), _in_thread(Surface.diff)),
    ToolDef("check_task", "A declared task as proctor would run it: limits capped by the trusted ceilings, each "
            "tool permitted / outward / needs-network. Runs nothing.", CheckTaskArgs,
            _read_only("Check a task"), _in_thread(Surface.check_task)),
    ToolDef("decide", "The gate's decision for one call of a declared task: run, dry_run or refused, with a code "
            "and a reason. Runs nothing.", DecideArgs, _read_only("Decide a call"), _in_thread(Surface.decide)),
    ToolDef("land", "Move a branch of the job's repo to a completed, validated job's work (fast-forward, merge or "
            "squash; re-validated when the target moved). Changes the main repo's branch and, when it is checked "
            "out and clean, its files.", LandArgs,
            types.ToolAnnotations(title="Land a job", read_only_hint=False, destructive_hint=True,
                                  idempotent_hint=True, open_world_hint=False),
            _in_thread(Surface.land)),
    ToolDef("cancel_job", "Stop a job this server is running: its whole process tree is killed and it ends "
            "as failed with code CANCELLED (its worktree stays for review).", CancelArgs,
            types.ToolAnnotations(title="Cancel a job", read_only_hint=False, destructive_hint=True,
                                  idempotent_hint=True, open_world_hint=False),
            _in_thread(Surface.cancel)),
    ToolDef("discard", "Remove a job's worktree, its branch and its objects (its ledger rows stay). Cannot be "
            "undone.", JobArgs,
            types.ToolAnnotations(title="Discard a job", read_only_hint=False, destructive_hint=True,
                                  idempotent_hint=True, open_world_hint=False),
            _in_thread(Surface.discard)),
)}


def _arguments_refusal(exc: ValidationError) -> Refusal:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    code = {"task": TASK_INVALID, "call": CALL_INVALID}.get(loc[0] if loc else "", INVALID_ARGUMENTS)
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return Refusal(code, f"{'.'.join(loc) or 'arguments'}: {err['msg']}{more}")


def client_name(ctx: Ctx) -> str:
    """The client's own `name version` from initialize (what it says of itself: a label, not a proof)."""
    try:
        info = ctx.session.client_params.client_info  # type: ignore[union-attr]
        return visible(f"{info.name} {info.version}", most=120)
    except AttributeError:
        return "?"


def offered(grants: Grants) -> list[ToolDef]:
    """The tools this server lists: the review verbs only when granted (a model is not shown what it may not do)."""
    return [t for t in TOOLS.values() if t.name not in VERBS or t.name in grants.verbs]


async def call_tool(surface: Surface, ctx: Ctx, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
    start = time.monotonic()
    tool = TOOLS.get(name)
    surface.client = client_name(ctx)
    try:
        if tool is None:
            raise Refusal(UNKNOWN_TOOL, f"no tool {name!r} here (tools: {', '.join(TOOLS)})")
        bad = bad_strings(arguments or {})
        if bad:  # before any model sees it: a NUL reaches a path or SQLite as a 500-class failure otherwise
            code = JobCode.INVALID_REQUEST.value if tool.args is RunAgentRequest else INVALID_ARGUMENTS
            raise Refusal(code, bad)
        if tool.args is RunAgentRequest:
            args: Any = _validate_request(arguments or {})
        else:
            try:
                args = tool.args.model_validate(arguments or {})
            except ValidationError as exc:
                raise _arguments_refusal(exc) from exc
        answer = ok_result(await tool.run(surface, ctx, args))
    except Refusal as refusal:
        answer = error_result(refusal.code, refusal.reason, **refusal.details)
    except Exception as exc:
        log.exception("tool %s failed", name)
        answer = error_result(HOST_ERROR, f"the {name} tool failed inside proctor: {type(exc).__name__}: {exc}")
    log.debug("tool %s: %s in %.3f s", name, "error" if answer.is_error else "ok", time.monotonic() - start)
    return answer
