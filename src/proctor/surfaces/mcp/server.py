"""The MCP surface: `proctor mcp`, an MCP server on stdio over the services the CLI uses (DESIGN.md 2, 9).

Owns the tools, their argument schemas and annotations, and mapping each service's outcome to an MCP tool
result: `structuredContent` is the JSON the CLI prints with `--json`, and a refusal is a tool error
(`isError`) whose text is `CODE: one sentence` and whose structured content is `{ok, code, reason, ...}`.
Nothing a tool does raises into the protocol: an unexpected exception is `HOST_ERROR`, its traceback on
stderr only.

    run_agent   start a job in a thread of this server (the host's `run_agent`), return its id at once
    job_status  a job's state from the ledger (proctor.services.review.jobs), with its live phase while it runs here
    job_result  its result; optionally waits, sending `notifications/progress` (phase, last output line)
    list_jobs, diff                  the review reads (proctor.services.review), rows as the CLI writes them
    land, discard                    the review verbs: offered only when the server was started with
                                     `--allow-verb land|discard`, each a ledger row naming the MCP client
    check_task, decide               the policy half (proctor.mechanisms.policy.gate), as `proctor check-task|decide` do

MCP gets no more than the queue: the client driving this server is often the model that asked for the work,
so a run_agent request is held to what a queue sender without `may_set_validate_command` may ask
(`validateCommand`, `holdout`, and a `confine` weaker than the config's are OVER_PRIVILEGED, the listener's
checks mirrored in `over_privileged`; measured before: `confine: "off"` ran unconfined under
`confine = "required"` and its validation read the host key) unless the server was started with
`--may-set-validate-command`; a `taskDecl` is validated here and capped by the trusted policy's ceilings in
the job's gate, as a queue job's is. No argument may hold a NUL or run past MAX_ARG_CHARS: a clear
INVALID_ARGUMENTS, never HOST_ERROR. Text a client reads is `terminal.json_safe` (bidi and controls escaped).

Progress goes out as notifications of the request that waits (`job_result` with a progress token): after
`run_agent` has answered, MCP allows no more notifications on its token. A job lives as long as the server
that started it: when the client goes (stdin closes) or the server is told to stop, every running job is
cancelled — its tree killed, its `job.end` row written (`CANCELLED`) — before the process exits.

stdout carries MCP frames only: fd 1 is pointed at stderr for the whole life of the process (stray prints,
child processes) and the frames go to a private duplicate of the original; fd 0 becomes /dev/null the same
way. It never decides anything itself: the host, the gate and the review verbs do.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Literal

import anyio
from mcp import types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proctor.mechanisms.config.load import Config, ConfigError, load_config
from proctor.contract import Code as JobCode
from proctor.contract import RunAgentRequest, RunAgentResult, Status, request_errors
from proctor.services.job.run_agent import new_job_id, run_agent
from proctor.mechanisms.process.local import Watch
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.gate import Gate, plan
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask, ToolCall
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.services.review import gc as gc_mod
from proctor.services.review import jobs as jobs_mod
from proctor.services.review import land as land_mod
from proctor.services.review.diff import Diff, diff
from proctor.services.review.outcome import Code as ReviewCode
from proctor.services.review.outcome import Outcome
from proctor.mechanisms.terminal import json_safe, visible

log = logging.getLogger("proctor.mcp")

SERVER_NAME = "proctor"
MAX_WAIT_S = 300.0  # job_result's longest wait; a client's request timeout is often not much longer
POLL_S = 0.1  # how often a waiting job_result looks at the job (and sends progress when it changed)
DEFAULT_MAX_JOBS = 4  # jobs running at once in one server: a model in a loop cannot start a hundred
SHUTDOWN_WAIT_S = 30.0  # for the cancelled jobs' trees to die and their end rows to be written
DIFF_MAX_BYTES = 1_000_000
LINE_CHARS = 200  # of a job's last output line, as progress shows it
MAX_ARG_CHARS = 200_000  # of any one string argument (a task brief is the longest); longer is refused
PATH_CHARS = 4096  # of a path argument (PATH_MAX)
VERBS = ("land", "discard")  # the review verbs a server may be started to offer (approve never is)
CONFINE_ORDER = {"off": 0, "auto": 1, "required": 2}  # as proctor.services.listen.listener orders them


class Refusal(Exception):
    """A tool's refusal: a stable code and one sentence (raised inside a tool, answered as a tool error)."""

    def __init__(self, code: str, reason: str, **details: Any) -> None:
        super().__init__(reason)
        self.code, self.reason, self.details = code, reason, details


