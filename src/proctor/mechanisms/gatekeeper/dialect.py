"""The seam between a job's gate service and each CLI's hook dialect: the `Dialect` protocol, the `Answer` a
dialect gives in its CLI's form, the reason the model hears, and where a CLI's settings for one job live.

Below the service and every dialect (both import it; it imports neither); it never decides a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from proctor.mechanisms.policy.gate import Decision
from proctor.mechanisms.policy.task import Effect


@dataclass(frozen=True)
class Answer:
    stdout: str = ""
    stderr: str = ""
    exit: int = 0


def reason(d: Decision) -> str:
    return f"[proctor {d.code.value}] {d.reason}"


class Dialect(Protocol):
    """One CLI's hook protocol: its tools and their effects, its hook JSON as the gate's call, the gate's
    decision as its answer, the files (and variables) that install the hook for one job, and the tool calls
    its own output stream shows (for the armed check and reconciliation)."""

    name: str
    tools: dict[str, tuple[Effect, bool]]

    def call(self, payload: dict[str, Any], worktree: Path) -> dict[str, Any]: ...
    def answer(self, d: Decision) -> Answer: ...
    def files(self, hook: list[str], dir: Path) -> dict[str, str]: ...
    def env(self, dir: Path) -> dict[str, str]: ...
    def tool_uses(self, stdout: str) -> list[tuple[str, str]]: ...


def settings_path(dir: Path, cli: str) -> Path:
    """The CLI's settings file for one job, in its gate dir (`result.gate.settings`)."""
    return dir / f"{cli}-settings.json"
