"""The job's validation, run again on the tree that would land (the target moved since the job's base).

Owns one re-validation: the tree made in a scratch checkout beside the job's (`.<jobId>.land/tree`), the
plan, and the verdict. It composes the host's own pieces, in the host's order (proctor.services.job.run_agent
`_validation_run`): the plan is the job's `--validate-cmd`, else autodetected on the *target's* tree, never
the agent's (an agent must not pick its own test: one adding a `package.json` would make the root
ambiguous and skip validation); the repo's settings come from `.proctor.toml` at the target; the job
environment is proctor.mechanisms.validation.environment's; the confinement is the host's for validation — the job's
confine mode, network off, the main repo, the job's checkout and the host's git dir read-only,
$PROCTOR_HOME hidden. With test-defining files changed, a second run holds the target's versions of them.

Why not a call into the host: its validation path (`_validation_run`, `_confined_validation`, `_judge`)
takes the whole in-flight job (`_Job`: its confiner, runner, risks, ledger, tmp dirs). Lifting those into one
public function of proctor.services.job (a `ValidationContext` of confiner, runner, config, poll, log and risk sink,
and `validate_tree(ctx, checkout, git_dir, tree, plan, ...) -> Run`) would let the host and this module
share it; until then this is the same composition of the same public pieces. It never runs git in a
directory validation could write but the scratch checkout's own throw-away `.git`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.mechanisms import confine
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.evidence.instrument import instrument, strip_bytecode
from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.validation import environment, plan as validate
from proctor.mechanisms.git import frozen, landing, worktree
from proctor.mechanisms.git.materialise import materialise
from proctor.mechanisms.git.trees import changed_paths
from proctor.services.job import record
from proctor.mechanisms.git.command import unredirected_env
from proctor.mechanisms.process.local import LocalRunner, ProcessRunner


@dataclass
class Revalidation:
    ran: bool = False
    passed: bool = False
    attempts: list[dict[str, Any]] = field(default_factory=list)  # validate.Attempt.record() + label
    tests_attempted: list[str] = field(default_factory=list)
    risks: list[str] = field(default_factory=list)
    reason: str = ""  # why it did not pass (or did not run)
    confinement: str | None = None
    log: str | None = None

    def summary(self) -> dict[str, Any]:
        """For the ledger row: no output tails (those are in the log)."""
        return {"ran": self.ran, "passed": self.passed, "tests_attempted": self.tests_attempted,
                "reason": self.reason, "confinement": self.confinement, "risks": self.risks[:20]}


@dataclass(frozen=True)
class Subject:
    """What to validate: `commit` (its tree) in the host's git dir, against `target` (the trusted side)."""

    job_id: str
    branch: str
    repo: worktree.Repo
    git_dir: Path  # the host's (proctor.services.review.objects), read-only to validation
    commit: str
    target: str
    checkout: Path  # the scratch checkout: made here, removed by the caller
    job_checkout: Path  # the job's review checkout: read-only to validation
    validate_command: str | None
    confine_mode: str


def _scratch_git(s: Subject, index: Path, rev: str) -> worktree.Failure | None:
    """The checkout's throw-away `.git` (some builds ask git for a version): HEAD on `rev`, objects borrowed
    from the host's git dir, which stays read-only. `materialise` removes it each time: it is not the tree's."""
    gd = s.checkout / ".git"
    return (worktree.init_git_dir(s.checkout, s.repo, s.branch, alternates=(s.git_dir / "objects",))
            or worktree.set_ref(gd, f"refs/heads/{s.branch}", rev) or landing.fresh_index_copy(index, gd))


def plan_for(s: Subject, index: Path, repo_tables: dict[str, dict[str, Any]] | None = None,
             ) -> tuple[validate.Plan, RepoSettings | None, list[str]]:
    """The plan and the repo's settings, both from the trusted side: the command given, or the target's tree;
    config.toml's `[repos."<path>"]` over the target's `.proctor.toml`."""
    risks: list[str] = []
    if s.validate_command:
        plan = validate.given(s.validate_command)
    else:
        made = materialise(s.checkout, s.git_dir, s.target, index)
        plan = validate.Plan((), f"validation not run: {made.reason}") if made else validate.detect(s.checkout)
    cfg = environment.settings(repo_tables, s.repo.path, s.git_dir, s.target)
    if isinstance(cfg, str):
        risks.append(cfg)
        cfg = None
    return environment.plan_for(plan, cfg, given=bool(s.validate_command)), cfg, risks


