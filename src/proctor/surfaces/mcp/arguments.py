"""The tools' arguments: a pydantic model per tool (its input schema), and the limits on any string in them.

No argument may hold a NUL or run past MAX_ARG_CHARS (`bad_strings`): a clear INVALID_ARGUMENTS, never
HOST_ERROR. A run_agent request is the contract's `RunAgentRequest`, not a model of this module. It never
validates a declared task against the policy (the gate does).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proctor.mechanisms.policy.task import AgentTask, ToolCall

MAX_WAIT_S = 300.0  # job_result's longest wait; a client's request timeout is often not much longer
DIFF_MAX_BYTES = 1_000_000
MAX_ARG_CHARS = 200_000  # of any one string argument (a task brief is the longest); longer is refused
PATH_CHARS = 4096  # of a path argument (PATH_MAX)


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


class RaceArgs(_Args):
    agents: list[str] = Field(min_length=2, max_length=16, description="The agents to race, one job each (repeat "
                              "one for several attempts of it).")
    job: dict[str, Any] = Field(description="The run_agent request every job shares, agent left out: task, repo, "
                                "ticket, and optional branch, timeoutSec, validateCommand, mustPass, ...")


class RaceResultArgs(_Args):
    race: str = Field(min_length=1, max_length=200, description="A race id (race-...), or a unique prefix of one.")
    wait_s: float = Field(0, ge=0, description=f"Wait up to this many seconds for the race to end (at most "
                          f"{MAX_WAIT_S:.0f}).")


class LandArgs(JobArgs):
    into: str | None = Field(None, max_length=PATH_CHARS, description="Target branch (default: the job's base branch).")
    mode: Literal["auto", "merge", "squash", "ff-only"] = Field(
        "auto", description="auto: fast-forward when the target has not moved, else a merge commit.")
    force: bool = Field(False, description="Land a job whose validation did not pass (needs reason).")
    reason: str = Field("", max_length=2000, description="Why force; recorded in the ledger.")

