"""`proctor doctor`: what a job's validation would run on a repo, in which environment, and what the base's
own run of it says — test by test, with what is missing and the config line that fixes it — with no agent.

It is the job's own path up to the agent (proctor.services.job.run_agent): the base resolved, a worktree
cut, the repo's settings read from config and the base's `.proctor.toml`, the plan decided, the job's
confinement and environment, and the base's run (proctor.services.job.baseline), always run afresh and kept
for the next job like any baseline. The worktree goes after; the ledger has a `job.baseline` row.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.mechanisms import confine
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.evidence.baseline import Baseline
from proctor.mechanisms.git import worktree
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.process.local import LocalRunner
from proctor.mechanisms.validation import environment
from proctor.mechanisms.validation import plan as vplan
from proctor.services.job import baseline, record
from proctor.services.job.boundary import agent_env
from proctor.services.job.context import Job
from proctor.services.job.progress import NullProgress, Progress

MAX_IDS = 2000  # test outcomes listed per step (the counts are whole)


def doctor(repo: str, config: Config, *, branch: str | None = None, validate_command: str | None = None,
           confine_mode: str | None = None, progress: Progress | None = None,
           ledger: Ledger | None = None) -> dict[str, Any]:
    """The report (JSON-able); `runnable` False names the causes. Never raises for a bad repo or base."""
    start = time.monotonic()
    out: dict[str, Any] = {"repo": repo, "runnable": False, "causes": [], "risks": []}
    opened = worktree.open_repo(repo)
    if isinstance(opened, worktree.Failure):
        out["causes"] = [opened.reason]
        return out
    base = worktree.resolve_base(opened, branch) if branch else worktree.default_base(opened)
    if isinstance(base, worktree.Failure):
        out["causes"] = [base.reason]
        return out
    out["base"] = {"ref": base.ref, "sha": base.sha}
    chosen = confine.choose(confine_mode or config.confine, confine.detect())
    if isinstance(chosen, confine.Unavailable):
        out["causes"] = [chosen.reason]
        return out
    spec = config.adapter("patch")
    request = RunAgentRequest(agent="patch", task="(proctor doctor: no agent runs)", repo=str(opened.path),
                              ticket="doctor", branch=base.ref, validateCommand=validate_command)
    own = ledger is None
    ledger = ledger or Ledger.default()
    job = Job(request, config, LocalRunner(limits=config.limits.resolve()), progress or NullProgress(), None,
              f"doctor-{record.new_job_id()}", start, ledger, StopSwitch(), spec, config.limits.resolve(),
              Path(tempfile.mkdtemp(prefix="proctor-doctor-")), Path(tempfile.mkdtemp(prefix="proctor-doctor-host-")))
    job.confiner = chosen
    wt = worktree.create(opened, job.job_id, "doctor", base)
    try:
        if isinstance(wt, worktree.Failure):
            out["causes"] = [wt.reason]
            return out
        job.work = wt.path.with_name(f".{wt.path.name}.work")
        settings = environment.settings(config.repos, opened.path, opened.common_dir, base.sha)
        if isinstance(settings, str):
            job.risks.append(settings)
        else:
            job.settings = settings
            out["settings"] = {"source": settings.source, "validate": settings.validate,
                               "setup": list(settings.setup), "copy": list(settings.copy),
                               "share": None if settings.share is None else list(settings.share)}
        plan = baseline.plan_of(job, vplan.given(validate_command) if validate_command else vplan.detect(wt.path))
        full = environment.plan_for(plan, job.settings, given=bool(validate_command))
        out["plan"] = [s.label for s in full.steps]
        out["confinement"] = chosen.name
        if not plan.steps:
            out["causes"] = [plan.skipped_reason or "no validation command: nothing to run"]
            return out
        env = agent_env(job, wt.path)
        jenv = environment.prepare(wt.path, opened.path, plan, job.settings, tmp=job.host_tmp / "describe", env=env,
                                   bind="bwrap" in chosen.name)
        out["environment"] = environment.describe(jenv)
        job.risks.extend(jenv.risks)
        result = RunAgentResult(status=Status.failed, agent="patch", code=Code.OK)
        got = baseline.baseline(job, wt, plan, env, result, fresh=True)
        if isinstance(got, Baseline):
            out["runnable"] = True
            out["steps"] = [_step(s) for s in got.steps]
            out["baseline"] = result.baseline
        else:
            out["causes"] = [result.summary, *[r for r in job.risks if r.startswith("the base's validation: ")]]
            out["steps"] = [{**a, "output_tail": a["output_tail"][-4000:]} for a in result.validation]
        out["risks"] = [r for r in job.risks if r not in out["causes"]]
        return out
    finally:
        out["duration_s"] = round(time.monotonic() - start, 3)
        if not isinstance(wt, worktree.Failure):
            worktree.remove_tree(wt.path)
        if job.work != Path():
            worktree.remove_tree(job.work)
        shutil.rmtree(job.agent_tmp, ignore_errors=True)
        shutil.rmtree(job.host_tmp, ignore_errors=True)
        if own:
            ledger.close()


def _step(s: Any) -> dict[str, Any]:
    ids = sorted(s.tests.items())
    return {**s.view(), "tests": dict(ids[:MAX_IDS]), "tests_listed": min(len(ids), MAX_IDS),
            "setup": s.setup}
