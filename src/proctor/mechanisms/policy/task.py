"""A declared task: what a person allows an agent to do (goal, tools with effects, permissions, limits).

Owns the task and tool-call shapes and the effect vocabulary. It never decides anything and never touches
the filesystem: the gate decides calls, the trusted policy caps limits and judges the workspace. Every model
refuses unknown fields, so nothing (an "approved" flag, a raised ceiling) can be written into a task.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Effect(StrEnum):
    """What a tool does to the world; the gate grants it through one permission (see `PERMISSION_FOR`)."""

    none = "none"
    read = "read"
    write = "write"
    delete = "delete"
    shell = "shell"
    network = "network"
    send = "send"
    pay = "pay"


# Effects that reach past the workspace or cannot be undone: dry-run unless the run is explicitly live.
OUTWARD: frozenset[Effect] = frozenset({Effect.shell, Effect.network, Effect.send, Effect.pay, Effect.delete})
# Effects on files: such a call must name the paths it touches, so the gate can confine them.
FILE_EFFECTS: frozenset[Effect] = frozenset({Effect.read, Effect.write, Effect.delete})
# The permission flag that grants each effect; None means no permission is needed.
PERMISSION_FOR: dict[Effect, str | None] = {
    Effect.none: None,
    Effect.read: "read_files",
    Effect.write: "write_files",
    Effect.delete: "write_files",
    Effect.shell: "shell",
    Effect.network: "network",
    Effect.send: "network",
    Effect.pay: "network",
}
NETWORK_EFFECTS: frozenset[Effect] = frozenset(e for e, p in PERMISSION_FOR.items() if p == "network")

_CLOSED = ConfigDict(extra="forbid", frozen=True)


class ToolSpec(BaseModel):
    """One tool the agent may ask for."""

    model_config = _CLOSED

    name: Annotated[str, Field(min_length=1, max_length=200)]
    """The name a call refers to; unique within a task."""
    effect: Effect
    online: bool = False
    """The tool reaches the network whatever its effect; it needs the `network` permission."""


class Permissions(BaseModel):
    """What the person grants. Everything is off unless granted."""

    model_config = _CLOSED

    workspace: Annotated[str, Field(min_length=1)]
    """The one folder file tools may touch; judged by the trusted policy's workspace rule."""
    read_files: bool = False
    write_files: bool = False
    shell: bool = False
    network: bool = False


class Limits(BaseModel):
    """The caller's limits. Missing ones take the trusted ceiling; larger ones are lowered to it."""

    model_config = _CLOSED

    max_steps: Annotated[int, Field(ge=1)] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    wall_clock_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class AgentTask(BaseModel):
    """A declared task, as the person wrote it (before the trusted policy caps it)."""

    model_config = _CLOSED

    goal: Annotated[str, Field(min_length=1)]
    context: str = ""
    tools: tuple[ToolSpec, ...] = ()
    permissions: Permissions
    limits: Limits = Limits()

    @model_validator(mode="after")
    def _unique_tools(self) -> AgentTask:
        seen: set[str] = set()
        for tool in self.tools:
            if tool.name in seen:
                raise ValueError(f"tool {tool.name!r} is declared twice")
            seen.add(tool.name)
        return self


class ToolCall(BaseModel):
    """One call an agent asks to make. `paths` are the files it touches, relative to the workspace or absolute."""

    model_config = _CLOSED

    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    paths: tuple[str, ...] = ()
    call_id: str = ""
    """Unique within a run; the gate names one (`call-N`) when empty."""

    @field_validator("paths")
    @classmethod
    def _no_nul(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # A NUL byte cannot name a file; refusing it here keeps path resolution free of ValueError.
        for p in v:
            if "\x00" in p or not p:
                raise ValueError(f"path {p!r} is empty or contains a NUL byte")
        return v
