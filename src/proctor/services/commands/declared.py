"""Declared writes: check 4 (what a request says it will change) and, after the run, what it did not declare.

Owns turning `expected_writes` into a set of project paths (files, and folders written `dir/`), refusing any
outside the project, in the control plane, or admitted by neither the entry's `writes` nor the agent's
`write_scopes`; and deciding which observed changes that set does not cover. It never walks the tree
(snapshot does) and never runs anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proctor.services.commands import globs
from proctor.services.commands.controlplane import ControlPlane, real
from proctor.services.commands.errors import ProposalError, RequestCode


@dataclass(frozen=True)
class DeclaredWrites:
    files: frozenset[str]
    folders: tuple[str, ...]
    """Folders whose whole content is declared (`.` never: the project root holds `.git`)."""

    def covers(self, path: str, *, is_folder: bool) -> bool:
        if path in self.files:
            return True
        if any(path == f or path.startswith(f + "/") for f in self.folders):
            return True
        # A folder created or removed on the way to a declared path is part of that write.
        return is_folder and any(p.startswith(path + "/") for p in (*self.files, *self.folders))

    def undeclared(self, changed: Iterable[str], folders: frozenset[str]) -> list[str]:
        return sorted(p for p in changed if not self.covers(p, is_folder=p in folders))


def declare(expected: Sequence[str], *, allowed: Sequence[str], plane: ControlPlane) -> DeclaredWrites:
    """Check 4. `allowed` is the entry's `writes` plus the agent's `write_scopes` (globs)."""
    files: set[str] = set()
    folders: list[str] = []
    for raw in expected:
        is_folder = raw.endswith("/")
        resolved = real(plane.project / raw)
        rel = plane.relative(resolved)
        if rel is None:
            raise ProposalError(
                RequestCode.WRITE_OUTSIDE_PROJECT, f"expected write {raw!r} resolves to {resolved}, outside the project"
            )
        protected = plane.overlaps(resolved) if is_folder else plane.is_protected(resolved)
        if protected or rel == ".":
            raise ProposalError(
                RequestCode.WRITE_IN_CONTROL_PLANE,
                f"expected write {raw!r} is or holds part of the control plane (proctor state, ledger, "
                "allowlist, briefs, .git); no command may write there",
            )
        if is_folder:
            ok = any(globs.covers_folder(g, rel) for g in allowed)
        else:
            ok = any(globs.matches(g, rel) for g in allowed)
        if not ok:
            shape = "everything under folder" if is_folder else "path"
            raise ProposalError(
                RequestCode.WRITE_NOT_ALLOWED,
                f"expected write {raw!r}: {shape} {rel!r} is admitted by none of the entry's writes or the "
                f"agent's write scopes {list(allowed)}",
            )
        if is_folder:
            folders.append(rel)
        else:
            files.add(rel)
    return DeclaredWrites(frozenset(files), tuple(folders))
