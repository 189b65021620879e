"""The job's diff against its declaration: what the agent changed, whatever its tool calls said.

Owns one check, run after the job's tree is built: each path in `changed_files` that the trusted policy's
`[forbid] paths` name, that lies outside the declared workspace, or that the declaration gave no way to
write, is a risk naming it (one risk string per class). It exists because the gate decides calls, not
effects: a patch hunk the gate's parser missed wrote a forbidden path and no check saw it (issue 22, item
1), and a shell, a build or a skill writes files no call names. It never reads files, runs git or decides
the job's status: the host adds the risks, which send the job to a person.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from proctor.mechanisms.policy.gate import path_matcher
from proctor.mechanisms.policy.task import AgentTask, Effect

SHOWN = 10  # names listed per risk; the rest counted


def undeclared(task: AgentTask | None, forbidden: Sequence[str], changed: Sequence[str]) -> list[str]:
    """Risks for `changed` (paths relative to the worktree, as `changed_files` holds them). `task`: the
    job's declaration as its gate decided it (None for a job no gate decided: only `forbidden` applies).
    `forbidden`: the trusted policy's `[forbid] paths` (Policy.forbidden_paths)."""
    risks = []
    outside = [p for p in changed if _outside(p)]
    if outside:
        risks.append(f"the job's diff changes paths outside its workspace: {_names(outside)}")
    hits = _forbidden(forbidden, task, [p for p in changed if p not in outside])
    if hits:
        risks.append(f"the job's diff changes paths the trusted policy forbids ([forbid] paths): {_names(hits)}")
    if task is not None and changed and not _may_write(task):
        risks.append("the job's diff changes files, but its declaration grants no tool that writes files "
                     f"(no permitted write, delete or shell tool): {_names(list(changed))}")
    return risks


def _outside(path: str) -> bool:
    norm = posixpath.normpath(path)
    return path.startswith("/") or norm == ".." or norm.startswith("../") or "\x00" in path


def _forbidden(patterns: Sequence[str], task: AgentTask | None, changed: list[str]) -> list[str]:
    if not patterns:
        return []
    match = path_matcher(tuple(patterns))
    root = task.permissions.workspace.rstrip("/") if task is not None else ""
    found = []
    for p in changed:
        rel = posixpath.normpath(p)
        pat = match(rel, f"{root}/{rel}" if root else rel)
        if pat is not None:
            found.append(f"{p} (pattern {pat!r})")
    return found


def _may_write(task: AgentTask) -> bool:
    """A permitted tool could change a file: a write or delete tool with `write_files`, or a shell."""
    perms = task.permissions
    for t in task.tools:
        if t.effect in (Effect.write, Effect.delete) and perms.write_files:
            return True
        if t.effect is Effect.shell and perms.shell:
            return True
    return False


def _names(paths: list[str]) -> str:
    more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    return ", ".join(paths[:SHOWN]) + more
