"""The trust line, drawn by what runs or is read as instructions outside the tests (issue 39): a changed path
that something other than the test run will execute or obey, named with what does.

    crossing(paths, hooks_path=None, named=()) -> [(path, what)]

git hooks (the repo's `core.hooksPath` target, `.husky/`, `.githooks/`, pre-commit and lefthook configs, git
attributes and submodules), CI (GitHub, GitLab, CircleCI, Azure, Jenkins, Travis, Buildkite, Drone,
Woodpecker, Bitbucket, AppVeyor), what a shell or editor runs on its own (`.envrc`, `.env`, editor tasks and
launch configs, devcontainers, Gitpod), the files the next coding agent reads as its instructions (`AGENTS.md`,
`CLAUDE.md`, `GEMINI.md`, `.cursorrules`, Copilot's, Windsurf's, Cline's, the CLIs' project settings), and
proctor's own `.proctor.toml` with the scripts it names (`named`). A change to one lands with no test to
catch it and runs as the person (a rewritten `.husky/pre-commit` at their next `git commit`). It judges
paths only, never reads a file.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

from proctor.mechanisms.git.command import git

# (what runs or reads it, glob patterns matched against the whole path; a bare name matches at any depth)
LINES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("a git hook", (".husky/*", ".githooks/*", ".git-hooks/*", ".pre-commit-config.yaml", ".pre-commit-hooks.yaml",
                    "lefthook.yml", ".lefthook.yml", "lefthook-local.yml", "lefthook.yaml", ".lefthook.yaml",
                    ".gitattributes", ".gitmodules", ".lfsconfig")),
    ("CI", (".github/workflows/*", ".github/actions/*", ".gitlab-ci.yml", ".gitlab/ci/*", ".circleci/*",
            "azure-pipelines.yml", ".azure-pipelines/*", "Jenkinsfile", ".travis.yml", ".buildkite/*", ".drone.yml",
            ".woodpecker.yml", ".woodpecker/*", "bitbucket-pipelines.yml", "appveyor.yml", ".appveyor.yml",
            ".github/dependabot.yml", "renovate.json", ".renovaterc*")),
    ("a shell or editor runs it", (".envrc", ".env", ".env.*", ".vscode/tasks.json", ".vscode/launch.json",
                                   ".vscode/settings.json", ".vscode/extensions.json", ".idea/runConfigurations/*",
                                   ".idea/workspace.xml", ".devcontainer/*", ".devcontainer.json", ".gitpod.yml",
                                   ".gitpod.Dockerfile", ".replit", "flake.nix", "shell.nix", ".tool-versions",
                                   ".mise.toml", "mise.toml", ".nvmrc", ".python-version")),
    ("an agent's instructions", ("AGENTS.md", "AGENT.md", "CLAUDE.md", "CLAUDE.local.md", "GEMINI.md", ".cursorrules",
                                 ".cursor/*", ".windsurfrules", ".windsurf/*", ".clinerules", ".clinerules/*",
                                 ".github/copilot-instructions.md", ".github/instructions/*", ".github/prompts/*",
                                 ".claude/*", ".gemini/*", ".codex/*", ".opencode/*", "opencode.json",
                                 ".aider.conf.yml", ".aiderignore", ".continue/*", ".roo/*", ".roomodes")),
    ("proctor's own settings", (".proctor.toml",)),
)
ANY_DEPTH = frozenset({"AGENTS.md", "AGENT.md", "CLAUDE.md", "CLAUDE.local.md", "GEMINI.md", ".gitattributes",
                       ".envrc", ".env", ".cursorrules"})


def _match(path: str, pattern: str) -> bool:
    if pattern.endswith("/*"):
        return path.startswith(pattern[:-1])
    if "/" in pattern:
        return fnmatch.fnmatchcase(path, pattern)
    name = PurePosixPath(path).name
    if pattern in ANY_DEPTH or any(ch in pattern for ch in "*?"):
        return fnmatch.fnmatchcase(name, pattern) and (pattern in ANY_DEPTH or "/" not in path)
    return path == pattern


def crossing(paths: Iterable[str], hooks_path: str | None = None, named: Sequence[str] = ()) -> list[tuple[str, str]]:
    """The changed `paths` across the trust line, each with what runs or reads it. `hooks_path`: the main
    repo's `core.hooksPath` when it is inside the repo (relative); `named`: the scripts `.proctor.toml`'s
    validate and setup run."""
    hooks = (hooks_path or "").strip().strip("/")
    out = []
    for path in dict.fromkeys(paths):
        what = None
        if hooks and (path == hooks or path.startswith(hooks + "/")):
            what = "a git hook (core.hooksPath)"
        elif path in named:
            what = "proctor's own settings (a script .proctor.toml runs)"
        else:
            what = next((w for w, patterns in LINES if any(_match(path, p) for p in patterns)), None)
        if what is not None:
            out.append((path, what))
    return out


def hooks_path(repo: Path) -> str | None:
    """The main repo's `core.hooksPath`, relative to its checkout when it lies inside (husky sets `.husky`)."""
    res = git(["config", "--get", "core.hooksPath"], cwd=repo)
    raw = res.text.strip() if res.ok else ""
    if not raw:
        return None
    p = Path(os.path.normpath(Path(raw).expanduser() if Path(raw).expanduser().is_absolute() else repo / raw))
    return p.relative_to(repo).as_posix() if p.is_relative_to(repo) and p != repo else None


def say(crossed: Sequence[tuple[str, str]], most: int = 6) -> str:
    shown = ", ".join(f"{p} ({w})" for p, w in crossed[:most])
    return shown + (f" (+{len(crossed) - most} more)" if len(crossed) > most else "")
