"""Validation: exactly the tree that would land, checked by the host with the base's recipe and the tests
the agent never saw, each test step judged on its runner's per-test evidence, not its exit code alone;
with test-defining files touched, once more with the base's versions of those; every test the base defines
held against what ran. The agent's word on its tests decides nothing here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from proctor.contract import Code, RunAgentResult, Status
from proctor.home import proctor_home
from proctor.mechanisms.evidence import holdout as held
from proctor.mechanisms.evidence import recipe
from proctor.mechanisms.git import frozen, landing, worktree
from proctor.mechanisms.validation import plan as vplan
from proctor.services.job import judge, trial
from proctor.services.job.boundary import holdout
from proctor.services.job.context import Job, names
from proctor.services.job.prepare import Prepared


def validate(job: Job, prepared: Prepared, landed: landing.Landing, touched: list[str],
             result: RunAgentResult) -> bool:
    """Validate exactly the tree that would land, with the base's recipe: the work directory made the
    job's commit (ignored files the agent left are gone) with the base's version of every recipe file the
    agent changed (proctor.mechanisms.evidence.recipe) and the held-out tests laid in; with test-defining
    files touched, once more with the base's versions of those too, whose failure is a risk (the task may
    have been to change a test). Each test step is judged on its runner's evidence, not its exit code alone.
    True once anything was put in, or ran in, the work directory: the review checkout is made again then."""
    wt, plan = prepared.wt, prepared.plan
    if not plan.steps and job.settings is not None and job.settings.validate:
        # The repo's configured `validate` counts where autodetection found nothing (issue 24: it was
        # "validation skipped"); read from config and the base's committed file, never the agent's copy.
        plan = vplan.given(job.settings.validate)
    if not plan.steps:
        job.risks.append(plan.skipped_reason or "validation skipped")
        return False
    cfg = job.settings
    commands = [c for c in (job.request.validate_command or (cfg.validate if cfg else None), *(cfg.setup if cfg else ()))
                if c]
    recipe_changed = recipe.recipe_changes(commands, landed.changed, recipe.runner_of(s.argv for s in plan.steps))
    if recipe_changed:
        job.risks.append(f"the agent changed the validation recipe ({names(recipe_changed)}): validation ran the "
                         "base's version")
    hidden = tuple(holdout(job, wt))
    bad = held.check_dirs(list(hidden))
    if bad:
        result.status, result.code = Status.failed, Code.VALIDATION_FAILED
        job.risks.append(f"validation not run: {bad[0]}")
        return False
    job.progress.phase("validating")
    tree = _tree_with_base(job, landed, recipe_changed, "recipe")
    if isinstance(tree, worktree.Failure):
        return False
    given = trial.Trial(wt, landed, plan, prepared.env, "validate", tree, hidden)
    run = trial.run(job, given, result)
    if run is None or judge.run(job, run, result, ""):
        return True
    if _base_tests_missing(job, given, run, result, touched):
        return True
    if touched:
        job.progress.phase("validating with the base's test files")
        tree = _tree_with_base(job, landed, sorted({*touched, *recipe_changed}), "frozen")
        if isinstance(tree, worktree.Failure):
            return True
        run = trial.run(job, dataclasses.replace(given, name="frozen", tree=tree), None)
        if run is not None:
            judge.run(job, run, result, " (with the base's test files)")
    return True


def _base_tests_missing(job: Job, given: trial.Trial, run: vplan.Run, result: RunAgentResult,
                        touched: list[str]) -> bool:
    """Every test the base defines ran (pytest): the base's tree collected once (`--collect-only`, cached by
    base commit and recipe), held against the node ids the job's run reported. A base test that is missing
    while the agent changed no test-defining file fails validation (True): the code under test made it go
    (a parametrize list emptied from the library); with test files changed it is a risk naming them."""
    if not any(a.counts and a.counts.get("source") == "pytest" for a in run.attempts):
        return False
    base = _base_tests(job, given)
    if not base:
        return False
    ran = frozenset().union(*(a.ran_ids for a in run.attempts))
    # A held-out file laid over a visible one replaces its tests: those are the held-out file's to define.
    held_paths = {rel for d in given.holdout for rel in held.held_files(Path(d))}
    missing = sorted(t for t in base - ran if t.split("::", 1)[0] not in held_paths)
    if not missing:
        return False
    what = f"{len(missing)} of the base's {len(base)} tests did not run: {names(missing)}"
    if touched:
        job.risks.append(f"{what} (the agent changed files that define the tests)")
        return False
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: {what}, and the agent changed no file that defines the tests")
    return True


def _base_tests(job: Job, given: trial.Trial) -> frozenset[str] | None:
    cfg, landed = job.settings, given.landed
    key = hashlib.sha256(json.dumps([landed.base_sha, [s.argv for s in given.plan.steps],
                                     dataclasses.asdict(cfg) if cfg else None], default=str).encode()).hexdigest()
    cache = proctor_home() / "baselines" / f"{key}.json"
    try:
        return frozenset(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    job.progress.phase("collecting the base's tests")
    run = trial.run(job, dataclasses.replace(given, name="base", tree=landed.base_sha, holdout=(),
                                             collect_only=True), None)
    ids = frozenset().union(*(a.item_ids for a in run.attempts)) if run is not None else frozenset()
    if ids:
        try:
            cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            cache.write_text(json.dumps(sorted(ids)))
        except OSError:
            pass  # uncached, the next job collects again
    return ids or None


def _tree_with_base(job: Job, landed: landing.Landing, paths: list[str], what: str) -> str | None | worktree.Failure:
    """The job's tree with `paths` as the base has them; None when there are none (the job's own tree)."""
    if not paths:
        return None
    tree = frozen.frozen_tree(landed.git_dir, job.host_tmp / f"{what}.index", landed.commit, landed.base_sha, paths)
    if isinstance(tree, worktree.Failure):
        job.risks.append(f"validation not run: the tree with the base's {what} files was not built: {tree.reason}")
    return tree

