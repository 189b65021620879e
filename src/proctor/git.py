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
# GIT_* variables that redirect git; never inherited by host-side git nor handed to an agent.
REDIRECTING_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
                   "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES",
                   "GIT_CONFIG", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_COUNT",
                   "GIT_CONFIG_PARAMETERS", "GIT_EXEC_PATH", "GIT_TEMPLATE_DIR")
SAFE_CONFIG = (
    "-c", "core.hooksPath=/dev/null",
    # A nested repo the agent planted (a gitlink) would otherwise be entered to see if it is dirty, which
    # reads that repo's own config, filters included: code execution on the host (found in review,
    # reproduced). "dirty" keeps the gitlink itself listed but never looks inside its work tree.
    "-c", "diff.ignoreSubmodules=dirty",
    "-c", "submodule.recurse=false",
    "-c", "status.submoduleSummary=false",
    "-c", "core.fsmonitor=false",
    "-c", "core.untrackedCache=false",
    "-c", "diff.external=",
    "-c", "protocol.allow=never",
    "-c", "core.quotePath=false",
)
GIT_TIMEOUT_S = 120


def unredirected_env() -> dict[str, str]:
    """This process's environment without the GIT_* variables that would point git somewhere else:
    the base for host-side git and for every agent (a CI's exported GIT_DIR would aim it at the main repo)."""
    return {k: v for k, v in os.environ.items() if k not in REDIRECTING_ENV and not k.startswith("GIT_CONFIG_")}


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
    common_dir: Path | None = None,
    index_file: Path | None = None,
    timeout: float = GIT_TIMEOUT_S,
) -> GitResult:
    """Run host-side git. `common_dir` pins the shared .git of a linked worktree (the `commondir` file in
    its metadata is agent-writable under some confinements; the variable beats the file); `index_file`
    points git at a private index instead of the agent's."""
    cmd = ["git", *SAFE_CONFIG]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    if work_tree is not None:
        cmd += ["--work-tree", str(work_tree)]
    cmd += list(args)
    env = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    full_env = unredirected_env()
    full_env.update(env)
    if common_dir is not None:
        full_env["GIT_COMMON_DIR"] = str(common_dir)
    if index_file is not None:
        full_env["GIT_INDEX_FILE"] = str(index_file)
    try:
        p = subprocess.run(
            cmd, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout
        )
    except FileNotFoundError:
        return GitResult(127, b"", "git is not installed")
    except (OSError, ValueError) as exc:  # an unusable cwd, a NUL byte in an argument
        return GitResult(126, b"", f"git could not be run: {exc}")
    except subprocess.TimeoutExpired:
        return GitResult(124, b"", f"git {' '.join(args[:2])} timed out after {timeout:.0f}s")
    return GitResult(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace").strip())


def parse_status_v2_z(raw: bytes) -> list[str]:
    """Changed paths from `git status --porcelain=v2 -z`: both index sides, untracked, both sides of a
    rename, any bytes in a name (NUL-separated). A nested repo's trailing `/` is dropped."""
    fields = raw.split(b"\0")
    out: list[str] = []
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        kind = entry[:1]
        if kind in (b"?", b"!"):
            out.append(_path(entry[2:]).rstrip("/"))
        elif kind == b"1":  # 1 XY sub mH mI mW hH hI path
            out.append(_path(entry.split(b" ", 8)[8]))
        elif kind == b"2":  # 2 XY sub mH mI mW hH hI Xscore path NUL origPath
            out.append(_path(entry.split(b" ", 9)[9]))
            if i < len(fields):
                out.append(_path(fields[i]))
                i += 1
        elif kind == b"u":  # u XY sub m1 m2 m3 mW h1 h2 h3 path
            out.append(_path(entry.split(b" ", 10)[10]))
    return out


def _path(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")
