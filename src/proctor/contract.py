"""The run_agent contract (frozen v1, additive changes only): request, result, status and stable codes.

This module owns the wire shape and the rules a request must satisfy anywhere (CLI, Python, queue, HTTP).
It never touches the filesystem or a process: checks that need the executing machine (the repo exists, the
agent is known there) live in the host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

TIMEOUT_MIN_S = 60
TIMEOUT_MAX_S = 14_400
TIMEOUT_DEFAULT_S = 1_200

TICKET_RE = re.compile(r"[A-Za-z0-9._-]+")
REF_RE = re.compile(r"[A-Za-z0-9._/-]+")


@dataclass(frozen=True)
class Requester:
    """Who asked for a job when it is not the person at this machine: a queue signer, an MCP client. Never
    part of a request (the request is theirs to write); the surface that checked them tells run_agent.
    Such a job never picks the config proctor trusts (docs "Who is asking"): the repo's settings come
    from config.toml and the default branch, `branch` names a branch only, and `copy` and `registries`
    need `privileged`, the grant `validateCommand` needs."""

    name: str
    privileged: bool = False


class Status(StrEnum):
    completed = "completed"
    failed = "failed"
    timed_out = "timed_out"
    rate_limited = "rate_limited"
    approval_required = "approval_required"


class Code(StrEnum):
    """Stable outcome codes of a run_agent job; additive only, never renamed."""

    OK = "OK"
    INVALID_REQUEST = "INVALID_REQUEST"
    TASK_UNREADABLE = "TASK_UNREADABLE"
    UNKNOWN_AGENT = "UNKNOWN_AGENT"
    CONFIG_INVALID = "CONFIG_INVALID"
    PROMPT_TOO_LARGE = "PROMPT_TOO_LARGE"
    WORKTREE_FAILED = "WORKTREE_FAILED"
    AGENT_NOT_FOUND = "AGENT_NOT_FOUND"
    AGENT_FAILED = "AGENT_FAILED"
    TIMED_OUT = "TIMED_OUT"
    RATE_LIMITED = "RATE_LIMITED"
    APPROVAL_REQUIRED = "APPROVAL_REQUIRED"
    VALIDATION_FAILED = "VALIDATION_FAILED"
    STOPPED = "STOPPED"
    CANCELLED = "CANCELLED"
    CIRCUIT_OPEN = "CIRCUIT_OPEN"
    CONFINEMENT_UNAVAILABLE = "CONFINEMENT_UNAVAILABLE"
    HOST_ERROR = "HOST_ERROR"
    TAMPERED = "TAMPERED"  # the agent left something the host refuses to read (a FIFO, a device, ...)
    RESOURCE_LIMIT = "RESOURCE_LIMIT"  # killed at a per-job limit (memory, pids, disk); never retried
    AGENT_MISCONFIGURED = "AGENT_MISCONFIGURED"  # the CLI cannot run as configured (login, key, auth type)
    BYPASS = "BYPASS"  # the CLI made a tool call its gate hook never decided (hooks not loaded, or skipped)
    DISK_FULL = "DISK_FULL"  # the ledger's filesystem is full: the job was not run, or its record is incomplete
    BUDGET_DENIED = "BUDGET_DENIED"  # a spend budget of the trusted policy has no room: nothing was launched
    BUDGET_UNAVAILABLE = "BUDGET_UNAVAILABLE"  # the spend tally could not be reached: nothing was launched
    LEDGER_TAMPERED = "LEDGER_TAMPERED"  # the ledger's chain is broken: nothing was launched or recorded
    UNSAFE_DIRECTORY = "UNSAFE_DIRECTORY"  # a directory proctor would use is another's or group/world-writable
    CHECKOUT_WOULD_LOSE = "CHECKOUT_WOULD_LOSE"  # landing would overwrite a file the person has: refused
    NOTHING_TO_LAND = "NOTHING_TO_LAND"  # the target already holds the job's change
    BASELINE_FAILED = "BASELINE_FAILED"  # the base's own validation cannot run: nothing was launched
    AGENT_UNTESTED = "AGENT_UNTESTED"  # cli_versions = "strict": the CLI's version is not a tested one


def check_ref(ref: str) -> str:
    """A base ref we are willing to hand to git: charset, no option lookalike, no range syntax."""
    if not ref or not REF_RE.fullmatch(ref):
        raise ValueError(f"branch {ref!r} must match [A-Za-z0-9._/-]+")
    if ref.startswith("-"):
        raise ValueError(f"branch {ref!r} must not start with '-'")
    if ".." in ref:
        raise ValueError(f"branch {ref!r} must not contain '..'")
    return ref


class RunAgentRequest(BaseModel):
    """One job: have `agent` do `task` in `repo`. Field names on the wire are the v1 camelCase ones."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    agent: Annotated[str, Field(min_length=1)]
    task: str
    repo: str
    ticket: str
    branch: str | None = None
    mode: str = "build"
    timeout_sec: int = Field(default=TIMEOUT_DEFAULT_S, alias="timeoutSec")
    validate_command: str | None = Field(default=None, alias="validateCommand")
    # Additive: confinement policy for this job ("auto" | "required" | "off"); None = the config's.
    confine: str | None = None
    # Additive: the declared task (AgentTask's shape, as `proctor check-task` reads it) every tool call of the
    # agent's CLI is decided against; its workspace is the job's worktree whatever it names. None: a default
    # declaration from the job (the CLI's tools, files and shell in the worktree, network per the adapter).
    task_decl: dict[str, Any] | None = Field(default=None, alias="taskDecl")
    # Additive: directories of held-out tests on the executing host, laid into validation only and never
    # readable by the agent (docs "What the verdict rests on"); from a queue sender only with
    # may_set_validate_command (it names host paths), like validateCommand.
    holdout: list[str] | None = None
    # Additive: test ids (as the runner names them: `tests/test_x.py::test_y`, `pkg TestY`) that must pass in
    # the job's run whatever the base did (SWE-bench's FAIL_TO_PASS): a test failing on the base and still
    # failing is otherwise pre-existing, not the job's failure.
    must_pass: list[str] | None = Field(default=None, alias="mustPass")
    # Additive: a follow-up. The id of an earlier job of this repo whose work this one continues: the agent
    # starts from that job's tree with `task` as its new brief, and the job is judged, diffed and landed
    # against the chain's first base (what the chain as a whole fixed and broke). The person's own only.
    continues: str | None = None

    @field_validator("continues")
    @classmethod
    def _continues(cls, v: str | None) -> str | None:
        if v is not None and not (TICKET_RE.fullmatch(v) and len(v) <= 200):
            raise ValueError(f"continues {v[:80]!r} must be a job id ([A-Za-z0-9._-]+)")
        return v

    @field_validator("must_pass")
    @classmethod
    def _must_pass(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (len(v) > 10_000 or any(not t.strip() or len(t) > 2000 for t in v)):
            raise ValueError("mustPass must be at most 10,000 non-empty test ids of at most 2,000 characters")
        return v

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("task must be non-empty")
        return v

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"repo {v!r} must be an absolute path")
        return v

    @field_validator("ticket")
    @classmethod
    def _ticket(cls, v: str) -> str:
        if not TICKET_RE.fullmatch(v):
            raise ValueError(f"ticket {v!r} must match [A-Za-z0-9._-]+")
        # It becomes the last component of a branch name: git's own ref rules apply too.
        if v.startswith((".", "-")) or v.endswith((".", ".lock")) or ".." in v:
            raise ValueError(f"ticket {v!r} is not a valid branch component (no leading '.' or '-', "
                             "no trailing '.' or '.lock', no '..')")
        return v

    @field_validator("branch")
    @classmethod
    def _branch(cls, v: str | None) -> str | None:
        return None if v is None else check_ref(v)

    @field_validator("timeout_sec", mode="before")
    @classmethod
    def _clamp(cls, v: Any) -> int:
        # Clamped, not refused: the contract says 60-14400 and a caller's 5 means "as short as allowed".
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError("timeoutSec must be a number of seconds")
        try:
            n = int(float(v))
        except (ValueError, OverflowError):  # "soon", inf, nan
            raise ValueError(f"timeoutSec {v!r} is not a finite number") from None
        return max(TIMEOUT_MIN_S, min(TIMEOUT_MAX_S, n))

    @field_validator("validate_command")
    @classmethod
    def _validate_cmd(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("validateCommand must be non-empty when given")
        return v

    @field_validator("confine")
    @classmethod
    def _confine(cls, v: str | None) -> str | None:
        if v is not None and v not in ("auto", "required", "off"):
            raise ValueError("confine must be auto, required or off")
        return v


class RunAgentResult(BaseModel):
    """The v1 result. The first nine fields are frozen; the rest are additive."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    status: Status
    summary: str = ""
    changed_files: list[str] = Field(default_factory=list)
    tests_attempted: list[str] = Field(default_factory=list)
    known_risks: list[str] = Field(default_factory=list)
    needs_human_review: bool = True
    agent: str = ""
    duration_seconds: float = Field(default=0.0, alias="durationSeconds")
    worktree_path: str | None = Field(default=None, alias="worktreePath")
    # additive
    job_id: str | None = Field(default=None, alias="jobId")
    branch: str | None = None
    base_ref: str | None = Field(default=None, alias="baseRef")
    # The commit whose `.proctor.toml` the job's settings came from: the base, or for a job someone else
    # asked for, the repo's default branch at admission (its validation and its landing use the same).
    settings_commit: str | None = Field(default=None, alias="settingsCommit")
    mode: str | None = None
    code: Code = Code.OK
    claimed_status: str | None = None
    agent_changed_files: list[str] = Field(default_factory=list)
    agent_version: str | None = None
    attempts: int = 0
    exit_codes: list[int | None] = Field(default_factory=list)
    retry_after: str | None = None
    confinement: str | None = None
    confinement_details: dict[str, Any] | None = None
    # The breaker's view of this run: the pool it is kept for, the signal the run gave it and what the host
    # read that from (an exit, the deadline, an HTTP status in a field of the CLI's protocol; never prose).
    breaker: dict[str, Any] | None = None
    # The gate's view of the agent's own tool calls: gated (false: the CLI has no hook proctor can use),
    # the CLI, armed, calls decided, refused, by code. Each call is a `gate.call` ledger row.
    gate: dict[str, Any] | None = None
    # Each validation command the host ran: label, exit_code, timed_out, duration_s, output_tail (64 KB),
    # output_dropped; the whole output is in `validation_log` (a file under $PROCTOR_HOME).
    validation: list[dict[str, Any]] = Field(default_factory=list)
    validation_log: str | None = None
    # The base's own run of the validation plan, before the agent (docs "What the verdict rests on"):
    # source (ran | cached), confinement, and per step its runners, the evidence read and its counts; each
    # validation step's `compared` holds the job's tests against it (broken, fixed, pre_existing, new).
    baseline: dict[str, Any] | None = None
    # What the verdict rests on (docs): `verdict` (sealed > held-out > base-tests > exit-code), each
    # validation step's rung, the held-out step's, and the rung the repo's settings require (null: none).
    basis: dict[str, Any] | None = None
    # The held-out step (docs "What the verdict rests on"): how many dirs and files, how many of the tree's
    # files they replaced, the held-out tests expected and failed, the sealed checks' counts and the ordinals
    # of those that failed; never names, content or expected values. None: nothing was held out.
    holdout: dict[str, Any] | None = None
    # The job's commit (the tree `changed_files` lists, on `branch` in the job's own repo at worktreePath).
    commit: str | None = None
    # A follow-up's chain, oldest first: the jobs whose work it started from (the request's `continues`
    # and what that one continued). Its diff, verdict and landing are against the first one's base.
    chain: list[str] = Field(default_factory=list)
    # What the agent's CLI reported it used, read from a field of its own protocol: tokens_in (cached input
    # included), tokens_out, tokens_cached, usd (None when the CLI states no cost), source. None when the CLI
    # said nothing (a text CLI, a run cut short).
    usage: dict[str, Any] | None = None
    # The spend governor's view: the budgets that covered the job, what it booked before launch and what
    # was charged after (or, when denied, each limit it was over and when that frees). None: no budget.
    budget: dict[str, Any] | None = None
    # What the repo's auto_land policy did with the job, when the person's config has one for its repo:
    # landed or not, the code and reason, the policy (proctor.services.review.auto). None: no policy asked.
    landed: dict[str, Any] | None = None
    # What the person should know that puts no verdict in doubt, their own config's doing (a declared agent's
    # program showing a whole folder, per-repo tables naming a path that moved). Never the agent's words.
    warnings: list[str] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)


class RaceResult(BaseModel):
    """A race: one task given to several agents (or several attempts of one), each its own job, and their
    ranking by what the host measured (proctor.services.race). `winner` is the first-ranked job when its
    verdict needs no person; `ranking` gives every job's place and the reasons for it, best first; `jobs`
    each job's own v1 result, in the order they were asked. Additive only, like the result."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    race_id: str = Field(alias="raceId")
    status: Status
    code: Code = Code.OK
    summary: str = ""
    winner: str | None = None
    ranking: list[dict[str, Any]] = Field(default_factory=list)
    jobs: list[RunAgentResult] = Field(default_factory=list)
    duration_seconds: float = Field(default=0.0, alias="durationSeconds")
    # The spend governor's view of the race as a whole: how many runs the budgets had room for when it
    # was refused whole (nothing launched), else None.
    budget: dict[str, Any] | None = None
    # A landing the repo's auto_land policy made of the winner (proctor.services.review.auto), else None.
    landed: dict[str, Any] | None = None

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)


def request_errors(exc: ValidationError) -> list[str]:
    """Turn pydantic's errors into one readable line each, naming the field by its wire name."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"invalid request: {loc}: {msg}")
    return out


def parse_request(data: dict[str, Any]) -> RunAgentRequest | list[str]:
    """Validate a raw request (queue payload, HTTP body) into the model, or the list of violations."""
    try:
        return RunAgentRequest.model_validate(data)
    except ValidationError as exc:
        return request_errors(exc)
