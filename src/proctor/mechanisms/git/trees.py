"""What a tree holds and what differs between two: read from the job's git objects alone.

Owns asking git (in a git dir the host made, proctor.mechanisms.git.command) for a tree's entries and for the
entries two trees or commits disagree on. It never looks at a work directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from proctor.mechanisms.git.command import LITERAL_PATHS, git
from proctor.mechanisms.git.worktree import Failure


def tree_diff(git_dir: Path, old: str, new: str) -> list[tuple[int, str, str]] | Failure:
    """Every entry that differs between two trees (or commits): (its mode in `new`, 0 where gone; its oid
    there; its path), from objects alone."""
    res = git(["diff-tree", "-r", "-z", "--no-renames", "--no-commit-id", old, new], git_dir=git_dir)
    if not res.ok:
        return Failure(f"git diff-tree failed: {res.err}")
    out = []
    fields = res.out.split(b"\0")
    for i in range(0, len(fields) - 1, 2):
        meta = fields[i].split(b" ")  # :old-mode new-mode old-oid new-oid status
        if len(meta) < 5 or not meta[0].startswith(b":"):
            return Failure(f"git diff-tree said something unexpected: {fields[i][:80]!r}")
        out.append((int(meta[1], 8), meta[3].decode(), fields[i + 1].decode("utf-8", "surrogateescape")))
    return out


def changed_paths(git_dir: Path, old: str, new: str) -> list[str] | Failure:
    """Every path whose entry differs between two commits (both sides of a rename), from objects alone."""
    res = git(["diff-tree", "-r", "-z", "--no-renames", "--name-only", "--no-commit-id", old, new], git_dir=git_dir)
    if not res.ok:
        return Failure(f"git diff-tree failed: {res.err}")
    return [p.decode("utf-8", "surrogateescape") for p in res.out.split(b"\0") if p]


def tree_entries(git_dir: Path, tree: str) -> dict[str, str] | Failure:
    """path -> mode for every entry of `tree`, directories included."""
    res = git(["ls-tree", "-r", "-t", "-z", "--full-tree", tree], git_dir=git_dir)
    if not res.ok:
        return Failure(f"git ls-tree failed: {res.err}")
    out = {}
    for entry in res.out.split(b"\0"):
        if entry:
            meta, name = entry.split(b"\t", 1)
            out[name.decode("utf-8", "surrogateescape")] = meta.split(b" ", 1)[0].decode()
    return out


def top_levels(git_dir: Path, tree: str, names: Iterable[str]) -> list[str] | Failure:
    """The paths of `tree` where an import of one of `names` looks first: the root's and `src/`'s entries,
    and those of each name's directory there (`calc.py`, `calc/__init__.py`, `src/calc/__init__.py`). Two
    calls, whatever the tree's size; paths are literal (`git ls-tree` refuses pathspec magic such as
    `:(glob)` outright, and a name is the agent's: never a pattern)."""
    root = _children(git_dir, tree, [""])
    if isinstance(root, Failure):
        return root
    below = _children(git_dir, tree, ["src", *(d for n in sorted(set(names)) for d in (n, f"src/{n}"))])
    if isinstance(below, Failure):
        return below
    return [p for p, _ in root + below]


def _children(git_dir: Path, tree: str, dirs: list[str]) -> list[tuple[str, bool]] | Failure:
    """(path, is a directory) of each entry directly in `dirs` ("" is the root)."""
    out: list[tuple[str, bool]] = []
    for i in range(0, len(dirs), 512):  # within any argv limit, however many there are
        paths = [f"{d}/" for d in dirs[i:i + 512] if d]
        res = git(["ls-tree", "-z", tree, "--", *paths], git_dir=git_dir, env=LITERAL_PATHS)
        if not res.ok:
            return Failure(f"git ls-tree failed: {res.err}")
        for entry in res.out.split(b"\0"):
            if entry:
                meta, name = entry.split(b"\t", 1)
                out.append((name.decode("utf-8", "surrogateescape"), meta.split(b" ", 2)[1] == b"tree"))
    return out
