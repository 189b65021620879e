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
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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


def held_ids(root: Path) -> dict[str, list[str]]:
    """The pytest ids each held-out Python test file defines, read from its syntax (nothing is imported or
    run): top-level `test_*` functions and the `test_*` methods of `Test*` classes and unittest cases. The
    host knows them before the run, so a hook that deselects them, or a run that never reaches them, is
    seen: each must be reported, and pass (a parametrized one as `id[...]`)."""
    out: dict[str, list[str]] = {}
    for rel in held_files(root):
        name = PurePosixPath(rel).name
        if not (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))):
            continue
        try:
            tree = ast.parse((root / rel).read_bytes()[:MAX_FILE])
        except (SyntaxError, ValueError, RecursionError, MemoryError, OSError):
            out[rel] = []
            continue
        ids = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                ids.append(f"{rel}::{node.name}")
            elif isinstance(node, ast.ClassDef) and (node.name.startswith("Test") or any(
                    (getattr(b, "attr", None) or getattr(b, "id", "")).endswith("TestCase") for b in node.bases)):
                ids += [f"{rel}::{node.name}::{m.name}" for m in node.body
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
        out[rel] = ids
    return out


def sealed_files(dirs: Sequence[str]) -> list[Path]:
    return [Path(d) / SEALED_FILE for d in dirs if (Path(d) / SEALED_FILE).is_file()]


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
                data = src.read_bytes()
                try:
                    beneath.rmtree(root_fd, rel)
                    replaced += 1
                except FileNotFoundError:
                    pass
                beneath.create_excl(root_fd, rel, data, 0o644)
    except OSError as exc:
        return f"the held-out tests could not be laid in: {beneath.why(exc)}"
    finally:
        os.close(root_fd)
    return Laid(len(dirs), files, replaced)
