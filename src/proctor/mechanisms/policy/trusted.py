"""The trusted policy: ceilings, forbidden effects and paths, and the workspace rule.

Owns `$PROCTOR_HOME/policy.toml` and the numbers a task's limits are capped by. It is read from proctor's own
state dir only, never taken from the caller or the task, and it never raises a caller's limit. It decides
nothing about individual calls (that is the gate) and runs nothing.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proctor.home import proctor_home
from proctor.mechanisms.policy.budget import Budget, BudgetName, BudgetTable
from proctor.mechanisms.policy.task import AgentTask, Effect

POLICY_FILE = "policy.toml"


class PolicyError(ValueError):
    """The trusted policy file exists but is unusable; the edge turns this into a clear message."""


@dataclass(frozen=True)
class Ceilings:
    """Step, tool-call and wall-clock limits. The trusted policy holds one; `cap` gives a task's effective one.

    Each `check_*` returns None within the limit, else a message carrying the limit and the observed value.
    """

    max_steps: int = 25
    max_tool_calls: int = 50
    wall_clock_s: float = 900.0

    def cap(self, task: AgentTask) -> Ceilings:
        """The task's limits as proctor runs them: missing ones take the ceiling, larger ones are lowered."""
        lim = task.limits
        return Ceilings(
            max_steps=self.max_steps if lim.max_steps is None else min(lim.max_steps, self.max_steps),
            max_tool_calls=(
                self.max_tool_calls if lim.max_tool_calls is None else min(lim.max_tool_calls, self.max_tool_calls)
            ),
            wall_clock_s=self.wall_clock_s if lim.wall_clock_s is None else min(lim.wall_clock_s, self.wall_clock_s),
        )

    def lowered(self, task: AgentTask) -> list[str]:
        """Which of the caller's limits the ceilings lowered, e.g. `max_steps 100 -> 25`."""
        out = []
        for name in ("max_steps", "max_tool_calls", "wall_clock_s"):
            asked = getattr(task.limits, name)
            ceiling = getattr(self, name)
            if asked is not None and asked > ceiling:
                out.append(f"{name} {asked} -> {ceiling}")
        return out

    def check_steps(self, steps: int) -> str | None:
        return None if steps <= self.max_steps else f"exceeded max_steps of {self.max_steps} (steps={steps})"

    def check_tool_calls(self, calls: int) -> str | None:
        if calls <= self.max_tool_calls:
            return None
        return f"exceeded max_tool_calls of {self.max_tool_calls} (tool_calls={calls})"

    def check_wall_clock(self, elapsed_s: float) -> str | None:
        if elapsed_s <= self.wall_clock_s:
            return None
        return f"exceeded wall_clock_s of {self.wall_clock_s:g} (elapsed_s={elapsed_s:.3f})"


class _CeilingsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_steps: Annotated[int, Field(ge=1)] = Ceilings.max_steps
    max_tool_calls: Annotated[int, Field(ge=0)] = Ceilings.max_tool_calls
    wall_clock_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Ceilings.wall_clock_s


class _ForbidFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effects: list[Effect] = Field(default_factory=list)
    paths: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)


class _ApproveFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effects: list[Effect] = Field(default_factory=list)


class _PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ceilings: _CeilingsFile = Field(default_factory=_CeilingsFile)
    forbid: _ForbidFile = Field(default_factory=_ForbidFile)
    approve: _ApproveFile = Field(default_factory=_ApproveFile)
    budgets: dict[BudgetName, BudgetTable] = Field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    """The trusted policy. `forbidden_paths` are globs on workspace-relative paths (`*` crosses `/`); a
    pattern without `/` matches any one path component, so `.git` blocks everything under a `.git` folder.

    File shape (every key optional, unknown keys refused):

        [ceilings]
        max_steps = 25
        max_tool_calls = 50
        wall_clock_s = 900
        [forbid]
        effects = ["pay"]
        paths = [".git", "secrets/*"]
        [approve]                # held for a person: refused APPROVAL_REQUIRED until `proctor approve`
        effects = ["network"]
        [budgets.claude-team]    # spend per pool and window (proctor.mechanisms.policy.budget; enforced by proctor.mechanisms.policy.governor)
        agent = "claude"
        runs_per_hour = 20
    """

    ceilings: Ceilings = field(default_factory=Ceilings)
    forbidden_effects: frozenset[Effect] = frozenset()
    approval_effects: frozenset[Effect] = frozenset()
    forbidden_paths: tuple[str, ...] = ()
    budgets: tuple[Budget, ...] = ()
    source: Path | None = None

    @classmethod
    def load(cls, home: Path | None = None) -> Policy:
        """The policy at `<home>/policy.toml` (home defaults to `$PROCTOR_HOME`); the defaults when absent."""
        path = (home or proctor_home()) / POLICY_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise PolicyError(f"policy {path}: cannot read: {exc.strerror}") from None
        try:
            data = tomllib.loads(raw.decode("utf-8"))
            parsed = _PolicyFile.model_validate(data)
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PolicyError(f"policy {path}: not valid TOML: {exc}") from None
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "policy"
            raise PolicyError(f"policy {path}: {loc}: {err['msg'].removeprefix('Value error, ')}") from None
        c = parsed.ceilings
        return cls(
            ceilings=Ceilings(c.max_steps, c.max_tool_calls, c.wall_clock_s),
            forbidden_effects=frozenset(parsed.forbid.effects),
            approval_effects=frozenset(parsed.approve.effects),
            forbidden_paths=tuple(parsed.forbid.paths),
            budgets=tuple(table.build(name) for name, table in sorted(parsed.budgets.items())),
            source=path,
        )


def _related(a: Path, b: Path) -> bool:
    """a equals b, or one holds the other."""
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_workspace(workspace: str, *, home: Path | None = None) -> str | None:
    """None when `workspace` may be an agent's workspace, else why not.

    An existing absolute folder; not `/`; not the user's home or a folder holding it; not inside, holding or
    equal to proctor's state dir (`home`, default `$PROCTOR_HOME`) or proctor's installed code.
    """
    if not os.path.isabs(workspace):
        return f"workspace {workspace!r} is not an absolute path"
    try:
        real = Path(os.path.realpath(workspace))
    except (OSError, ValueError) as exc:
        return f"workspace {workspace!r} cannot be resolved: {exc}"
    if not real.is_dir():
        return f"workspace {workspace!r} is not an existing folder"
    if real == Path("/"):
        return "workspace is the filesystem root"
    user_home = Path(os.path.realpath(Path.home()))
    if user_home.is_relative_to(real):
        return f"workspace {str(real)!r} is the home folder or holds it"
    state = Path(os.path.realpath(home or proctor_home()))
    if _related(real, state):
        return f"workspace {str(real)!r} is, holds or is inside proctor's state dir {str(state)!r}"
    code = Path(os.path.realpath(Path(__file__).resolve().parents[2]))  # proctor's installed package
    if _related(real, code):
        return f"workspace {str(real)!r} is, holds or is inside proctor's installed code {str(code)!r}"
    return None
