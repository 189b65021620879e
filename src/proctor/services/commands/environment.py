"""What a command's process is given: a scrubbed environment and the resolved program path.

Owns the variable allowlist (an allowlist, not a denylist: a secret with a new name never leaks) and finding
the program on a PATH of absolute folders outside the project. It never spawns anything.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from proctor.services.commands.allowlist import Entry
from proctor.services.commands.controlplane import ControlPlane, real
from proctor.services.commands.errors import ProposalError, RequestCode

SAFE_ENV = ("HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LOGNAME", "TERM", "TZ", "USER")


def safe_path(raw: str, plane: ControlPlane) -> str:
    """PATH with only absolute folders outside the project: a relative or in-project entry lets the agent
    plant the program the allowlist names."""
    keep: list[str] = []
    for d in raw.split(os.pathsep):
        if d and os.path.isabs(d) and plane.relative(real(d)) is None and d not in keep:
            keep.append(d)
    return os.pathsep.join(keep)


def scrubbed_env(entry: Entry, plane: ControlPlane, source: Mapping[str, str] | None = None) -> dict[str, str]:
    src = os.environ if source is None else source
    env = {k: src[k] for k in (*SAFE_ENV, *entry.env_pass) if k in src}
    env["PATH"] = safe_path(src.get("PATH", os.defpath), plane)
    env.update(entry.env)
    return env


def resolve_program(program: str, path: str, plane: ControlPlane, cwd: Path) -> Path:
    """The program as it will be executed (absolute, not resolved through symlinks: a venv's python must
    keep its own path); refused when it, or what it links to, lies inside the project."""
    if os.path.isabs(program):
        found: str | None = program if os.access(program, os.X_OK) and os.path.isfile(program) else None
    elif "/" in program:
        found = str(cwd / program)
    else:
        found = shutil.which(program, path=path)
    if found is None:
        raise ProposalError(
            RequestCode.PROGRAM_NOT_FOUND, f"program {program!r} is not an executable on the scrubbed PATH {path!r}"
        )
    where = Path(os.path.abspath(found))
    if plane.relative(where) is not None or plane.relative(real(where)) is not None:
        raise ProposalError(
            RequestCode.PROGRAM_IN_PROJECT,
            f"program {program!r} is {where}, inside the project, where the agent could have written it",
        )
    return where
