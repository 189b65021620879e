"""The command request an agent sends, and reading one from untrusted input in the documented check order.

Owns the request's wire shape (`CommandRequest`, `StdinContent`, both closed) and checks 1 (shape and identity)
and 2 (arguments); the stdin body's own shape is check 6 and is read by `read_stdin`. It never looks at the
allowlist, the filesystem or a process: whether the command may run is decided in allowlist and run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from proctor.services.commands.errors import ProposalError, RequestCode

KIND = "command-request"

_CLOSED = ConfigDict(extra="forbid", frozen=True, strict=True)


def _no_nul(value: str, what: str) -> str:
    # A NUL cannot cross execve or name a file; refusing it here keeps later path handling free of ValueError.
    if "\x00" in value:
        raise ValueError(f"{what} {value!r} contains a NUL byte")
    return value


class StdinContent(BaseModel):
    """Content the command reads on stdin, named by the project path it stands for (what the gates judge)."""

    model_config = _CLOSED

    path: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _no_nul(v, "stdin path")


class CommandRequest(BaseModel):
    """One command an agent asks the host to run. `argv` is a list, never a shell string."""

    model_config = _CLOSED

    kind: Literal["command-request"] = KIND
    agent: Annotated[StrictStr, Field(min_length=1)]
    argv: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]
    """Program first; each element one argument. The program must be the allowlist entry's literal."""
    cwd: StrictStr
    """Where it runs, relative to the project; must equal the entry's pinned cwd."""
    purpose: StrictStr
    """Why the agent wants it: recorded, never interpreted."""
    expected_writes: list[Annotated[StrictStr, Field(min_length=1)]] = Field(default_factory=list)
    """Project paths the command may change: files, or folders written as `dir/` (everything under it)."""
    stdin_from_content: StdinContent | None = None

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        for arg in v:
            _no_nul(arg, "argument")
        return v

    @field_validator("purpose")
    @classmethod
    def _purpose(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("purpose must say why the command is needed")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str) -> str:
        return _no_nul(v, "cwd")

    @field_validator("expected_writes")
    @classmethod
    def _writes(cls, v: list[str]) -> list[str]:
        for path in v:
            _no_nul(path, "expected write")
        return v


_REQUIRED = frozenset({"kind", "agent", "argv", "cwd", "purpose"})
_KNOWN = frozenset(CommandRequest.model_fields)
# Which check a field belongs to, for the code of its refusal (see `read_request`).
_FIELD_CODE = {
    "argv": RequestCode.ARGV_INVALID,
    "purpose": RequestCode.PURPOSE_EMPTY,
    "cwd": RequestCode.REQUEST_SHAPE,
    "expected_writes": RequestCode.REQUEST_SHAPE,
}


class Admitted(NamedTuple):
    """A request past checks 1 and 2; `stdin` is the raw body, judged later by `read_stdin` (check 6)."""

    request: CommandRequest
    stdin: Any


def _first_error(exc: ValidationError) -> tuple[str, str]:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "request"
    return loc, err["msg"].removeprefix("Value error, ")


def read_request(
    raw: CommandRequest | Mapping[str, Any],
    *,
    expect_agent: str | None = None,
    refuse_agents: Collection[str] = frozenset(),
) -> Admitted:
    """Checks 1 and 2 in order; the first failure raises `ProposalError` with that check's code."""
    data: Any = raw.model_dump(mode="json") if isinstance(raw, CommandRequest) else raw
    # 1. shape: a mapping of known keys, the right kind, an agent name.
    if not isinstance(data, Mapping):
        raise ProposalError(RequestCode.REQUEST_SHAPE, f"a request is a JSON object, not {type(data).__name__}")
    if data.get("kind") != KIND:
        raise ProposalError(
            RequestCode.NOT_A_COMMAND_REQUEST, f"kind is {data.get('kind')!r}; this endpoint takes {KIND!r} only"
        )
    unknown = sorted(str(k) for k in data if k not in _KNOWN)
    if unknown:
        raise ProposalError(
            RequestCode.REQUEST_SHAPE, f"unknown field(s) {unknown}; a request has only {sorted(_KNOWN)}"
        )
    missing = sorted(_REQUIRED - set(data))
    if missing:
        raise ProposalError(RequestCode.REQUEST_SHAPE, f"missing field(s) {missing}")
    agent = data["agent"]
    if not isinstance(agent, str) or not agent:
        raise ProposalError(RequestCode.REQUEST_SHAPE, "agent must be a non-empty string")
    # 1. identity: the caller (who dispatched the agent) says who may ask.
    if expect_agent is not None and agent != expect_agent:
        raise ProposalError(
            RequestCode.AGENT_MISMATCH, f"request names agent {agent!r}, but this run is for {expect_agent!r}"
        )
    if agent in refuse_agents:
        raise ProposalError(RequestCode.AGENT_REFUSED, f"agent {agent!r} may not request commands")
    # 2. arguments.
    if isinstance(data["argv"], str):
        raise ProposalError(
            RequestCode.ARGV_SHELL_STRING,
            "argv is a shell string; send a list with one argument per element (no shell is ever used)",
        )
    body = {k: v for k, v in data.items() if k != "stdin_from_content"}
    try:
        request = CommandRequest.model_validate(body)
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        code = _FIELD_CODE.get(loc.split(".")[0], RequestCode.REQUEST_SHAPE)
        raise ProposalError(code, f"{loc}: {msg}") from None
    return Admitted(request, data.get("stdin_from_content"))


def read_stdin(raw: Any) -> StdinContent | None:
    """Check 6, first half: `stdin_from_content` is absent, null, or exactly `{path, content}` strings."""
    if raw is None:
        return None
    try:
        return StdinContent.model_validate(raw)
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        raise ProposalError(
            RequestCode.STDIN_SHAPE, f"stdin_from_content must be exactly {{path, content}}: {loc}: {msg}"
        ) from None
