"""The outcome of a review verb: ok or refused, with a stable code, a one-line reason and the details.

Owns the codes (additive only, never renamed) and the value every verb returns to the CLI. It never
prints and never decides: the verbs do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Code(StrEnum):
    OK = "OK"
    UNKNOWN_JOB = "UNKNOWN_JOB"  # no such job id (nor a unique prefix of one) in the ledger
    AMBIGUOUS_JOB = "AMBIGUOUS_JOB"  # a prefix of several job ids
    NO_RESULT = "NO_RESULT"  # the host kept no result.json for the job (an old or interrupted job)
    NO_COMMIT = "NO_COMMIT"  # the job has no commit: its tree was never built
    RECORD_MISMATCH = "RECORD_MISMATCH"  # result.json names another commit than the ledger's job.tree row
    JOB_RUNNING = "JOB_RUNNING"  # its host is alive: the job may still be writing its worktree
    NOT_LANDABLE = "NOT_LANDABLE"  # not completed, or its validation did not run and pass (and no --force)
    FORCE_NEEDS_REASON = "FORCE_NEEDS_REASON"
    NOTHING_TO_LAND = "NOTHING_TO_LAND"  # the job changed no file
    ALREADY_LANDED = "ALREADY_LANDED"
    DISCARDED = "DISCARDED"  # the job was discarded or collected: its objects are gone
    OBJECTS_MISSING = "OBJECTS_MISSING"  # the job's git dir does not hold its commit any more
    REPO_UNUSABLE = "REPO_UNUSABLE"  # the job's repo is not a git repo any more
    TARGET_INVALID = "TARGET_INVALID"  # --into is not a branch name proctor hands to git
    TARGET_MISSING = "TARGET_MISSING"  # the target branch does not exist in the main repo
    TARGET_CHECKED_OUT = "TARGET_CHECKED_OUT"  # checked out in a linked worktree, whose files would go stale
    CHECKOUT_DIRTY = "CHECKOUT_DIRTY"  # the main checkout is on the target with uncommitted changes
    NOT_FAST_FORWARD = "NOT_FAST_FORWARD"  # --ff-only and the target moved since the base
    CONFLICT = "CONFLICT"  # the job does not merge cleanly into the target
    REVALIDATION_FAILED = "REVALIDATION_FAILED"  # the merged tree failed the job's validation
    TARGET_MOVED = "TARGET_MOVED"  # the target moved while land ran: nothing moved, run it again
    STOPPED = "STOPPED"  # the stop switch is engaged: nothing agent-written runs
    CONFIG_INVALID = "CONFIG_INVALID"
    CONFINEMENT_UNAVAILABLE = "CONFINEMENT_UNAVAILABLE"
    GIT_FAILED = "GIT_FAILED"  # host-side git failed (the reason says which command)
    REMOVE_FAILED = "REMOVE_FAILED"  # a job's files could not all be removed
    LEDGER_FAILED = "LEDGER_FAILED"  # the verb's ledger row could not be written: nothing was done
    CHECKOUT_WOULD_LOSE = "CHECKOUT_WOULD_LOSE"  # landing would overwrite or remove an untracked/ignored file
    UNSAFE_DIRECTORY = "UNSAFE_DIRECTORY"  # `{repo}-agents/` is another user's or writable by others
    TRUST_LINE = "TRUST_LINE"  # the job changes what runs or is obeyed outside the tests: --allow-trust-line
    NOT_AS_SHOWN = "NOT_AS_SHOWN"  # the review page did not show exactly what would land (a cut, or a changed diff)


@dataclass
class Outcome:
    code: Code = Code.OK
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.code is Code.OK

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "code": self.code.value, "reason": self.reason, **self.details}


def refuse(code: Code, reason: str, **details: Any) -> Outcome:
    return Outcome(code, reason, dict(details))
