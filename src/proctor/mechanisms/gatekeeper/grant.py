"""How a call is named for a person's grant: its canonical input (the job's worktree cut out, so the same call
in the next job of a ticket reads the same), that input's digest, the key a grant is used up under, and a
held call as its ledger row keeps it. It never grants or claims anything itself (GateService does).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def canonical_input(tool: str, arguments: Any, worktree: Path) -> str:
    """A call as a person's grant names it: JSON of the tool, its input with every occurrence of the job's
    worktree path cut out of its strings, and where each was cut (`worktree_at`: [JSON path, offsets]).
    The same call in the next job of a ticket (another worktree) reads the same; no input can read like
    another, since the cuts are structure no string can spell. The worktree was once written as the text
    `<worktree>`, so an input holding that text itself matched: an approved `cat <path> calc.py` let
    `cat <worktree> calc.py` run (issue 22, item 6)."""
    cuts: list[list[Any]] = []
    shape = _cut(arguments, str(worktree), [], cuts) if str(worktree) not in ("", "/", ".") else arguments
    return json.dumps({"tool": tool, "input": shape, "worktree_at": cuts}, sort_keys=True, default=str,
                      separators=(",", ":"))


def _cut(value: Any, worktree: str, where: list[Any], cuts: list[list[Any]]) -> Any:
    if isinstance(value, str):
        pieces = value.split(worktree)
        if len(pieces) > 1:
            ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces) - 1)]
            cuts.append([where, ends])
        return "".join(pieces)
    if isinstance(value, list):
        return [_cut(v, worktree, [*where, i], cuts) for i, v in enumerate(value)]
    if isinstance(value, dict):  # keys kept as they are: a key naming the worktree matches only itself
        return {k: _cut(value[k], worktree, [*where, k], cuts) for k in sorted(value, key=str)}
    return value


def input_digest(arguments: Any, worktree: Path, *, tool: str) -> str:
    """sha256 of `canonical_input`: what a held call, its grant and `proctor approve --digest` name."""
    return hashlib.sha256(canonical_input(tool, arguments, worktree).encode()).hexdigest()


def grant_claim(grant_row: int) -> str:
    """The key a grant is used up under (`Ledger.claim_once` of `gate.grant_used`)."""
    return f"gate.grant#{grant_row}"


# The held call's input kept in its `gate.call` row, for the person asked to approve it (`proctor approve`
# shows it, escaped and cut shorter). Longer inputs are kept cut, and say so.
HELD_INPUT_MAX = 64 * 1024


def held_call(call: dict[str, Any], worktree: Path) -> dict[str, Any]:
    """What a held call would do, as its ledger row keeps it: tool, paths, input (cut), the worktree."""
    text = json.dumps(call.get("arguments"), sort_keys=True, ensure_ascii=False, default=str)
    paths = [str(p)[:4096] for p in (call.get("paths") or [])][:50]
    return {"tool": str(call.get("tool", ""))[:200], "paths": paths, "input": text[:HELD_INPUT_MAX],
            "input_chars": len(text), "worktree": str(worktree)}
