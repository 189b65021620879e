"""The trust line, drawn by what runs or is read as instructions outside the tests (issue 39): a changed path
that something other than the test run will execute or obey, named with what does.

    crossing(paths, hooks_path=None, named=()) -> [(path, what)]

git hooks (the repo's `core.hooksPath` target, `.husky/`, `.githooks/`, pre-commit and lefthook configs, git
attributes and submodules), CI (GitHub, GitLab, CircleCI, Azure, Jenkins, Travis, Buildkite, Drone,
Woodpecker, Bitbucket, AppVeyor), what a shell or editor runs on its own (`.envrc`, `.env`, editor tasks and
launch configs, devcontainers, Gitpod), what a package manager runs at install (`.npmrc`, yarn's and pnpm's
hooks, `setup.py`, package.json's install scripts), the files the next coding agent reads as its
instructions (`AGENTS.md`, `CLAUDE.md`, `GEMINI.md`, `.cursorrules`, Copilot's, Windsurf's, Cline's, the
CLIs' project settings) and the tools it is given (`.mcp.json`), and proctor's own `.proctor.toml` with the
scripts it names (`named`). A change to one lands with no test to catch it and runs as the person (a
rewritten `.husky/pre-commit` at their next `git commit`). It judges paths, and of package.json the
install scripts only (`versions`); it never runs anything.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable, Iterable, Sequence
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
                                   ".mise.toml", "mise.toml", ".nvmrc", ".python-version", "*.code-workspace",
                                   ".zed/*")),
    ("a package manager runs it at install", (".npmrc", ".yarnrc", ".yarnrc.yml", ".pnpmfile.cjs", ".pnpmfile.mjs",
                                              ".yarn/plugins/*", ".yarn/releases/*", "setup.py")),
    ("an agent's tools (MCP servers)", (".mcp.json", ".vscode/mcp.json", ".cursor/mcp.json")),
    ("an agent's instructions", ("AGENTS.md", "AGENT.md", "CLAUDE.md", "CLAUDE.local.md", "GEMINI.md", ".cursorrules",
                                 ".cursor/*", ".windsurfrules", ".windsurf/*", ".clinerules", ".clinerules/*",
                                 ".github/copilot-instructions.md", ".github/instructions/*", ".github/prompts/*",
                                 ".claude/*", ".gemini/*", ".codex/*", ".opencode/*", "opencode.json",
                                 ".aider.conf.yml", ".aiderignore", ".continue/*", ".roo/*", ".roomodes")),
    ("proctor's own settings", (".proctor.toml",)),
)
# Read wherever they sit: an agent reads the instructions of the directory it works in, direnv and dotenv
# the `.env` of the directory a command starts in.
ANY_DEPTH = frozenset({"AGENTS.md", "AGENT.md", "CLAUDE.md", "CLAUDE.local.md", "GEMINI.md", ".gitattributes",
                       ".envrc", ".env", ".env.*", ".cursorrules", "*.code-workspace"})
# Templates of an environment, read by a person, never loaded.
TEMPLATES = frozenset({".env.example", ".env.sample", ".env.template", ".env.dist", ".env.defaults.example"})
# npm's scripts run at the person's next `npm install` (of this package or by a dependent): package.json
# crosses when one of them changed.
LIFECYCLE = ("preinstall", "install", "postinstall", "prepare", "preprepare", "postprepare", "prepublish",
             "prepack", "postpack", "dependencies")


def _match(path: str, pattern: str) -> bool:
    if pattern.endswith("/*"):
        # The dir's files, or the dir itself (replaced by a link to somewhere else).
        return path.startswith(pattern[:-1]) or path == pattern[:-2]
    if "/" in pattern:
        # Or a dir on its way, replaced by a link (`.vscode` -> a dir holding a `tasks.json`: found in review).
        return fnmatch.fnmatchcase(path, pattern) or pattern.startswith(path + "/")
    name = PurePosixPath(path).name
    if name in TEMPLATES:
        return False
    if pattern in ANY_DEPTH or any(ch in pattern for ch in "*?"):
        return fnmatch.fnmatchcase(name, pattern) and (pattern in ANY_DEPTH or "/" not in path)
    return path == pattern


def lifecycle_changed(old: bytes | None, new: bytes | None) -> bool:
    """Whether a package.json's install-time scripts differ (a file that does not parse counts as changed)."""
    def scripts(raw: bytes | None) -> dict | None:
        if raw is None:
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        table = data.get("scripts") if isinstance(data, dict) else None
        return {k: table.get(k) for k in LIFECYCLE} if isinstance(table, dict) else {}
    a, b = scripts(old), scripts(new)
    return a is None or b is None or a != b


def crossing(paths: Iterable[str], hooks_path: str | None = None, named: Sequence[str] = (),
             versions: Callable[[str], tuple[bytes | None, bytes | None]] | None = None) -> list[tuple[str, str]]:
    """The changed `paths` across the trust line, each with what runs or reads it. `hooks_path`: the main
    repo's `core.hooksPath` when it is inside the repo (relative); `named`: the scripts `.proctor.toml`'s
    validate and setup run; `versions(path)`: a file's (base, job) bytes, for the files judged by what
    changed in them (package.json's install scripts; without it, any change to one crosses)."""
    hooks = (hooks_path or "").strip().strip("/")
    out = []
    for path in dict.fromkeys(paths):
        what = None
        if hooks and (path == hooks or path.startswith(hooks + "/")):
            what = "a git hook (core.hooksPath)"
        elif path in named:
            what = "proctor's own settings (a script .proctor.toml runs)"
        elif PurePosixPath(path).name == "package.json":
            if versions is None or lifecycle_changed(*versions(path)):
                what = "a package manager runs it at install (its install scripts changed)"
        else:
            what = next((w for w, patterns in LINES if any(_match(path, p) for p in patterns)), None)
        if what is not None:
            out.append((path, what))
    return out


def versions_in(git_dir: Path, base: str, commit: str) -> Callable[[str], tuple[bytes | None, bytes | None]]:
    """A file's bytes at `base` and at `commit`, from git objects (None: not there; past 1 MiB, bytes that
    parse as nothing)."""
    def read(rev: str, path: str) -> bytes | None:
        res = git(["cat-file", "blob", f"{rev}:{path}"], git_dir=git_dir)
        if not res.ok:
            return None
        # Past the cap it is not read, and so not known unchanged: bytes no parser takes (found in review: a
        # package.json padded past the cap read as absent, and its new postinstall as no change).
        return res.out if len(res.out) <= 1 << 20 else b"\0(over the cap)"
    return lambda path: (read(base, path), read(commit, path))


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