# Codes of this surface, beside the review verbs' (proctor.services.review.outcome.Code) and the job's
# (proctor.contract.Code), which pass through unchanged. Additive only, never renamed.
INVALID_ARGUMENTS = "INVALID_ARGUMENTS"  # the arguments do not fit the tool's input schema
UNKNOWN_TOOL = "UNKNOWN_TOOL"
TASK_INVALID = "TASK_INVALID"  # check_task/decide: the task is not a valid declared task
CALL_INVALID = "CALL_INVALID"  # decide: the call is not {tool, arguments, paths, call_id}
POLICY_INVALID = "POLICY_INVALID"  # $PROCTOR_HOME/policy.toml cannot be used
TOO_MANY_JOBS = "TOO_MANY_JOBS"  # this server runs its limit of jobs already
SHUTTING_DOWN = "SHUTTING_DOWN"  # the server is stopping: no job starts
NOT_RUNNING_HERE = "NOT_RUNNING_HERE"  # cancel_job: no such job runs in this server
JOB_ENDED = "JOB_ENDED"  # cancel_job: the job has already ended
HOST_ERROR = "HOST_ERROR"  # a bug: proctor failed inside the tool (the traceback is on stderr)
VERB_NOT_ALLOWED = "VERB_NOT_ALLOWED"  # land/discard: the server was not started with --allow-verb for it
OVER_PRIVILEGED = "OVER_PRIVILEGED"  # run_agent asked for what only a trusted sender may (the queue's code)


@dataclass(frozen=True)
class Grants:
    """What the person who started `proctor mcp` lets its client do beyond reading and running jobs."""

    verbs: frozenset[str] = frozenset()  # of VERBS
    may_set_validate_command: bool = False  # as a signer's grant in signers.toml: validateCommand, holdout, confine


def over_privileged(request: RunAgentRequest, floor: str, grants: Grants) -> str | None:
    """Why `request` asks for more than an ungranted queue sender may (proctor.services.listen.listener's checks, in
    its order), or None. `floor`: the configured confinement."""
    if grants.may_set_validate_command:
        return None
    if request.validate_command is not None:
        return "this MCP server may not set validateCommand (shell on this host): start it with " \
               "--may-set-validate-command to allow it"
    if request.holdout:
        return "this MCP server may not name held-out test dirs (paths on this host): that needs " \
               "--may-set-validate-command"
    if request.confine is not None and CONFINE_ORDER.get(request.confine, 0) < CONFINE_ORDER.get(floor, 1):
        return f"this MCP server may not weaken confinement to {request.confine!r} (the config's is {floor!r}): " \
               "that needs --may-set-validate-command (RCE-equivalent)"
    return None


def bad_strings(value: Any, where: str = "arguments") -> str | None:
    """The first string in `value` holding a NUL or over MAX_ARG_CHARS, said as `where.field: why`."""
    if isinstance(value, str):
        if "\x00" in value:
            return f"{where} holds a NUL character"
        if len(value) > MAX_ARG_CHARS:
            return f"{where} is {len(value)} characters, over the limit of {MAX_ARG_CHARS}"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = bad_strings(k, where) or bad_strings(v, f"{where}.{k}" if where != "arguments" else str(k))
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = bad_strings(v, f"{where}[{i}]")
            if found:
                return found
    return None


def _sentence(text: str, most: int = 600) -> str:
    one = visible(" ".join(text.split()))
    return one if len(one) <= most else one[: most - 1] + "…"


def _plain(data: Any) -> Any:
    """JSON-serialisable for certain: paths, enums, datetimes become strings."""
    return json.loads(json.dumps(data, default=str))


def ok_result(data: dict[str, Any]) -> types.CallToolResult:
    data = _plain(data)
    text = json_safe(json.dumps(data, ensure_ascii=False))  # letters readable; bidi and controls escaped
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structured_content=data)


