"""The validation recipe is the base's: which changed files decide what validation runs.

    recipe_changes(commands, changed, runner) -> paths the agent changed that the recipe would run

A script named by `.proctor.toml`'s `validate`/`setup` (or by a request's command), the Makefiles, tox
and nox files, and for the runner in use its build scripts (`package.json` for npm, `build.rs` and
`.cargo/` for cargo): an agent that rewrote one chose its own verdict without touching a test (found in
review: a `validate` script rewritten to `exit 0`, a setup script that sent `.env` away). The host lays the
base's version of each into the validation checkout and names the change as a risk. What a script calls
in turn (another script, a Python helper) is not followed: such a file is only a risk when it is also
test-defining (proctor.job.frozen).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

ALWAYS = frozenset({"Makefile", "GNUmakefile", "makefile", "tox.ini", "noxfile.py", ".proctor.toml"})
BY_RUNNER = {
    "npm": ("package.json",),
    "cargo": ("build.rs",),
}


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return command.split()


def named_paths(commands: Iterable[str]) -> set[str]:
    """Every word of the commands that reads as a relative path (`./run.sh`, `scripts/test.sh`,
    `make -f ci.mk`'s `ci.mk`, `--rcfile=x.cfg`'s value)."""
    out = set()
    for command in commands:
        for word in _words(command):
            value = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
            if not value or value.startswith(("-", "/", "$", "~")) or "://" in value:
                continue
            p = PurePosixPath(value)
            if ".." in p.parts:
                continue
            out.add(p.as_posix())
    return out


def recipe_changes(commands: Sequence[str], changed: Iterable[str], runner: str | None = None) -> list[str]:
    named = named_paths(commands)
    extra = BY_RUNNER.get(runner or "", ())
    hits = []
    for path in changed:
        p = PurePosixPath(path)
        if (path in named or p.name in ALWAYS or p.suffix == ".mk" or p.name in extra
                or (runner == "cargo" and p.parts[:1] == (".cargo",))):
            hits.append(path)
    return sorted(hits)


def runner_of(argvs: Iterable[Sequence[str]]) -> str | None:
    for argv in argvs:
        words = [PurePosixPath(a).name for a in argv]
        if words[:1] in (["npm"], ["pnpm"], ["yarn"]) or words[:1] == ["npx"]:
            return "npm"
        if words[:1] == ["cargo"]:
            return "cargo"
    return None
