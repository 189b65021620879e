"""What a tree holds and what differs between two: read from the job's git objects alone.

Owns asking git (in a git dir the host made, proctor.mechanisms.git.command) for a tree's entries and for the
entries two trees or commits disagree on. It never looks at a work directory.
"""

from __future__ import annotations

from pathlib import Path

from proctor.mechanisms.git.command import git
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
