"""Validation: exactly the tree that would land, checked by the host with the base's recipe and the tests
the agent never saw, each test step held test by test to the base's own run of it (the baseline, run
before the agent): a test that passed on the base and does not pass now fails it, whatever raised it; a
failure is run again on both trees before it counts; what failed on the base already is pre-existing. With
test-defining files touched, once more with the base's versions of those: pass-to-pass judged with the
base's tests, whose failure there is a risk (the task may have been to change a test). The agent's word on
its tests decides nothing here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms.evidence import holdout as held
from proctor.mechanisms.evidence import recipe
from proctor.mechanisms.evidence.compare import Rules
from proctor.mechanisms.evidence.readers import PASSING
from proctor.mechanisms.evidence.verdict import judge as judge_step
from proctor.mechanisms.git import frozen, landing, worktree
from proctor.mechanisms.validation import plan as vplan
from proctor.services.job import heldout, judge, trial
from proctor.services.job.boundary import holdout
from proctor.services.job.context import Job, names
from proctor.services.job.prepare import Prepared


def validate(job: Job, prepared: Prepared, landed: landing.Landing, touched: list[str],
             result: RunAgentResult) -> bool:
    """Validate exactly the tree that would land, with the base's recipe: the work directory made the
    job's commit (ignored files the agent left are gone) with the base's version of every recipe file the
    agent changed (proctor.mechanisms.evidence.recipe) and the held-out tests laid in; with test-defining
    files touched, once more with the base's versions of those too. True once anything was put in, or ran
    in, the work directory: the review checkout is made again then."""
    wt, plan = prepared.wt, prepared.plan
    if not plan.steps:
        job.risks.append(plan.skipped_reason or "validation skipped")
        return False
    cfg = job.settings
    given_cmd = job.request.validate_command or (cfg.validate if cfg else None)
    commands = [c for c in (given_cmd, *(cfg.setup if cfg else ())) if c]
    recipe_changed = recipe.recipe_changes(commands, landed.changed, recipe.runner_of(s.argv for s in plan.steps))
    if recipe_changed:
        job.risks.append(f"the agent changed the validation recipe ({names(recipe_changed)}): validation ran the "
                         "base's version")
    hidden = tuple(holdout(job))
    bad = held.check_dirs(list(hidden))
    if bad:
        result.status, result.code = Status.failed, Code.VALIDATION_FAILED
        job.risks.append(f"validation not run: {bad[0]}")
        return False
    job.progress.phase("validating")
    tree = _tree_with_base(job, landed, recipe_changed, "recipe")
    if isinstance(tree, worktree.Failure):
        return False
    changed_tests = frozenset(touched)

    def touched_file(tid: str, file: str | None) -> bool:
        # A test whose own file the agent changed is judged with the base's version of that file, in the
        # run below; a runner that names no file leaves it to that run whenever any test file changed.
        return bool(changed_tests) and (file in changed_tests if file else True)

    # The job's own run has no held-out file in it (its output is the result's to show); the held-out step
    # runs after it, on its own (proctor.services.job.heldout).
    given = trial.Trial(wt, plan, prepared.env, "validate", trial.job_tree(job, wt, landed, tree),
                        paths=trial.tree_paths(landed), base=prepared.baseline,
                        rules=_rules(job, hidden), touched=touched_file, first=True,
                        seed=prepared.baseline.key if prepared.baseline is not None else None)
    run = trial.run(job, given, result)
    if run is None:
        return True
    run = _again(job, given, landed, run)
    if judge.run(job, run, result, ""):
        return True
    why = heldout.run(job, dataclasses.replace(given, holdout=hidden), run, result)
    if why:
        heldout.failed(job, result, why)
        return True
    if touched:
        job.progress.phase("validating with the base's test files")
        tree = _tree_with_base(job, landed, sorted({*touched, *recipe_changed}), "frozen")
        if isinstance(tree, worktree.Failure):
            return True
        base_files = dataclasses.replace(given, name="frozen", make=trial.job_tree(job, wt, landed, tree),
                                         first=False, touched=lambda tid, file: False)
        run = trial.run(job, base_files, None)
        if run is not None:
            judge.run(job, _again(job, base_files, landed, run), result, " (with the base's test files)")
    return True


def _rules(job: Job, hidden: tuple[str, ...]) -> Rules:
    cfg = job.settings
    owners = held.Owners([rel for d in hidden for rel in held.held_files(Path(d))])
    return Rules(must_pass=frozenset([*(job.request.must_pass or ()), *(cfg.must_pass if cfg else ())]),
                 known=frozenset(cfg.flaky if cfg else ()), held=lambda tid: owners.of(tid) is not None)


def _again(job: Job, given: trial.Trial, landed: landing.Landing, run: vplan.Run) -> vplan.Run:
    """Flaky tests are real: a step failed by tests that passed on the base has them run again, on the
    job's tree and on the base's. One that passes on the job's second run was flaky there (a risk, not a
    failure); one that fails twice on the job's tree and passes on the base's is broken; one that fails on
    both trees stays a risk (never made pre-existing for later jobs: the baseline is not changed), unless
    config lists it as known (`flaky`)."""
    base = given.base
    broken = sorted({t for a in run.attempts if a.failure and a.compared is not None for t in a.compared.broken
                     if not given.touched(t, None if not a.found else _file(a, t))})
    if base is None or not broken or run.killed_reason:
        return run
    job.progress.phase(f"running {len(broken)} failing test(s) again on both trees")
    select = tuple(broken) if all("::" in t for t in broken) else None  # pytest ids: only those run again
    # The job's tree is read for the evidence the base's run left, never for what its own files say it is.
    again = trial.run(job, dataclasses.replace(given, name="again", first=False, observe=False, select=select,
                                               rules=dataclasses.replace(given.rules, known=frozenset(broken))),
                      None)
    on_base = trial.run(job, trial.Trial(given.wt, given.plan, given.env, "again-base",
                                         trial.job_tree(job, given.wt, landed, landed.base_sha),
                                         paths=trial.tree_paths(landed), observe=True, select=select,
                                         seed=given.seed), None)
    if again is None or on_base is None or again.killed_reason or on_base.killed_reason:
        return run
    job_now, base_now = _outcomes(again), _outcomes(on_base)
    flaky = [t for t in broken if job_now.get(t) in PASSING]
    # Fails on the base when run again: an outcome the base's second run gave, and not a pass. A test the
    # second base run did not report stays broken: nothing says the base fails it.
    both = [t for t in broken if job_now.get(t) not in PASSING and base_now.get(t) is not None
            and base_now.get(t) not in PASSING]
    known = frozenset(given.rules.known | set(flaky) | set(both))
    if flaky:
        job.risks.append(f"{len(flaky)} test(s) failed, then passed when run again on the job's tree (flaky?): "
                         f"{names(flaky)}")
    if both:
        job.risks.append(f"{len(both)} test(s) that passed on the base fail on the job's tree and, run again, "
                         f"on the base's too (flaky, or the machine's; config `flaky` lists known ones): {names(both)}")
    rules = dataclasses.replace(given.rules, known=known)
    exits = {a.label: a.exit_code for a in again.attempts}
    base_exits = {a.label: a.exit_code for a in on_base.attempts}
    out = []
    for a in run.attempts:
        step = base.step(a.label)
        if a.compared is None or not a.failure or step is None:
            out.append(a)
            continue
        # Judged again with the second runs' exits: the job's (its flaky test passed, its exit with it), and the
        # base's (a test failing on both trees fails the base's exit too).
        exit_code = exits.get(a.label, a.exit_code) if not both else a.exit_code
        step = dataclasses.replace(step, exit_code=base_exits.get(a.label, step.exit_code)) if both else step
        verdict = judge_step(a.label, exit_code, a.found, step, rules=rules, touched=given.touched)
        # Passing so, the first run's nonzero exit was the flaky test's (or the base's own): explained.
        out.append(dataclasses.replace(a, failure=verdict.failure, risks=verdict.risks, compared=verdict.compared,
                                       explained=verdict.explained or verdict.failure is None))
    return vplan.Run(out, run.killed_reason)


def _file(a: vplan.Attempt, tid: str) -> str | None:
    return next((ev.files.get(tid) for ev in a.found.values() if tid in ev.files), None)


def _outcomes(run: vplan.Run) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in run.attempts:
        for ev in a.found.values():
            out.update(ev.tests)
    return out


def _tree_with_base(job: Job, landed: landing.Landing, paths: list[str], what: str) -> str | None | worktree.Failure:
    """The job's tree with `paths` as the base has them; None when there are none (the job's own tree)."""
    if not paths:
        return None
    tree = frozen.frozen_tree(landed.git_dir, job.host_tmp / f"{what}.index", landed.commit, landed.base_sha, paths)
    if isinstance(tree, worktree.Failure):
        job.risks.append(f"validation not run: the tree with the base's {what} files was not built: {tree.reason}")
    return tree
