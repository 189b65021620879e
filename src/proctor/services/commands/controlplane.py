"""The control plane of a command run: the paths no command may write, and fingerprints that catch a change.

Owns which paths are protected (proctor's state dir, the ledger and its WAL and head, the allowlist file, the
briefs it names, `.git` and the repo's git dirs), resolving a candidate path against them, and the
`(size, mtime_ns, ctime_ns, ino)` fingerprint of the files whose change means tampering. ctime is in the
fingerprint because a user cannot set it (os.utime restores mtime, never ctime): research/aesthetics.md.
It never writes anything and never decides a request.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# None: the path does not exist (a created or deleted control file is a change, too).
Fingerprint = tuple[int, int, int, int] | None


def real(path: str | os.PathLike[str]) -> Path:
    """The absolute path with every symlink followed (missing tails kept as written)."""
    return Path(os.path.realpath(path))


@dataclass(frozen=True)
class ControlPlane:
    project: Path
    """The project's real path."""
    protected: tuple[Path, ...]
    """Real paths no command may write; each covers everything under it."""
    tamper_files: tuple[Path, ...]
    """Files whose change during a run means tampering: ledger, WAL, head, allowlist, briefs, and the home's
    signers.toml, keys/, config.toml, policy.toml and commands.toml."""

    def relative(self, path: Path) -> str | None:
        """The project-relative posix form of a real path (`.` for the root), None when outside."""
        if path == self.project:
            return "."
        if not path.is_relative_to(self.project):
            return None
        return path.relative_to(self.project).as_posix()

    def is_protected(self, path: Path) -> bool:
        rel = self.relative(path)
        if rel is not None and ".git" in rel.split("/"):
            return True  # any repo's metadata, nested ones included
        return any(path == p or path.is_relative_to(p) for p in self.protected)

    def overlaps(self, root: Path) -> bool:
        """Whether a writable root holds, or lies inside, a protected path."""
        if self.is_protected(root):
            return True
        return any(p.is_relative_to(root) for p in self.protected)

    def with_git_dirs(self, dirs: Iterable[Path]) -> ControlPlane:
        extra = tuple(d for d in dirs if d not in self.protected)
        return ControlPlane(self.project, self.protected + extra, self.tamper_files)


def build(
    project: Path,
    *,
    home: Path,
    ledger_files: Iterable[Path],
    policy_source: Path | None,
    briefs: Iterable[str],
) -> ControlPlane:
    """The control plane before git is asked anything: `.git` is covered by name, its real dirs come later."""
    proj = real(project)
    tamper = [real(p) for p in ledger_files]
    if policy_source is not None:
        tamper.append(real(policy_source))
    tamper.extend(real(p) for p in _home_files(home))
    for brief in briefs:
        tamper.append(real(brief if os.path.isabs(brief) else proj / brief))
    protected = [real(home), proj / ".git", *tamper]
    return ControlPlane(proj, tuple(dict.fromkeys(protected)), tuple(dict.fromkeys(tamper)))


# Proctor's own trust and configuration in its home (pinned and put back after every run, pins.py).
HOME_CONTROL_FILES = ("signers.toml", "config.toml", "policy.toml", "commands.toml", "keys")


def _home_files(home: Path) -> list[Path]:
    """Proctor's own trust and configuration in its home: who may sign, its keys, its config and policy, the
    default allowlist. `keys` itself too: its ctime moves when a key file is added or removed."""
    files = [home / n for n in HOME_CONTROL_FILES if n != "keys"]
    keys = home / "keys"
    files.append(keys)
    try:
        files.extend(sorted(keys / n for n in os.listdir(keys)))
    except OSError:
        pass
    return files


def fingerprint(path: Path) -> Fingerprint:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def fingerprints(paths: Iterable[Path]) -> dict[Path, Fingerprint]:
    return {p: fingerprint(p) for p in paths}


def changed(before: Mapping[Path, Fingerprint], after: Mapping[Path, Fingerprint]) -> list[str]:
    return sorted(str(p) for p in before.keys() | after.keys() if before.get(p) != after.get(p))
