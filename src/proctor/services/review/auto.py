"""Landing without a person, where the person's config allows it (`[auto_land."<repo>"]`): off by default.

Owns the decision to land a finished job on its own and the `auto.land` ledger row naming the policy and the
evidence it rested on. The policy is the person's config, never a request's field nor a repo's own file. A job
lands only when its verdict needs no person, rests on at least the policy's basis (docs "What the verdict
rests on") and recorded no risk; then `land` does what it does for a person — merged tree re-validated,
the target checked — except that a change across the trust line (what runs or is obeyed outside the tests:
`.proctor.toml` and the files it names, hooks, CI, agent instructions) is never landed here: it waits for a
person (`TRUST_LINE`). Only the person's own jobs are landed so (`proctor run-agent`, the winner of a race
they ran), never one someone else asked for (a queue or MCP requester chose its base branch); a race lands
its winner only, never a job because it passed alone; a follow-up never (it lands its whole chain).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proctor.contract import RunAgentResult, Status
from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.config.model import AutoLand, Config
from proctor.mechanisms.config.settings import RUNGS
from proctor.mechanisms.ledger.store import Ledger
from proctor.services.review import jobs
from proctor.services.review.land import land


def why_not(result: RunAgentResult, policy: AutoLand) -> str | None:
    """Why the evidence does not meet the policy; None when it does."""
    if result.status is not Status.completed or result.needs_human_review:
        return f"the verdict needs a person ({result.status.value}, {result.code.value})"
    if result.known_risks:
        return f"{len(result.known_risks)} risk(s) recorded: {result.known_risks[0][:200]}"
    basis = (result.basis or {}).get("verdict")
    if basis not in RUNGS or RUNGS.index(basis) < RUNGS.index(policy.basis):
        return f"the verdict rests on {basis or 'nothing stated'}; the policy asks for {policy.basis} or stronger"
    if not result.commit or not result.job_id:
        return "the job has no commit"
    if result.chain:  # landing it lands the chain, whose earlier jobs this verdict did not judge one by one
        return f"a follow-up lands its whole chain ({', '.join(result.chain)}): a person reads that"
    return None


def _evidence(result: RunAgentResult) -> dict[str, Any]:
    return {"status": result.status.value, "code": result.code.value,
            "needs_human_review": result.needs_human_review, "basis": (result.basis or {}).get("verdict"),
            "risks": len(result.known_risks), "commit": result.commit,
            "validation": [{"label": v.get("label"), "passed": v.get("passed")} for v in result.validation][:20]}


def after_job(repo: str, result: RunAgentResult, config: Config | None, *, ledger: Ledger | None = None,
              race: str | None = None) -> dict[str, Any] | None:
    """Land `result`'s job (of `repo`, as its request named it) when the config's policy for that repo allows
    it; what happened (also the job's `landed` field), or None when no policy names the repo. Every decision
    taken is an `auto.land` row."""
    if config is None:
        try:
            config = load_config()
        except ConfigError:
            return None  # the job itself was refused over it, or ran on a config it was given
    policy = config.auto_land_for(Path(repo)) if result.job_id else None
    if policy is None:
        return None
    try:
        return _decide(repo, result, policy, ledger, race)
    except Exception as exc:  # noqa: BLE001 - a landing that could not be decided leaves the job for a person
        said = {"landed": False, "code": "AUTO_LAND_FAILED", "reason": f"{type(exc).__name__}: {exc}",
                "policy": {"repo": repo, "basis": policy.basis, "into": policy.into}}
        result.landed = said
        return said


def _decide(repo: str, result: RunAgentResult, policy: AutoLand, ledger: Ledger | None,
            race: str | None) -> dict[str, Any]:
    own = ledger is None
    ledger = ledger or Ledger.default()
    try:
        said: dict[str, Any] = {"policy": {"repo": repo, "basis": policy.basis, "into": policy.into}}
        if race:
            said["race"] = race
        refused = why_not(result, policy)
        if refused is None:
            found = jobs.find(ledger, result.job_id or "")
            if not isinstance(found, jobs.Job):
                refused = found.reason
            else:
                out = land(ledger, found, into=policy.into, via="auto",
                           reason=f"auto_land policy of {repo} (basis {policy.basis})")
                said.update(landed=out.ok, code=out.code.value, reason=out.reason,
                            into=out.details.get("into") or policy.into)
        if refused is not None:
            said.update(landed=False, code="NOT_ELIGIBLE", reason=refused)
        ledger.append("auto.land", {"jobId": result.job_id, **said, "evidence": _evidence(result)},
                      job_id=result.job_id)
        result.landed = said
        return said
    finally:
        if own:
            ledger.close()

