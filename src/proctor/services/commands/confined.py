"""Check 5: a command that must run confined gets an OS-enforced plan, or is refused; nothing runs unconfined.

Owns turning an allowlist entry into a `proctor.mechanisms.confine.ConfineRequest` whose only writable places are the
entry's write roots and a private temp folder, with the network off, and into the argv the runner spawns.
It never spawns and never weakens: an unavailable confiner is a refusal, not a fallback.

The confine seam is shaped for agent jobs: its `worktree` is both writable and where bwrap starts. A command's
cwd is usually not writable, so the private temp folder plays `worktree` and `env -C` moves the program into
the pinned cwd. (A `cwd` field on ConfineRequest would remove that hop; left to the confine owner.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.services.commands import globs
from proctor.services.commands.allowlist import Entry
from proctor.services.commands.controlplane import ControlPlane, real
from proctor.services.commands.errors import ProposalError, RequestCode
from proctor.mechanisms.confine import ConfineRequest, Confiner, Unavailable, choose, detect, refuse_hard_links


@dataclass(frozen=True)
class ConfinedRun:
    argv: list[str]
    env: dict[str, str]
    confinement: str
    details: dict[str, Any] = field(default_factory=dict)
    gaps: list[str] = field(default_factory=list)
    tmpdir: Path | None = None
    """Private temp folder to remove after the run."""


def write_roots(entry: Entry, plane: ControlPlane) -> list[Path]:
    """The folders (or files) the entry's `writes` globs can reach: each glob's literal root."""
    return sorted({real(plane.project / globs.literal_root(g)) for g in entry.writes})


@dataclass(frozen=True)
class Grant:
    """Check 5 passed: the confiner to use and the write roots it will grant."""

    confiner: Confiner
    roots: tuple[Path, ...]


def check(entry: Entry, program: Path, plane: ControlPlane, *, confine: bool) -> Grant | None:
    """Check 5. None: run unconfined (allowed only when not asked and the entry does not require it)."""
    profile = entry.confinement
    if not confine:
        if profile.required:
            raise ProposalError(
                RequestCode.CONFINEMENT_REQUIRED, f"entry {entry.name!r} may only run confined; ask with confine"
            )
        return None
    if profile.profile != "confined":
        raise ProposalError(
            RequestCode.CONFINEMENT_NOT_CONFIGURED, f"entry {entry.name!r} has no confined profile to run under"
        )
    prog = real(program)
    if not any(prog.is_relative_to(real(p)) for p in profile.exec_paths):
        raise ProposalError(
            RequestCode.PROGRAM_OUTSIDE_EXEC_PATHS,
            f"program {program} (really {prog}) lies outside the profile's exec paths {profile.exec_paths}",
        )
    roots = write_roots(entry, plane)
    for root in roots:
        if plane.relative(root) is None:  # e.g. `build -> /outside` planted before asking
            raise ProposalError(
                RequestCode.WRITE_ROOT_PROTECTED,
                f"write root {root} of entry {entry.name!r} resolves outside the project {plane.project}",
            )
        if plane.overlaps(root):
            raise ProposalError(
                RequestCode.WRITE_ROOT_PROTECTED,
                f"write root {root} of entry {entry.name!r} holds or lies in the control plane",
            )
        if root.is_dir():
            links = refuse_hard_links(root)
            if links:
                raise ProposalError(
                    RequestCode.WRITE_ROOT_PROTECTED,
                    f"write root {root} holds hard-linked files {links[:5]}: writable through to wherever "
                    "else they are linked",
                )
    missing = [str(r) for r in roots if not os.path.lexists(r)]
    if missing:
        raise ProposalError(
            RequestCode.CONFINEMENT_UNAVAILABLE,
            f"write roots {missing} do not exist; a bind mount or Landlock rule needs an existing path "
            "(create them first)",
        )
    confiner = choose("required", detect())
    if isinstance(confiner, Unavailable):
        raise ProposalError(RequestCode.CONFINEMENT_UNAVAILABLE, confiner.reason)
    return Grant(confiner, tuple(roots))


def wrap(grant: Grant, program: Path, argv: Sequence[str], cwd: Path, plane: ControlPlane,
         hidden: Sequence[Path] = (), readable: Sequence[Path] = ()) -> ConfinedRun:
    """The confined argv and env; the caller removes `tmpdir` after the run. `hidden` may not even be read
    (isolation.hidden_paths): a read-only bind of a protected path inside one would show it again."""
    tmpdir = Path(tempfile.mkdtemp(prefix="proctor-cmd-"))
    readonly = tuple(p for p in (plane.project, *plane.protected, *readable) if os.path.lexists(p)
                     and not any(p == h or p.is_relative_to(h) for h in hidden))
    req = ConfineRequest(
        worktree=tmpdir, git_paths=(), readonly=readonly, tmpdir=tmpdir, state_dirs=grant.roots, network=False,
        hidden=tuple(hidden),
    )
    env_prog = shutil.which("env", path=os.defpath) or "/usr/bin/env"
    wrapped = grant.confiner.wrap([env_prog, "-C", str(cwd), str(program), *argv[1:]], req)
    if isinstance(wrapped, Unavailable):
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise ProposalError(RequestCode.CONFINEMENT_UNAVAILABLE, wrapped.reason)
    return ConfinedRun(wrapped.argv, wrapped.env, wrapped.confinement, wrapped.details, wrapped.gaps, tmpdir)
