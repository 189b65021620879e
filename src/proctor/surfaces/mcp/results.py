"""What a tool answers: an MCP tool result from a service's outcome, and the refusal codes of this surface.

`structuredContent` is the JSON the CLI prints with `--json`, and a refusal is a tool error (`isError`) whose
text is `CODE: one sentence` and whose structured content is `{ok, code, reason, ...}`. Text a client reads
is `terminal.json_safe` (bidi and controls escaped). It never calls a service (surface.py does).
"""

from __future__ import annotations

import json
from typing import Any

from mcp import types

from proctor.mechanisms.terminal import json_safe, visible


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
