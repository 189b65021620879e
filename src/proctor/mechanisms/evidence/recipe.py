"""The validation recipe is the base's: which changed files decide what validation runs.

    recipe_changes(commands, changed, runner) -> paths the agent changed that the recipe would run

A script named by `.proctor.toml`'s `validate`/`setup` (or by a request's command), the Makefiles, tox
and nox files, and for the runner in use its build scripts (`package.json` for npm, `build.rs` and
`.cargo/` for cargo): an agent that rewrote one chose its own verdict without touching a test (found in
review: a `validate` script rewritten to `exit 0`, a setup script that sent `.env` away). The host lays the
base's version of each into the validation checkout and names the change as a risk. What a script calls
in turn (another script, a Python helper) is not followed: such a file is only a risk when it is also
test-defining (proctor.mechanisms.git.frozen).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

ALWAYS = frozenset({"Makefile", "GNUmakefile", "makefile", "tox.ini", "noxfile.py", ".proctor.toml"})
BY_RUNNER = {
    "npm": ("package.json",),
    "cargo": ("build.rs",),
}


def split_words(command: str) -> list[str]:
    """A command's words as a shell splits them (comments dropped); unbalanced quotes split on spaces."""
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return command.split()


INTERPRETERS = frozenset({"sh", "bash", "dash", "zsh", "python", "python3", "node", "deno", "bun", "ruby", "perl",
                          "pwsh", "tox", "nox", "uv", "poetry", "pdm", "hatch"})
FILE_FLAGS = frozenset({"-f", "--file", "--makefile", "-c", "--config", "--rcfile", "--noxfile"})
SEPARATORS = frozenset({"&&", "||", ";", "|"})
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
RUNNERS = frozenset({"uv", "poetry", "pdm", "hatch", "pipenv", "rye", "npm", "pnpm", "yarn", "bun"})
SUBCOMMANDS = frozenset({"run", "exec", "x", "dlx"})
EXECUTORS = frozenset({"npx", "bunx", "pnpx", "exec", "env", "time", "nice"})


def _relative(word: str) -> str | None:
    if not word or word.startswith(("-", "/", "$", "~")) or "://" in word:
        return None
    p = PurePosixPath(word)
    return None if ".." in p.parts else p.as_posix()


def named_paths(commands: Iterable[str], depth: int = 0) -> set[str]:
    """The files the commands execute: a command word that is a relative path (`./run.sh`,
    `scripts/test.sh`), the script an interpreter is given (`sh ci/test.sh`, `python tools/run.py`), a
    file a runner is pointed at (`make -f ci.mk`, `tox -c tox-ci.ini`), and the same inside a shell's `-c`
    command and after a runner's `run` (`uv run ./check.sh`). Arguments that are data (`test -f out.txt`)
    and subcommands (`uv run`) are not the recipe."""
    out = set()
    for command in commands:
        words, start, head = split_words(command), True, ""
        for i, raw in enumerate(words):
            word = raw.rstrip(";")
            if word in SEPARATORS or not word:
                start = True
                continue
            prev = words[i - 1] if i else ""
            if re.fullmatch(r"-[a-z]*c", prev) and PurePosixPath(head).name in SHELLS:  # `-c`, `-lc`, `-ec`
                if depth < 3:
                    out |= named_paths([word], depth + 1)  # the command a shell is given: read as one
                continue
            if not start and PurePosixPath(head).name in RUNNERS and word in SUBCOMMANDS and \
                    PurePosixPath(prev).name in RUNNERS:
                start = True  # `uv run X`, `poetry run X`: X is a command of its own
                continue
            if not start and PurePosixPath(prev).name in EXECUTORS and not word.startswith("-"):
                start = True  # `npx ./x.js`: the word is the command
            if start:
                head = word
            name = PurePosixPath(prev).name
            if (start and "/" in word) or (name in INTERPRETERS and not word.startswith("-") and not start) or (
                    prev in FILE_FLAGS and head not in ("test", "[")):
                rel = _relative(word)
                if rel:
                    out.add(rel)
            elif "=" in word and word.split("=", 1)[0] in FILE_FLAGS:
                rel = _relative(word.split("=", 1)[1])
                if rel:
                    out.add(rel)
            start = raw.endswith(";")
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
