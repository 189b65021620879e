"""Host-side git: every git command the host itself runs, with the repo's own hooks and helpers disabled.

Owns running git safely and parsing what the host reads back (`status --porcelain -z`, `diff --name-status -z`).
It never runs a git command inside the agent's process tree, and never trusts a config the agent could write:
an agent can edit a worktree's files (including `config.worktree` and the `.git` pointer), so hooks,
fsmonitor and similar executable hooks are switched off on the command line, which beats any config file.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Command-line config beats every config file: nothing the agent wrote can make host-side git run code.
SAFE_CONFIG = (
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "core.untrackedCache=false",
    "-c", "diff.external=",
    "-c", "protocol.allow=never",
    "-c", "core.quotePath=false",
)
GIT_TIMEOUT_S = 120


@dataclass(frozen=True)
class GitResult:
    code: int
    out: bytes
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def text(self) -> str:
        return self.out.decode("utf-8", "replace").strip()


def git(
    args: Sequence[str],
    *,
    cwd: Path | None = None,
    git_dir: Path | None = None,
    work_tree: Path | None = None,
    timeout: float = GIT_TIMEOUT_S,
) -> GitResult:
    cmd = ["git", *SAFE_CONFIG]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    if work_tree is not None:
        cmd += ["--work-tree", str(work_tree)]
    cmd += list(args)
    env = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    full_env = {**os.environ, **env}
    for leak in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_CEILING_DIRECTORIES"):
        full_env.pop(leak, None)
    try:
        p = subprocess.run(
            cmd, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout
        )
    except FileNotFoundError:
        return GitResult(127, b"", "git is not installed")
    except subprocess.TimeoutExpired:
        return GitResult(124, b"", f"git {' '.join(args[:2])} timed out after {timeout:.0f}s")
    return GitResult(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace").strip())


def parse_status_v2_z(raw: bytes) -> tuple[str | None, list[str]]:
    """HEAD's sha and the changed paths from `git status --porcelain=v2 -z --branch`.

    Untracked included, both sides of a rename, spaces and newlines in names safe (NUL-separated).
    """
    fields = raw.split(b"\0")
    head: str | None = None
    out: list[str] = []
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if not entry:
            continue
        kind = entry[:1]
        if kind == b"#":
            if entry.startswith(b"# branch.oid "):
                head = entry[len(b"# branch.oid "):].decode()
            continue
        if kind in (b"?", b"!"):
            out.append(_path(entry[2:]))
        elif kind == b"1":  # 1 XY sub mH mI mW hH hI path
            out.append(_path(entry.split(b" ", 8)[8]))
        elif kind == b"2":  # 2 XY sub mH mI mW hH hI Xscore path NUL origPath
            out.append(_path(entry.split(b" ", 9)[9]))
            if i < len(fields):
                out.append(_path(fields[i]))
                i += 1
        elif kind == b"u":  # u XY sub m1 m2 m3 mW h1 h2 h3 path
            out.append(_path(entry.split(b" ", 10)[10]))
    return head, out


def _path(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def parse_name_status_z(raw: bytes) -> list[str]:
    """Paths from `git diff --name-status -z`: status field, then one path (two for R/C)."""
    fields = raw.split(b"\0")
    out: list[str] = []
    i = 0
    while i < len(fields):
        status = fields[i]
        i += 1
        if not status:
            continue
        n = 2 if status[:1] in (b"R", b"C") else 1
        for _ in range(n):
            if i < len(fields):
                # A copy's source is unchanged; a rename's source is gone, so both count.
                if status[:1] != b"C" or _ == 1:
                    out.append(_path(fields[i]))
                i += 1
    return out
