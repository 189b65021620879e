"""Checks the agent never sees: test files a person keeps outside the repo, laid into validation only.

    check_dirs(dirs) -> list[str]                 why each named dir cannot be used (empty: all usable)
    lay(checkout, dirs) -> Laid | str             copy every regular file of each dir onto the checkout
                                                  at the same relative path (replacing the tree's file)

A held-out dir mirrors the repo's layout (`/srv/holdout/calc/tests/test_spec.py` lands at
`tests/test_spec.py`), so a person can hold out a new test file or the original of a visible one. The
dirs come from the trusted config or a trusted sender, never from the repo; they are hidden from the
agent's sandbox, are never in the worktree or the job's commit, and the result says how many files of
how many dirs ran, never their names or content (the review checkout is made afresh after validation, so
they do not stay). Writes go beneath the checkout with no symlink followed: the checkout is the agent's
tree, and a directory it turned into a link must not carry a held-out file elsewhere.
"""

from __future__ import annotations

import ast
import os
import re
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.confine import beneath
from proctor.mechanisms.evidence.sealed import SEALED_FILE

MAX_FILE = 16 * 1024 * 1024
MAX_FILES = 10_000


@dataclass(frozen=True)
class Laid:
    dirs: int
    files: int
    replaced: int  # files of the agent's tree that a held-out file took the place of

    def record(self) -> dict[str, int]:
        return {"dirs": self.dirs, "files": self.files, "replaced": self.replaced}


def check_dirs(dirs: Sequence[str]) -> list[str]:
    bad = []
    for d in dirs:
        p = Path(d)
        if not p.is_absolute():
            bad.append(f"holdout {d!r} is not an absolute path")
        elif p.is_symlink() or not p.is_dir():
            bad.append(f"holdout {d!r} is not a directory")
    return bad