def error_result(code: str, reason: str, **details: Any) -> types.CallToolResult:
    reason = _sentence(reason)
    data = _plain({**details, "ok": False, "code": code, "reason": reason})
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"{code}: {reason}")],
                                structured_content=data, is_error=True)


# -- jobs this server runs -----------------------------------------------------------------------------

class JobProgress:
    """The host's `Progress` for one job run here: its phases, the last output line, whether it ended.

    Written by the job's thread, read by whichever tool call asks. Every phase is kept (a waiting
    `job_result` notifies each, a short one included); the output line only as it stands when looked at,
    and `updates` counts every change so a waiter notifies only when there is something new.
    """

    MAX_PHASES = 100

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._phases: list[tuple[str, float]] = []
        self._phase = "starting"
        self._last = ""
        self._updates = 0

    def _elapsed(self) -> float:
        return round(time.monotonic() - self._start, 1)

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase, self._last = name, ""
            if len(self._phases) < self.MAX_PHASES:
                self._phases.append((visible(name), self._elapsed()))
            self._updates += 1

    def _line(self, line: str) -> None:
        with self._lock:
            self._last = line[-LINE_CHARS:]
            self._updates += 1

    def watch(self, inner: Watch | None) -> Watch:
        def w(stream: str, chunk: bytes) -> str | None:
            lines = [ln for ln in chunk.decode("utf-8", "replace").splitlines() if ln.strip()]
            if lines:
                self._line(lines[-1])
            return inner(stream, chunk) if inner else None

        return w

    def done(self, result: RunAgentResult) -> None:
        self.phase(f"{result.status.value} ({result.code.value})")

    def say(self, line: str) -> None:
        log.info("%s", visible(line))
        self._line(line)

    def close(self) -> None:
        pass

    def phases(self, start: int = 0) -> list[tuple[str, float]]:
        """The phases from the `start`th on: (name, seconds since the job started)."""
        with self._lock:
            return self._phases[start:]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": visible(self._phase), "lastLine": visible(self._last), "elapsedS": self._elapsed(),
                    "updates": self._updates}


@dataclass
class LiveJob:
    job_id: str
    request: RunAgentRequest
    progress: JobProgress = field(default_factory=JobProgress)
    finished: threading.Event = field(default_factory=threading.Event)
    result: RunAgentResult | None = None
    cancelled: str | None = None  # why, once the server cancels it
    thread: threading.Thread | None = None

    def cancel(self) -> str | None:
        return self.cancelled

    def live(self) -> dict[str, Any]:
        return {**self.progress.snapshot(), "running": not self.finished.is_set()}


class Jobs:
    """The jobs this server started, each in a thread of its own running the host's `run_agent`."""

    def __init__(self, config_file: str | None = None, max_jobs: int = DEFAULT_MAX_JOBS) -> None:
        self.config_file = config_file
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._jobs: dict[str, LiveJob] = {}
        self._closing: str | None = None

    def get(self, job_id: str) -> LiveJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def by_prefix(self, ident: str) -> LiveJob | None:
        with self._lock:
            found = [j for i, j in self._jobs.items() if ident and i.startswith(ident)]
        return found[0] if len(found) == 1 else None

    def config(self) -> Config:
        return load_config(self.config_file)

    def start(self, request: RunAgentRequest, config: Config, admitted: Callable[[str], None]) -> LiveJob:
        """Start a job unless the server is closing or full; `admitted(job_id)` runs first (the ledger row:
        when it raises, nothing starts)."""
        job = LiveJob(new_job_id(), request)
        with self._lock:
            if self._closing:
                raise Refusal(SHUTTING_DOWN, f"the server is shutting down ({self._closing}): no job starts")
            busy = sum(1 for j in self._jobs.values() if not j.finished.is_set())
            if busy >= self.max_jobs:
                raise Refusal(TOO_MANY_JOBS, f"this server runs {busy} jobs already (its limit is "
                              f"{self.max_jobs}); wait for one with job_result")
            admitted(job.job_id)
            self._jobs[job.job_id] = job
        job.thread = threading.Thread(target=self._run, args=(job, config), name=f"job-{job.job_id}", daemon=True)
        job.thread.start()
        return job

    def _run(self, job: LiveJob, config: Config) -> None:
        try:
            job.result = run_agent(job.request, config=config, progress=job.progress, cancel=job.cancel,
                                   job_id=job.job_id)
        except BaseException as exc:
            log.exception("job %s: the host raised", job.job_id)
            job.result = RunAgentResult(status=Status.failed, summary=f"the host failed: {exc}",
                                        known_risks=[f"the host failed: {type(exc).__name__}: {exc}"],
                                        agent=job.request.agent, code=JobCode.HOST_ERROR, job_id=job.job_id)
        finally:
            job.finished.set()

    def shutdown(self, reason: str, wait_s: float = SHUTDOWN_WAIT_S) -> list[str]:
        """Cancel every running job (the host kills its tree and writes its end row) and wait for them;
        idempotent. Returns the ids of the jobs it cancelled."""
        with self._lock:
            self._closing = self._closing or reason
            jobs = [j for j in self._jobs.values() if not j.finished.is_set()]
        for job in jobs:
            job.cancelled = job.cancelled or reason
        deadline = time.monotonic() + wait_s
        for job in jobs:
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
            if not job.finished.is_set():
                log.warning("job %s did not end within %.0f s of its cancel", job.job_id, wait_s)
        return [j.job_id for j in jobs]


