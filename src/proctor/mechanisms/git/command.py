"""Host-side git: every git command the host itself runs, reading only configuration the host chose.

Owns running git safely and parsing what the host reads back. It never runs a git command inside the
agent's process tree, and never lets git read a config file the agent or the repo's content could have
written.

Why a whitelist of config sources and not a list of `-c` overrides (DESIGN.md 9a): an override list is a
blacklist, and every key it misses is code execution on the host. In review an agent got its clean filter
run through a `config.worktree` the host's git honoured, and through a nested repo's own config reached
by submodule descent, past `-c diff.ignoreSubmodules=dirty`. So host-side git reads no system or global
config (GIT_CONFIG_NOSYSTEM, GIT_CONFIG_GLOBAL=/dev/null, a HOME that cannot exist), and after an agent ran the host
never points git at a git dir the agent could write: it inspects the agent's files through a git dir of
its own (proctor.mechanisms.git.landing), whose config it wrote. What git then reads from the agent's tree is data to
it: `.gitattributes` naming a filter with no driver in any config it reads is a no-op, `.gitignore`
only decides what is left out. The `-c` switches below stay as a second layer.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# GIT_* variables that redirect git; never inherited by host-side git nor handed to an agent.
REDIRECTING_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
                   "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES",
                   "GIT_CONFIG", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_COUNT",
                   "GIT_CONFIG_PARAMETERS", "GIT_EXEC_PATH", "GIT_TEMPLATE_DIR")
SAFE_CONFIG = (
    "-c", "core.hooksPath=/dev/null",
    # Never enter a nested repo: its own config (filters included) is the agent's (found in review).
    "-c", "diff.ignoreSubmodules=all",
    "-c", "submodule.recurse=false",
    "-c", "status.submoduleSummary=false",
    "-c", "core.fsmonitor=false",
    "-c", "core.untrackedCache=false",
    "-c", "diff.external=",
    "-c", "protocol.allow=never",
    "-c", "core.quotePath=false",
    "-c", "core.attributesFile=/dev/null",
    "-c", "core.excludesFile=/dev/null",
    # The host reads the user's own repo (whoever owns it) and git dirs it made itself; ownership checks
    # guard against reading an untrusted config, which the host never does.
    "-c", "safe.directory=*",
)
GIT_TIMEOUT_S = 120
# For paths read from a tree (or named by an agent): a path is a path, never a glob or pathspec magic.
LITERAL_PATHS = {"GIT_LITERAL_PATHSPECS": "1"}


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


def nul_terminated(items: Sequence[str]) -> bytes:
    """Paths or index lines as git's `-z --stdin` reads them: each one ended by a NUL."""
    return b"".join(i.encode("utf-8", "surrogateescape") + b"\0" for i in items)


# Host-side git's HOME and XDG_CONFIG_HOME: a path beneath a character device, which nobody (root
# included) can ever create, so git finds no ~/.gitconfig, ~/.config/git/* nor XDG file there, and
# reads ENOTDIR as "missing" without a warning. A made empty dir did the same at the cost of a mkdtemp
# per process, and every proctor process killed before its exit hook left one in /tmp.
NO_HOME = "/dev/null/proctor-git-home"


def git(
    args: Sequence[str],
    *,
    cwd: Path | None = None,
    git_dir: Path | None = None,
    work_tree: Path | None = None,
    index_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    input_bytes: bytes | None = None,
    timeout: float = GIT_TIMEOUT_S,
    umask: int | None = None,
) -> GitResult:
    """Run host-side git with no system or global config; `index_file` points git at a private index.
    `umask`: the child's (a checkout the host makes gets git's modes, 0644/0755, whatever the user's umask)."""
    cmd = ["git", *SAFE_CONFIG]
    if git_dir is not None:
        cmd += ["--git-dir", str(git_dir)]
    if work_tree is not None:
        cmd += ["--work-tree", str(work_tree)]
    cmd += list(args)
    full_env = unredirected_env()
    home = NO_HOME
    full_env.update({"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C",
                     "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": home,
                     "XDG_CONFIG_HOME": home, "GIT_ATTR_NOSYSTEM": "1"})
    full_env.pop("GIT_ASKPASS", None)
    full_env.pop("SSH_ASKPASS", None)
    if index_file is not None:
        full_env["GIT_INDEX_FILE"] = str(index_file)
    full_env.update(env or {})
    try:
        # A group of its own: a terminal's Ctrl-C is the CLI's to turn into CANCELLED, not a git failure.
        p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, timeout=timeout, process_group=0,
                           umask=-1 if umask is None else umask,
                           **({"input": input_bytes} if input_bytes is not None else {"stdin": subprocess.DEVNULL}))
    except FileNotFoundError:
        return GitResult(127, b"", "git is not installed")
    except (OSError, ValueError) as exc:  # an unusable cwd, a NUL byte in an argument
        return GitResult(126, b"", f"git could not be run: {exc}")
    except subprocess.TimeoutExpired:
        return GitResult(124, b"", f"git {' '.join(args[:2])} timed out after {timeout:.0f}s")
    return GitResult(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace").strip())