def held_files(root: Path) -> list[str]:
    """Regular files below a trusted dir, relative; links and specials are not followed nor taken, and the
    dir's sealed checks (proctor.mechanisms.evidence.sealed) are the host's, never laid in."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(n for n in dirnames if n not in (".git", "__pycache__"))
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if stat.S_ISREG(full.lstat().st_mode) and not (dirpath == str(root) and name == SEALED_FILE):
                out.append(full.relative_to(root).as_posix())
    return out


# A source file a runner names as a test by its name alone (go's `_test.go`, jest's `.test.js`/`.spec.ts`,
# mocha's and rspec's `_spec`, `test_*` anywhere), and Rust's integration tests (a file directly in
# `tests/`); a snapshot or golden file named after its test (`calc.test.js.snap`) is support.
TEST_NAMED = re.compile(r"(?:^|/)(?:test[_.-][^/]*|[^/]*(?:_test|[._-]spec|[.-]test))\.(?:[cm]?[jt]sx?|go|rs|rb)$"
                        r"|(?:^|/)tests/[^/]+\.rs$")


@dataclass(frozen=True)
class Expected:
    """What a held-out test file must report: at least one test, each passing, and `ids` (a top-level
    `test*` function, a method of a `Test*` class or a unittest case: pytest ids) one by one; each of
    `methods` (a `test*` method of a class whose collection its syntax cannot tell: a base named elsewhere,
    a mixin) under some class of the file."""

    ids: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()


def expected(root: Path) -> dict[str, Expected]:
    """The held-out test files below a trusted dir and what each must report, read from names and syntax
    (nothing is imported or run). The host knows them before the run, so a hook that deselects a test, a
    config that stops collecting a file, or a run that never reaches it, is seen. A Python file is a test
    file when its syntax defines a test (or it does not parse: its collection error is its report); another
    file when runners name it one. The rest (conftest, helpers, data) is support, and any test it reports
    must still pass."""
    out: dict[str, Expected] = {}
    for rel in held_files(root):
        if not rel.endswith(".py"):
            if TEST_NAMED.search(rel):
                out[rel] = Expected()
            continue
        try:
            tree = ast.parse((root / rel).read_bytes()[:MAX_FILE])
        except (SyntaxError, ValueError, RecursionError, MemoryError, OSError):
            out[rel] = Expected()
            continue
        ids, methods = [], []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                ids.append(f"{rel}::{node.name}")
            elif isinstance(node, ast.ClassDef):
                named = [m.name for m in node.body
                         if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
                if node.name.startswith("Test") or any(
                        (getattr(b, "attr", None) or getattr(b, "id", "")).endswith("TestCase") for b in node.bases):
                    ids += [f"{rel}::{node.name}::{m}" for m in named]
                else:
                    methods += named
        if ids or methods:  # a Python file that defines none is support (helpers named `test_utils.py`)
            out[rel] = Expected(tuple(ids), tuple(dict.fromkeys(methods)))
    return out


class Owners:
    """Which held-out file defines a reported test: pytest's `path::name`, jest's `path > name`, unittest's
    `dotted.module.Class.test`, or the file the runner named (a held-out file laid over a visible one defines
    that test now). Asked of every id a step reports, so its prefixes are made once."""

    def __init__(self, paths: Collection[str]) -> None:
        self.paths = frozenset(paths)
        # unittest names a module from where discovery started (`discover -s tests`: `test_x.T.t` for
        # tests/test_x.py): every tail of the dotted path names it, where only one file has that tail.
        tails: dict[str, set[str]] = {}
        for p in self.paths:
            if p.endswith(".py"):
                parts = p[:-3].split("/")
                for i in range(len(parts)):
                    tails.setdefault(".".join(parts[i:]) + ".", set()).add(p)
        self._dotted = {d: next(iter(ps)) for d, ps in tails.items() if len(ps) == 1}
        self._prefixes = tuple(self._dotted)

    def of(self, tid: str, file: str | None = None) -> str | None:
        for sep in ("::", " > "):
            head = tid.split(sep, 1)[0]
            if head in self.paths:
                return head
        if tid in self.paths:
            return tid
        if file and file in self.paths:
            return file
        if tid.startswith(self._prefixes):
            return self._dotted[max((d for d in self._dotted if tid.startswith(d)), key=len)]
        return None


def dotted(pytest_id: str) -> str:
    """`tests/test_x.py::T::test_y` as unittest names it: `tests.test_x.T.test_y`."""
    path, _, rest = pytest_id.partition("::")
    return path.removesuffix(".py").replace("/", ".") + "." + rest.replace("::", ".")


def sealed_files(dirs: Sequence[str]) -> list[Path]:
    return [Path(d) / SEALED_FILE for d in dirs if (Path(d) / SEALED_FILE).is_file()]


def put(root_fd: int, rel: str, data: bytes) -> bool:
    """`data` as the file `rel` beneath the checkout, replacing what the tree had there (a file, a dir, a
    link: never followed); whether it replaced something. Raises OSError."""
    try:
        beneath.rmtree(root_fd, rel)
        replaced = True
    except FileNotFoundError:
        replaced = False
    beneath.create_excl(root_fd, rel, data, 0o644)
    return replaced


def lay(checkout: Path, dirs: Sequence[str]) -> Laid | str:
    files = replaced = 0
    try:
        root_fd = beneath.open_root(checkout)
    except OSError as exc:
        return f"cannot open the validation checkout: {exc}"
    try:
        for d in dirs:
            for rel in held_files(Path(d)):
                files += 1
                if files > MAX_FILES:
                    return f"the held-out tests hold more than {MAX_FILES} files"
                src = Path(d) / rel
                if src.stat().st_size > MAX_FILE:
                    return f"a held-out file is larger than {MAX_FILE} bytes"
                replaced += put(root_fd, rel, src.read_bytes())
    except OSError as exc:
        return f"the held-out tests could not be laid in: {beneath.why(exc)}"
    finally:
        os.close(root_fd)
    return Laid(len(dirs), files, replaced)