# -- arguments -----------------------------------------------------------------------------------------

class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobArgs(_Args):
    job: str = Field(min_length=1, max_length=200, description="A job id, or a unique prefix of one.")


class CancelArgs(JobArgs):
    reason: str = Field("cancelled over MCP", min_length=1, max_length=500, description="Why; in the result.")


class ResultArgs(JobArgs):
    wait_s: float = Field(0, ge=0, description=f"Wait up to this many seconds for the job to end (at most "
                          f"{MAX_WAIT_S:.0f}), sending progress notifications when the request has a progress token.")


class ListArgs(_Args):
    repo: str | None = Field(None, max_length=PATH_CHARS, description="Only jobs of this repo (a path).")
    status: list[str] = Field(default_factory=list, description="Only jobs with one of these statuses (completed, "
                              "failed, running, interrupted, ...) or review states (open, landed, discarded).")


class DiffArgs(JobArgs):
    stat_only: bool = Field(False, description="Only the diffstat, no patch.")
    binary: bool = Field(False, description="Binary patches (for git apply).")
    max_bytes: int = Field(DIFF_MAX_BYTES, ge=1, description="The patch is cut at this many bytes (truncated: true).")


class CheckTaskArgs(_Args):
    task: AgentTask = Field(description="A declared task, as `proctor check-task` reads it.")


class DecideArgs(_Args):
    task: AgentTask = Field(description="A declared task, as `proctor decide` reads it.")
    call: ToolCall = Field(description="One call: {tool, arguments, paths, call_id}.")
    live: bool = Field(False, description="Decide as for a live run (outward calls `run`, not `dry_run`).")


class LandArgs(JobArgs):
    into: str | None = Field(None, max_length=PATH_CHARS, description="Target branch (default: the job's base branch).")
    mode: Literal["auto", "merge", "squash", "ff-only"] = Field(
        "auto", description="auto: fast-forward when the target has not moved, else a merge commit.")
    force: bool = Field(False, description="Land a job whose validation did not pass (needs reason).")
    reason: str = Field("", max_length=2000, description="Why force; recorded in the ledger.")


# -- the tools -----------------------------------------------------------------------------------------

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


def _ledger() -> Ledger:
    try:
        return Ledger.default()
    except Exception as exc:
        raise Refusal(ReviewCode.LEDGER_FAILED.value, f"the ledger cannot be opened: {exc}") from exc


def _refused(out: Outcome) -> Refusal:
    return Refusal(out.code.value, out.reason, **out.details)


def _find(ledger: Ledger, ident: str, verb: str) -> jobs_mod.Job:
    found = jobs_mod.find(ledger, ident)
    if isinstance(found, Outcome):
        # As the CLI records a verb refused for an unknown job.
        jobs_mod.note(ledger, f"review.{verb}", {"ok": False, "job": ident, "code": found.code.value, "via": "mcp"})
        raise _refused(found)
    return found


