"""The verdict: each validation run taken into the result (its attempts, its risks, and whether it ended
the job's chances), and the rule for `needs_human_review` — false only when the agent completed, the host
itself ran tests that passed, the agent changed files, and nothing at all is a risk."""

from __future__ import annotations

import time
from typing import Any

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms.config.settings import RUNGS
from proctor.mechanisms.validation import plan as vplan
from proctor.services.job import heldout
from proctor.services.job.context import Job
from proctor.services.job.record import validation_log

def killed_code(reason: str) -> Code:
    """The code of a validation run the host ended: by the stop switch, a resource limit, or a cancel."""
    return (Code.STOPPED if reason.startswith("stopped") else Code.RESOURCE_LIMIT
            if reason.startswith("resource_limit") else Code.CANCELLED)


def run(job: Job, run: vplan.Run, result: RunAgentResult, suffix: str) -> bool:
    """Record one validation run; True when it ended the job's chances (killed or failed)."""
    timeout = job.config.validate_timeout
    result.tests_attempted += [f"{a.line(timeout)}{suffix}" for a in run.attempts]
    result.validation += [{**a.record(), "label": f"{a.label}{suffix}"} for a in run.attempts]
    log = validation_log(job.job_id)
    result.validation_log = str(log) if log.exists() else None
    if run.killed_reason:
        result.status = Status.failed
        reason = run.killed_reason
        result.code = killed_code(reason)
        job.risks.append(f"validation {run.killed_reason}")
        return True
    for a in run.attempts:
        job.risks.extend(f"{r}{suffix}" for r in a.risks)
    failed = [a for a in run.attempts if not a.passed]
    if not failed:
        return False
    first = failed[0]
    why = f" ({first.failure})" if first.failure else ""
    if suffix:
        job.risks.append(f"validation failed{suffix}: {first.line(timeout)}{why}")
        return True
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: {first.line(timeout)}{why}")
    return True


def main_steps(validation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The validation records of the repo's own test steps: not setup, not the held-out step, not a re-run
    on the base's tree (their labels say which)."""
    return [v for v in validation if not str(v.get("label", "")).startswith(("setup", "held-out:"))
            and not str(v.get("label", "")).endswith("(the base)")]


def basis(job: Job, result: RunAgentResult) -> None:
    """What the verdict rests on: each validation step's rung (its tests held to the base's run by id, or
    its exit code alone), the held-out step's (sealed checks no cheat could guess, or held-out tests), and
    the verdict's: the held-out step's, else the weakest test step's. Where the repo's settings require a
    rung the verdict does not reach, that is a risk (a person reviews)."""
    steps = [{"label": v["label"], "basis": "base-tests" if v.get("compared") else "exit-code"}
             for v in main_steps(result.validation)]
    if not steps:
        return
    held = heldout.basis(result)
    weakest = min((s["basis"] for s in steps), key=RUNGS.index)
    overall = held if held is not None and RUNGS.index(held) > RUNGS.index(weakest) else weakest
    required = job.settings.require_basis if job.settings is not None else None
    result.basis = {"verdict": overall, "steps": steps, "held_out": held, "required": required}
    if required and RUNGS.index(overall) < RUNGS.index(required):
        job.risks.append(f"the verdict rests on {overall}; this repo requires {required} for a verdict a person "
                         "may skip (docs/concepts/verdict.md: What the verdict rests on)")


def verdict(job: Job, result: RunAgentResult) -> RunAgentResult:
    """The result as the host judges it: every risk the phases found, and a person's review unless all
    was really checked and passed."""
    if result.status is Status.completed:
        basis(job, result)
    result.known_risks = job.risks
    result.needs_human_review = not (
        result.status is Status.completed
        and result.tests_attempted
        and result.code is Code.OK
        and result.agent_changed_files
        and not job.risks
    )
    result.duration_seconds = round(time.monotonic() - job.start, 3)
    return result
