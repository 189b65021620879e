"""Which test runners a validation step runs, read from the step's command and the base's own recipe.

    commands(argv, checkout) -> list of simple commands   the step's, with `npm test`-style scripts and a
                                                          Makefile target's recipe expanded (a few levels)
    seen(argv, checkout) -> names        the runners found (`pytest`, `go test`, `vitest`, ...), else the
                                         commands' own first words (`./test_runner`): what a step's verdict
                                         says it rested on
    stdout_kinds(argv, checkout) -> kinds   the readers of the step's stdout this tells the host to use

Asked only of the base's checkout, before the agent (the job's run is read with what the base's run
decided: proctor.mechanisms.evidence.baseline), and never of the agent's files. It reads package.json and
Makefiles as capped regular files beneath the checkout and runs nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.evidence.recipe import SHELLS, split_words

MAX_FILE = 1024 * 1024
DEPTH = 3
SEPARATORS = ("&&", "||", ";", "|", "&")
MANAGERS = frozenset({"npm", "pnpm", "yarn", "bun"})


def _read(checkout: Path, rel: str) -> str | None:
    try:
        fd = beneath.open_root(checkout)
    except OSError:
        return None
    try:
        return beneath.read_regular(fd, rel, MAX_FILE).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _split(command: str) -> list[list[str]]:
    words = split_words(command)
    out, cur = [], []
    for w in words:
        parts = re.split(r"(&&|\|\||;|\|)", w) if w not in SEPARATORS else [w]
        for p in parts:
            if p in SEPARATORS or p == "":
                if cur:
                    out.append(cur)
                cur = []
            else:
                cur.append(p)
    if cur:
        out.append(cur)
    return [_strip_env(c) for c in out if _strip_env(c)]


def _strip_env(cmd: list[str]) -> list[str]:
    """`FOO=1 env BAR=2 cmd ...` -> `cmd ...`."""
    i = 0
    while i < len(cmd) and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[i]) or cmd[i] in ("env", "exec", "command",
                                                                                            "time", "nice")):
        i += 1
    return cmd[i:]


def _package_script(checkout: Path, where: str, name: str) -> str | None:
    raw = _read(checkout, str(PurePosixPath(where) / "package.json"))
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        return None
    scripts = data.get("scripts") if isinstance(data, dict) else None
    script = scripts.get(name) if isinstance(scripts, dict) else None
    return script if isinstance(script, str) else None


def _make_recipe(checkout: Path, target: str | None) -> list[str]:
    text = None
    for name in ("GNUmakefile", "makefile", "Makefile"):
        text = _read(checkout, name)
        if text is not None:
            break
    if not text:
        return []
    rules: dict[str, tuple[list[str], list[str]]] = {}
    order: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            current.append(line[1:].lstrip("@-+ "))
            continue
        m = re.match(r"^([A-Za-z0-9_./%-][^:=#]*?)\s*::?(?!=)\s*([^=#;]*)", line)
        if m and not line.startswith("\t"):
            recipe: list[str] = []
            for t in m[1].split():
                rules.setdefault(t, (m[2].split(), recipe))
                if not t.startswith("."):
                    order.append(t)
            current = recipe
        elif line.strip() and not line.startswith(("#", " ")):
            current = None
    goal = target or next(iter(order), None)
    out: list[str] = []

    def visit(t: str, depth: int) -> None:
        if t not in rules or depth > DEPTH:
            return
        prereqs, recipe = rules[t]
        for p in prereqs:
            visit(p, depth + 1)
        out.extend(recipe)
    if goal:
        visit(goal, 0)
    return out


def commands(argv: Sequence[str], checkout: Path, depth: int = 0) -> list[list[str]]:
    """The simple commands a step runs, scripts and make targets expanded."""
    argv = list(argv)
    if len(argv) >= 3 and PurePosixPath(argv[0]).name in SHELLS and argv[1] == "-c":
        cmds = _split(argv[2])
    else:
        cmds = [_strip_env(argv)] if argv else []
    if depth >= DEPTH:
        return cmds
    out: list[list[str]] = []
    for cmd in cmds:
        out.append(cmd)
        head = PurePosixPath(cmd[0]).name if cmd else ""
        rest = [w for w in cmd[1:] if not w.startswith("-")]
        script = None
        if head in MANAGERS and rest:
            name = rest[1] if rest[0] in ("run", "run-script") and len(rest) > 1 else rest[0]
            if rest[0] in ("test", "t", "run", "run-script") or head in ("yarn", "pnpm"):
                script = _package_script(checkout, ".", name)
        if script:
            out += commands(["sh", "-c", script], checkout, depth + 1)
        elif head in ("make", "gmake"):
            target = next((w for w in cmd[1:] if not w.startswith("-") and "=" not in w), None)
            for line in _make_recipe(checkout, target):
                out += commands(["sh", "-c", line], checkout, depth + 1)
    return out


def _names(cmd: list[str]) -> list[str]:
    words = [PurePosixPath(w).name for w in cmd]
    head = words[0] if words else ""
    found = []
    if head in ("pytest", "py.test") or "pytest" in words[1:3] and "-m" in words[1:2]:
        found.append("pytest")
    if head.startswith("python") and words[1:3] == ["-m", "unittest"]:
        found.append("unittest")
    if "manage.py" in words and "test" in words:
        found.append("django")
    if head in ("nose2", "green", "trial"):
        found.append(head)
    if head == "go" and "test" in words[1:2]:
        found.append("go test -json" if "-json" in words else "go test")
    if head == "cargo" and words[1:2] in (["test"], ["nextest"]):
        found.append("cargo test")
    for runner in ("vitest", "jest", "mocha", "tape", "tap", "prove", "ctest", "mvn", "gradle", "gradlew", "ava"):
        if head == runner or (head in ("npx", "pnpx", "bunx") and runner in words[1:3]) or (
                head in MANAGERS and runner in words[1:3] and "exec" in words[1:2]):
            found.append(runner)
    if head == "node" and "--test" in words:
        found.append("node --test")
    if head == "dotnet" and "test" in words[1:2]:
        found.append("dotnet test")
    return found


def seen(argv: Sequence[str], checkout: Path) -> list[str]:
    cmds = commands(argv, checkout)
    names = list(dict.fromkeys(n for c in cmds for n in _names(c)))
    if names:
        return names
    leaves = [c[0] for c in cmds if c and PurePosixPath(c[0]).name not in (*MANAGERS, "make", "gmake", *SHELLS,
                                                                         "cd", "echo", "test", "[", "true")]
    return list(dict.fromkeys(leaves))[:3] or [" ".join(argv[-1:])[:80]]


def stdout_kinds(argv: Sequence[str], checkout: Path) -> set[str]:
    """The stdout readers the runners found call for: `go` (test2json when `-json`, else `-v` lines),
    `libtest` for cargo, `tap` for node --test, tape, tap and prove, `ctest` for CTest."""
    kinds = set()
    for name in seen(argv, checkout):
        if name == "go test -json":
            kinds.add("go-json")
        elif name == "go test":
            kinds.add("go")
        elif name == "cargo test":
            kinds.add("libtest")
        elif name in ("node --test", "tape", "tap", "prove"):
            kinds.add("tap")
        elif name == "ctest":
            kinds.add("ctest")
    return kinds