class Surface:
    """What every tool call shares: the jobs this server runs, what its client was granted, who the client is."""

    def __init__(self, jobs: Jobs, grants: Grants | None = None) -> None:
        self.jobs = jobs
        self.grants = grants or Grants()
        self.client = "?"  # the client's own name and version (initialize's clientInfo), for the ledger rows

    def _verb_granted(self, ledger: Ledger, verb: str, job: str) -> None:
        """A review verb only when granted; refused or not, a row naming the client."""
        ok = verb in self.grants.verbs
        jobs_mod.note(ledger, f"mcp.{verb}", {"ok": ok, "job": job, "client": self.client,
                                              **({} if ok else {"code": VERB_NOT_ALLOWED})})
        if not ok:
            raise Refusal(VERB_NOT_ALLOWED, f"this MCP server does not offer {verb}: a person reviews and runs "
                          f"`proctor {verb}`, or starts `proctor mcp --allow-verb {verb}`")

    # run_agent ------------------------------------------------------------------------------------------

    def start(self, request: RunAgentRequest) -> dict[str, Any]:
        row = {"agent": request.agent, "ticket": request.ticket, "repo": request.repo, "mode": request.mode,
               "client": self.client}

        def admitted(job_id: str) -> None:
            # Written ahead, before the host's own job.start: which surface asked. No row, no job.
            try:
                ledger.append("mcp.run_agent", {"ok": True, "jobId": job_id, **row}, job_id=job_id)
            except Exception as exc:
                raise Refusal(ReviewCode.LEDGER_FAILED.value, f"the mcp.run_agent row could not be written ({exc}); "
                              "nothing was launched") from exc

        with _ledger() as ledger:
            try:
                config = self.jobs.config()
                self._capped(request, config)
                job = self.jobs.start(request, config, admitted)
            except ConfigError as exc:
                jobs_mod.note(ledger, "mcp.run_agent", {"ok": False, "code": JobCode.CONFIG_INVALID.value, **row})
                raise Refusal(JobCode.CONFIG_INVALID.value, str(exc)) from exc
            except Refusal as refusal:
                if refusal.code != ReviewCode.LEDGER_FAILED.value:
                    jobs_mod.note(ledger, "mcp.run_agent", {"ok": False, "code": refusal.code, **row})
                raise
        return {"jobId": job.job_id, "status": "running", "agent": request.agent, "ticket": request.ticket,
                "repo": request.repo, "next": "job_status or job_result (wait_s) with this jobId"}

    def _capped(self, request: RunAgentRequest, config: Config) -> None:
        """The queue's caps on what a request may ask (`over_privileged`), and a taskDecl that is a task."""
        why = over_privileged(request, config.confine, self.grants)
        if why:
            raise Refusal(OVER_PRIVILEGED, why)
        if request.task_decl is not None:
            try:
                AgentTask.model_validate(request.task_decl)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise Refusal(TASK_INVALID, f"taskDecl.{'.'.join(map(str, err['loc']))}: {err['msg']}") from exc

    # job_status / job_result ------------------------------------------------------------------------------

    def status(self, ident: str) -> dict[str, Any]:
        live = self.jobs.get(ident)
        with _ledger() as ledger:
            found = jobs_mod.find(ledger, ident)
        if isinstance(found, Outcome):
            live = live or self.jobs.by_prefix(ident)
            if live is None:
                raise _refused(found)
            # Started a moment ago: the host has not written its job.start row yet.
            return {"jobId": live.job_id, "status": "running", "state": "open", "agent": live.request.agent,
                    "ticket": live.request.ticket, "repo": live.request.repo, "live": live.live()}
        live = live or self.jobs.get(found.job_id)
        return {**found.to_dict(), "live": live.live() if live else None}

    def result_now(self, ident: str) -> tuple[dict[str, Any], LiveJob | None]:
        """(answer, the live job when it is still running here); answer["done"] says whether it ended."""
        live = self.jobs.get(ident)
        if live is None:
            with _ledger() as ledger:
                found = jobs_mod.find(ledger, ident)
            if isinstance(found, Outcome):
                live = self.jobs.by_prefix(ident)
                if live is None:
                    raise _refused(found)
            else:
                live = self.jobs.get(found.job_id)
                if live is None:
                    return self._recorded(found), None
        if live.finished.is_set() and live.result is not None:
            result = live.result.model_dump(mode="json", by_alias=True)
            return {"done": True, "jobId": live.job_id, "status": result["status"], "code": result["code"],
                    "result": result}, None
        return {"done": False, "jobId": live.job_id, "status": "running", "live": live.live()}, live

    @staticmethod
    def _recorded(job: jobs_mod.Job) -> dict[str, Any]:
        if job.ended is None and job.status == "running":
            return {"done": False, "jobId": job.job_id, "status": "running", "live": None}
        if job.ended is None:
            raise Refusal(ReviewCode.NO_RESULT.value,
                          f"job {job.job_id} was interrupted: its host died before it ended")
        if job.record.result is None:
            raise Refusal(ReviewCode.NO_RESULT.value,
                          f"job {job.job_id} ended {job.status} but its host kept no result.json")
        return {"done": True, "jobId": job.job_id, "status": job.status, "code": job.code,
                "result": job.record.result}

    # review verbs -----------------------------------------------------------------------------------------

    def list_jobs(self, args: ListArgs) -> dict[str, Any]:
        with _ledger() as ledger:
            found = jobs_mod.select(jobs_mod.load_jobs(ledger), repo=args.repo, statuses=tuple(args.status))
            late = jobs_mod.note(ledger, "review.jobs", {"ok": True, "repo": args.repo, "statuses": args.status,
                                                         "count": len(found), "via": "mcp"})
        out: dict[str, Any] = {"count": len(found), "jobs": [j.to_dict() for j in found]}
        for j in out["jobs"]:
            live = self.jobs.get(j["jobId"])
            j["live"] = live.live() if live else None
        return {**out, **({"ledger_warning": late} if late else {})}

    def diff(self, args: DiffArgs) -> dict[str, Any]:
        with _ledger() as ledger:
            found = _find(ledger, args.job, "diff")
            got = diff(found, binary=args.binary)
            ok = isinstance(got, Diff)
            jobs_mod.note(ledger, "review.diff", {"ok": ok, "jobId": found.job_id, "via": "mcp",
                                                  **({"code": got.code.value} if not ok else {})}, found.job_id)
        if isinstance(got, Outcome):
            raise _refused(got)
        out: dict[str, Any] = {"ok": True, "jobId": found.job_id, "base": got.base, "commit": got.commit,
                               "files": got.files, "stat": got.stat}
        if not args.stat_only:
            patch = got.patch[: args.max_bytes]
            out.update(patch=patch.decode("utf-8", "replace"), truncated=len(got.patch) > args.max_bytes,
                       patch_bytes=len(got.patch))
        return out

    def land(self, args: LandArgs) -> dict[str, Any]:
        if args.reason and not args.force:
            raise Refusal(INVALID_ARGUMENTS, "reason goes with force: give force true, or no reason")
        with _ledger() as ledger:
            self._verb_granted(ledger, "land", args.job)
            found = _find(ledger, args.job, "land")
            out = land_mod.land(ledger, found, into=args.into, mode=args.mode, force=args.force, reason=args.reason,
                                via="mcp")
        if not out.ok:
            raise _refused(out)
        return out.to_dict()

    def cancel(self, args: CancelArgs) -> dict[str, Any]:
        """Cancel a job this server runs: the host kills its whole tree and ends it CANCELLED, its end row
        written, as for `proctor run-agent` on Ctrl-C. A job of another process is not this server's to stop."""
        live = self.jobs.get(args.job) or self.jobs.by_prefix(args.job)
        if live is None:
            raise Refusal(NOT_RUNNING_HERE, f"no job {args.job!r} runs in this server (a queued job is cancelled "
                          "with `proctor cancel`; one of another process with its own Ctrl-C)")
        if live.finished.is_set():
            raise Refusal(JOB_ENDED, f"job {live.job_id} has already ended: nothing to cancel")
        with _ledger() as ledger:
            jobs_mod.note(ledger, "mcp.cancel", {"jobId": live.job_id, "reason": args.reason, "client": self.client},
                          live.job_id)
        live.cancelled = live.cancelled or args.reason
        return {"jobId": live.job_id, "cancelled": True, "reason": live.cancelled,
                "next": "job_result (wait_s) for its CANCELLED result"}

    def discard(self, args: JobArgs) -> dict[str, Any]:
        with _ledger() as ledger:
            self._verb_granted(ledger, "discard", args.job)
            found = _find(ledger, args.job, "discard")
            out = gc_mod.discard(ledger, found, via="mcp")
        if not out.ok:
            raise _refused(out)
        return out.to_dict()

    # policy -----------------------------------------------------------------------------------------------

    @staticmethod
    def _policy() -> Policy:
        try:
            return Policy.load()
        except PolicyError as exc:
            raise Refusal(POLICY_INVALID, str(exc)) from exc

    def check_task(self, args: CheckTaskArgs) -> dict[str, Any]:
        return plan(args.task, self._policy()).model_dump(mode="json")

    def decide(self, args: DecideArgs) -> dict[str, Any]:
        gate = Gate(args.task, policy=self._policy(), dry_run=not args.live, stop=StopSwitch().reason)
        return gate.decide(args.call).to_dict()


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
            "mode, timeoutSec, validateCommand, confine, taskDecl.",
            RunAgentRequest,
            types.ToolAnnotations(title="Start an agent job", read_only_hint=False, destructive_hint=False,
                                  idempotent_hint=False, open_world_hint=True),
            _run_agent),
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


