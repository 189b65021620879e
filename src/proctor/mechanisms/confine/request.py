"""The values that cross the confine seam: what a job may touch, the plan to spawn, and a refusal.

Owns the three frozen shapes. It never inspects the machine or builds an argv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from proctor.contract import Code

Confinement = Literal["bwrap+landlock", "landlock", "bwrap", "none"]


@dataclass(frozen=True)
class ConfineRequest:
    """One job's filesystem and network allowance. Every path is absolute and already exists.

    Writable: `worktree`, `git_paths` (the job's own git metadata), `tmpdir`, `state_dirs` (an adapter's
    declared CLI state, e.g. ~/.codex). Everything else is read-only; `readonly` names the paths that must
    stay so even where they sit inside a writable root or under a private tmpfs (/tmp, /run, /var/tmp).
    `hidden` may not even be read: $PROCTOR_HOME holds the queue's signing keys and the ledger.
    """

    worktree: Path
    git_paths: tuple[Path, ...]
    readonly: tuple[Path, ...]
    tmpdir: Path
    state_dirs: tuple[Path, ...] = ()
    network: bool = False
    hidden: tuple[Path, ...] = ()
    # With `network`: the host's egress proxy (confine/egress.py) listening on this Unix socket becomes the
    # agent's only way out; `egress` names the hosts it allows, for the plan's details and gaps only (the
    # proxy enforces them). None keeps the old meaning of network = True: the whole network, reported as such.
    egress_socket: Path | None = None
    egress: tuple[str, ...] = ()
    # (source, target) pairs: `source` (a directory outside the writable roots, e.g. the main checkout's
    # node_modules) appears read-only at `target` (inside the worktree). bwrap binds it; without bwrap the
    # caller links it instead (proctor.mechanisms.validation.environment), and Landlock keeps the source read-only.
    ro_binds: tuple[tuple[Path, Path], ...] = ()

    @property
    def writable(self) -> tuple[Path, ...]:
        return (self.worktree, *self.git_paths, self.tmpdir, *self.state_dirs)


@dataclass(frozen=True)
class ConfinePlan:
    """What to spawn: `argv` (shell=False, cwd = the worktree) with `env` merged over the job's env."""

    argv: list[str]
    env: dict[str, str]
    confinement: Confinement
    details: dict[str, Any] = field(default_factory=dict)
    gaps: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Unavailable:
    """Confinement as asked cannot be had; nothing may be launched."""

    reason: str
    code: Code = Code.CONFINEMENT_UNAVAILABLE
