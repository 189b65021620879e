"""A race's ranking: its jobs ordered by what the host measured, each with the reasons for its place.

Owns the order and nothing else (it reads results, never a repo or the ledger). First by the verdict, in
tiers; within a tier by the tests against the base (fewer broken, more fixed), the risks recorded, then the
size of the diff, the wall time and the reported cost. The agent's own word (`claimed_status`, its summary)
never counts.

The tiers, best first. A job that passed every test it could see and failed the checks it could not (the
held-out tests, the sealed checks) ranks below one that plainly failed: its change fits what it was shown
and not the task, which is worse than an honest failure. A race's ranking never carries a held-out test's
name, content or expected value: only the counts the result already states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proctor.contract import Code, RunAgentResult, Status
from proctor.services.job.judge import main_steps

TIERS = ("accepted", "completed, needs review", "failed its tests", "did not finish",
         "failed the checks it never saw")


@dataclass(frozen=True)
class Standing:
    job_id: str
    agent: str
    tier: int
    reasons: tuple[str, ...]
    key: tuple[Any, ...] = field(repr=False)

    def record(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "jobId": self.job_id, "agent": self.agent, "tier": TIERS[self.tier],
                "reasons": list(self.reasons)}


def _counts(result: RunAgentResult) -> dict[str, int]:
    out = {"broken": 0, "fixed": 0, "must_pass_failing": 0}
    for step in main_steps(result.validation):
        counts = ((step.get("compared") or {}).get("counts")) or {}
        for k in out:
            out[k] += int(counts.get(k) or 0)
    return out


def _unseen_failed(result: RunAgentResult) -> str | None:
    """The held-out part's failure, in counts only, when there is one."""
    h = result.holdout or {}
    tests, sealed = h.get("tests") or {}, h.get("sealed") or {}
    why = []
    if tests.get("failed"):
        why.append(f"{tests['failed']} of {tests.get('expected', '?')} held-out test(s) did not pass")
    if sealed.get("failed"):
        why.append(f"{sealed['failed']} of {sealed.get('checks', '?')} sealed check(s) failed")
    if h.get("steps_failed") and not why:
        why.append(f"{h['steps_failed']} held-out step(s) failed")
    return "; ".join(why) or None


def standing(result: RunAgentResult, diff_lines: int | None) -> Standing:
    counts = _counts(result)
    # Passed outright: a step whose failures the base shared ("explained") passed the verdict, but it made
    # none of the tests it saw pass, so it did not fit them.
    visible_passed = bool(main_steps(result.validation)) and all(s.get("passed") and s.get("exit_code") == 0
                                                       for s in main_steps(result.validation))
    unseen = _unseen_failed(result)
    reasons: list[str] = []
    if result.status is Status.completed and not result.needs_human_review:
        tier = 0
        basis = (result.basis or {}).get("verdict")
        reasons.append(f"completed and every check passed (the verdict rests on {basis or 'its checks'})")
    elif result.status is Status.completed:
        tier = 1
        first = result.known_risks[0] if result.known_risks else "no check covered it"
        reasons.append(f"completed, but needs a person: {first}")
    elif unseen and visible_passed:
        tier = 4
        reasons.append(f"passed the tests it could see and failed the checks it could not: {unseen}")
    elif result.code is Code.VALIDATION_FAILED:
        tier = 2
        reasons.append(f"failed validation: {unseen or result.summary[:200]}")
    else:
        tier = 3
        reasons.append(f"{result.status.value} ({result.code.value}): {result.summary[:200]}")
    if counts["broken"] or counts["fixed"]:
        reasons.append(f"against the base: {counts['fixed']} test(s) fixed, {counts['broken']} broken")
    if counts["must_pass_failing"]:
        reasons.append(f"{counts['must_pass_failing']} test(s) that must pass did not")
    risks = len(result.known_risks)
    if risks and tier != 1:
        reasons.append(f"{risks} risk(s) recorded")
    if diff_lines is not None:
        reasons.append(f"diff: {diff_lines} line(s) in {len(result.changed_files)} file(s)")
    usd = (result.usage or {}).get("usd")
    reasons.append(f"{result.duration_seconds:.1f} s" + (f", ${usd:.4f} reported" if isinstance(usd, (int, float))
                                                          else ""))
    key = (tier, counts["must_pass_failing"], counts["broken"], -counts["fixed"], risks,
           diff_lines if diff_lines is not None else float("inf"), result.duration_seconds,
           usd if isinstance(usd, (int, float)) else float("inf"))
    return Standing(result.job_id or "", result.agent, tier, tuple(reasons), key)


def rank(results: Sequence[RunAgentResult], diff_lines: Mapping[str, int] | None = None) -> list[Standing]:
    """Best first; ties keep the order the jobs were asked in."""
    lines = diff_lines or {}
    return sorted((standing(r, lines.get(r.job_id or "")) for r in results), key=lambda s: s.key)