def build_server(jobs: Jobs, grants: Grants | None = None) -> Server[Surface]:
    surface = Surface(jobs, grants)

    @asynccontextmanager
    async def lifespan(_: Server[Surface]) -> AsyncIterator[Surface]:
        try:
            yield surface
        finally:
            # Sync on purpose: this runs while the loop winds down (the client closed stdin).
            cancelled = jobs.shutdown("the MCP server is shutting down")
            if cancelled:
                log.warning("cancelled %d running job(s): %s", len(cancelled), ", ".join(cancelled))

    async def list_tools(ctx: Ctx, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=t.name, title=t.annotations.title, description=t.description, input_schema=t.schema(),
                       annotations=t.annotations) for t in offered(surface.grants)])

    async def on_call(ctx: Ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await call_tool(surface, ctx, params.name, params.arguments)

    return Server(SERVER_NAME, version=version("proctor"), lifespan=lifespan, on_list_tools=list_tools,
                  on_call_tool=on_call,
                  instructions="proctor runs coding agents under limits a person set and judges the result "
                               "itself: run_agent starts a job, job_result waits for its verdict.")


def _wire() -> tuple[anyio.AsyncFile[str], anyio.AsyncFile[str]]:
    """The MCP streams on private duplicates of fd 0 and 1; fd 1 becomes stderr and fd 0 /dev/null for the
    rest of the process, so nothing but frames ever reaches the client's stdout (a child's inherited fd 1,
    a stray print, a job still ending after the session closed)."""
    wire_in, wire_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    reader = io.TextIOWrapper(os.fdopen(wire_in, "rb"), encoding="utf-8", errors="replace")
    writer = io.TextIOWrapper(os.fdopen(wire_out, "wb"), encoding="utf-8", write_through=True)
    return anyio.wrap_file(reader), anyio.wrap_file(writer)


def serve(jobs: Jobs, grants: Grants | None = None) -> None:
    """Serve MCP on stdio until the client closes stdin; running jobs are cancelled and recorded first.

    A signal is the caller's to handle (`proctor mcp` calls `jobs.shutdown` and exits): unwinding the loop
    from one would wait forever on the thread blocked reading the client's still-open stdin."""
    server = build_server(jobs, grants)
    stdin, stdout = _wire()

    async def main() -> None:
        async with stdio_server(stdin=stdin, stdout=stdout) as (read, write):
            await server.run(read, write, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        jobs.shutdown("the MCP server is shutting down")


def config_problem(config_file: str | None) -> str | None:
    """Why `--config` cannot be used (checked once at start; each run_agent loads it again), or None."""
    try:
        load_config(config_file)
    except ConfigError as exc:
        return str(exc)
    return None