def revalidate(s: Subject, config: Config, *, poll: Callable[[], str | None] | None = None,
               runner: ProcessRunner | None = None) -> Revalidation:
    out = Revalidation(log=str(record.job_dir(s.job_id) / "land-validation.log"))
    confiner = confine.choose(s.confine_mode, confine.detect())  # type: ignore[arg-type]
    if isinstance(confiner, confine.Unavailable):
        out.reason = confiner.reason
        return out
    out.confinement = confiner.name
    index = s.checkout.parent / "tree.index"
    try:
        s.checkout.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        out.reason = f"cannot make the scratch checkout: {exc}"
        return out
    plan, cfg, risks = plan_for(s, index, config.repos)
    out.risks += risks
    if not plan.steps:
        out.reason = plan.skipped_reason or "no validation command"
        return out
    runner = runner or LocalRunner(limits=config.limits.resolve())
    tmp = Path(tempfile.mkdtemp(prefix=f"proctor-land-{s.job_id}-"))
    try:
        run = _run(s, config, confiner, plan, cfg, index, s.commit, "land", tmp / "land", runner, poll, out)
        if run is None or not _judge(run, out, "", config.validate_timeout):
            return out
        touched = frozen.test_defining(_changed(s))
        if touched:
            tree = frozen.frozen_tree(s.git_dir, s.checkout.parent / "frozen.index", s.commit, s.target, touched)
            if isinstance(tree, worktree.Failure):
                out.passed, out.reason = False, f"the target's test files were not run: {tree.reason}"
                return out
            run = _run(s, config, confiner, plan, cfg, index, tree, "land-frozen", tmp / "frozen", runner, poll, out)
            if run is None or not _judge(run, out, " (with the target's test files)", config.validate_timeout):
                return out
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _changed(s: Subject) -> list[str]:
    got = changed_paths(s.git_dir, s.target, s.commit)
    return [] if isinstance(got, worktree.Failure) else got


def _run(s: Subject, config: Config, confiner: confine.Confiner, plan: validate.Plan,
         cfg: RepoSettings | None, index: Path, tree: str, name: str, tmpdir: Path,
         runner: ProcessRunner, poll: Callable[[], str | None] | None, out: Revalidation) -> validate.Run | None:
    made = materialise(s.checkout, s.git_dir, tree, index) or _scratch_git(s, index, s.commit)
    if made is not None:
        out.reason = f"validation not run: {made.reason}"
        return None
    try:
        strip_bytecode(s.checkout)
    except OSError as exc:
        out.reason = f"validation not run: the tree's bytecode could not be removed: {exc}"
        return None
    env = {**unredirected_env(), "PROCTOR_JOB_ID": s.job_id, "TMPDIR": str(tmpdir)}
    jenv = environment.prepare(s.checkout, s.repo.path, plan, cfg, tmp=tmpdir, env=env,
                               bind="bwrap" in confiner.name)
    failure = environment.apply(jenv)
    if failure is not None:
        out.reason = f"validation not run: {failure}"
        return None
    out.risks += [r for r in jenv.risks if r not in out.risks]
    readonly = (s.repo.path, s.repo.common_dir, s.job_checkout, s.git_dir.parent, *jenv.readonly)
    roots = confine.job_roots(s.checkout, tmpdir, readonly=readonly, network=False)
    if not isinstance(roots, confine.Unavailable):
        # The merged tree's code is the agent's: the person's untracked and ignored files are hidden from it
        # as from the job's validation (its git dir, `copy` files and shares shown).
        copies = tuple(s.repo.path / c for c in (cfg.copy if cfg is not None else ()))
        hidden = confine.checkout_hidden(roots, s.repo.path, (s.repo.common_dir, *copies, *jenv.shown))
        if isinstance(hidden, str):
            out.risks += [hidden] if hidden not in out.risks else []
        else:
            roots = hidden
    if isinstance(roots, confine.Unavailable):
        out.reason = f"validation not run: {roots.reason}"
        return None
    # Judged on the runner's evidence as the job's validation is (proctor.mechanisms.evidence): the merged tree runs
    # the agent's code, so its exit code is the agent's word too.
    try:
        inst = instrument(tmpdir.parent / f"{name}-evidence", tmpdir, {**env, **jenv.env})
    except OSError as exc:
        out.reason = f"validation not run: its evidence reporter could not be laid out: {exc}"
        return None
    roots = dataclasses.replace(roots, ro_binds=(*jenv.ro_binds, (inst.plugin_dir, inst.plugin_dir)))
    steps = []
    for step in plan.steps:
        wrapped = confiner.wrap(list(step.argv), roots)
        if isinstance(wrapped, confine.Unavailable):
            out.reason = f"validation not run: {wrapped.reason}"
            return None
        steps.append(validate.Step(step.label, tuple(wrapped.argv), step.argv))
    unconfined = "confinement is off: the merged tree's validation ran unconfined"
    if confiner.name == "none" and unconfined not in out.risks:
        out.risks.append(unconfined)
    out.ran = True
    # No baseline of the target's own run is held here: every test must pass, as the plain rules say.
    checks = validate.Checks(inst, s.checkout)
    return validate.run(validate.Plan(tuple(steps)), runner, cwd=s.checkout, env={**env, **jenv.env, **inst.env},
                        timeout_s=config.validate_timeout, name=f"{name}-{s.job_id}", poll=poll,
                        log=Path(out.log) if out.log else None, checks=checks)


def _judge(run: validate.Run, out: Revalidation, suffix: str, timeout: float) -> bool:
    """Record one run; True when it passed (every command ran and exited 0)."""
    out.tests_attempted += [f"{a.line(timeout)}{suffix}" for a in run.attempts]
    out.attempts += [{**a.record(), "label": f"{a.label}{suffix}"} for a in run.attempts]
    if run.killed_reason:
        out.passed, out.reason = False, f"validation {run.killed_reason}{suffix}"
        return False
    failed = [a for a in run.attempts if not a.passed]
    if failed:
        first = failed[0]
        why = f" ({first.failure})" if first.failure else ""
        out.passed, out.reason = False, f"validation failed{suffix}: {first.line(timeout)}{why}"
        return False
    for a in run.attempts:
        out.risks += [f"{r}{suffix}" for r in a.risks if f"{r}{suffix}" not in out.risks]
    out.passed, out.reason = True, ""
    return True
