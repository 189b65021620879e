"""One validation run of a tree in the job's work directory: the tree made there (a throw-away `.git`,
the held-out tests laid in, bytecode gone), the job's environment mirroring the developer's, the evidence
reporter laid out, every step wrapped in the agent's confinement minus the network. It reports what ran;
what that means is the judge's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from proctor.contract import RunAgentResult
from proctor.mechanisms import confine
from proctor.mechanisms.evidence import holdout as held
from proctor.mechanisms.evidence.instrument import instrument, strip_bytecode
from proctor.mechanisms.git import landing, worktree
from proctor.mechanisms.git.materialise import materialise
from proctor.mechanisms.git.vouch import GITLINK as GITLINK_MODE
from proctor.mechanisms.process.spawn import Spawn
from proctor.mechanisms.validation import environment
from proctor.mechanisms.validation import plan as vplan
from proctor.mechanisms.validation import probe
from proctor.mechanisms.validation.job_environment import JobEnvironment
from proctor.services.job.boundary import hide_home, main_repo
from proctor.services.job.context import Job
from proctor.services.job.record import validation_log


@dataclasses.dataclass(frozen=True)
class Trial:
    """What one run validates: the job's `tree` (None: the one already in the work directory, the job's
    own), with `holdout` laid in; `name` keeps its tmp and evidence apart from the job's other runs."""

    wt: worktree.Worktree
    landed: landing.Landing
    plan: vplan.Plan
    env: dict[str, str]
    name: str
    tree: str | None
    holdout: tuple[str, ...] = ()
    collect_only: bool = False


def run(job: Job, trial: Trial, result: RunAgentResult | None) -> vplan.Run | None:
    """One validation in the work directory, made `tree` first (when not the job's own, already there),
    with a throw-away `.git`; the job's git dir (at the review path) is read-only to it. The job's
    environment (proctor.mechanisms.validation.environment) mirrors the developer's: the repo's keys from
    config and the base's `.proctor.toml`, a private HOME and caches, the validated tree's code first on
    the import path, the main checkout's dependency dirs shared read-only; a probe in that environment says
    where the code under test resolves, and one outside the validated tree is a risk. The held-out tests
    are laid in last; `result` (the first run's) is told how many. Network: none, setup included. Setup
    that needs the registries ran before the agent, on the base's files (code the agent wrote never has a
    network). None (and a risk) when it could not run."""
    wt, landed, name = trial.wt, trial.landed, trial.name
    tmpdir = job.host_tmp / f"{name}-tmp"
    made = (materialise(job.work, landed.git_dir, trial.tree, landed.index, known=landed.known)
            if trial.tree is not None else None) or landing.scratch_git_dir(job.work, landed, wt, landed.index)
    if made is not None:
        job.risks.append(f"validation not run: {made.reason}")
        return None
    known = landed.known  # the work dir is exactly its tree now, when the host knows it (no walk then)
    try:
        strip_bytecode(job.work, None if known is None or known.lost else
                       (p for p, m in known.modes.items() if m != GITLINK_MODE))
    except OSError as exc:
        job.risks.append(f"validation not run: the tree's bytecode could not be removed: {exc}")
        return None
    if trial.holdout:
        laid = held.lay(job.work, list(trial.holdout))
        if isinstance(laid, str):
            job.risks.append(f"validation failed: {laid}")
            return vplan.Run([vplan.Attempt("held-out tests", None, False, failure=laid)])
        if result is not None:
            result.holdout = laid.record()
    first = name == "validate"  # the frozen run has the same environment: its risks are said once
    cfg = job.settings
    bind = job.confiner is not None and "bwrap" in job.confiner.name
    jenv = environment.prepare(job.work, wt.repo.path, trial.plan, cfg, tmp=tmpdir, env=trial.env, bind=bind)
    failure = environment.apply(jenv)
    if failure is not None:
        job.risks.append(f"validation not run: {failure}")
        return None
    if first:
        job.risks.extend(jenv.risks)
        if jenv.shares and (job.confiner is None or job.confiner.name == "none"):
            job.risks.append("validation ran unconfined with the main checkout's "
                             f"{', '.join(s.target.name for s in jenv.shares)} linked in: writable to it")
        job.ledger.append("job.environment", {"jobId": job.job_id, **environment.describe(jenv)},
                          job_id=job.job_id)
    plan = environment.plan_for(trial.plan, cfg, given=bool(job.request.validate_command))
    readonly = (*main_repo(wt), wt.path, *jenv.readonly)
    return _run_in(job, plan, jenv, readonly, tmpdir, trial, first, frozenset(landed.changed))


def _run_in(job: Job, plan: vplan.Plan, jenv: JobEnvironment, readonly: tuple[Path, ...],
            tmpdir: Path, trial: Trial, first: bool, changed: frozenset[str]) -> vplan.Run | None:
    # The evidence plugin sits in a host-owned dir the sandbox sees read-only at the same path; what it
    # reports goes to the run's private tmp (proctor.mechanisms.evidence.instrument says why env, not argv).
    run_env = {**trial.env, **jenv.env}
    try:
        inst = instrument(job.host_tmp / f"{trial.name}-evidence", tmpdir, run_env)
    except OSError as exc:
        job.risks.append(f"validation not run: its evidence reporter could not be laid out: {exc}")
        return None
    binds = (*jenv.ro_binds, (inst.plugin_dir, inst.plugin_dir))
    confined = _confined(job, plan, job.work, readonly, tmpdir, binds)
    if confined is None:
        return None
    run_env = {**run_env, **inst.env, "TMPDIR": str(tmpdir)}
    if trial.collect_only:
        run_env["PYTEST_ADDOPTS"] += " --collect-only"
    checks = vplan.Evidence.of_change(inst, job.work, changed)
    if first:
        def run_probe(argv: list[str]) -> tuple[int | None, bytes]:
            wrapped = _confined(job, vplan.Plan((vplan.Step("probe", tuple(argv)),)), job.work, readonly, tmpdir,
                                jenv.ro_binds)
            if wrapped is None:
                return None, b""
            ex = job.runner.run(Spawn(argv=wrapped.steps[0].argv, cwd=job.work, env=run_env, deadline_s=60,
                                      name=f"probe-{job.job_id}", poll=job.poll, tail_bytes=64_000))
            return ex.exit_code, ex.stdout

        probe_risks, found = probe.check(jenv, run_env, run_probe)
        job.risks.extend(probe_risks)
        job.ledger.append("job.probe", {"jobId": job.job_id, "found": found, "risks": probe_risks},
                          job_id=job.job_id)
    return vplan.run(confined, job.runner, cwd=job.work, env=run_env, timeout_s=job.config.validate_timeout,
                     name=f"{trial.name}-{job.job_id}", poll=job.poll, log=validation_log(job.job_id),
                     watch=job.progress.watch(None), checks=checks)


def _confined(job: Job, plan: vplan.Plan, checkout: Path, readonly: tuple[Path, ...], tmpdir: Path,
              ro_binds: tuple[tuple[Path, Path], ...] = ()) -> vplan.Plan | None:
    """Validation runs code the agent may have written (a conftest.py, a build script): it gets the agent's
    confinement in a checkout of its own, minus the network and the CLI's state dirs, with the review
    checkout read-only; its setup steps too (a setup script the agent rewrote sent `.env` to a listener
    through the registry proxy, found in review). `ro_binds` are the job environment's read-only shares
    (proctor.mechanisms.validation.environment) and the evidence plugin's dir. None (and a risk) when it
    cannot be had."""
    roots = confine.job_roots(checkout, tmpdir, readonly=readonly, network=False)
    if not isinstance(roots, confine.Unavailable) and ro_binds:
        roots = dataclasses.replace(roots, ro_binds=ro_binds)
    if not isinstance(roots, confine.Unavailable):
        # The user's home is hidden from the code under test as from the agent: it is the agent's code.
        roots = hide_home(job, roots, [s.argv[0] for s in plan.steps if s.argv])
    if isinstance(roots, confine.Unavailable):
        job.risks.append(f"validation not run: {roots.reason}")
        return None
    if job.confiner is None:
        return plan
    steps = []  # no step gets a proxy's variables: none has a network
    for step in plan.steps:
        wrapped = job.confiner.wrap(list(step.argv), roots)
        if isinstance(wrapped, confine.Unavailable):
            job.risks.append(f"validation not run: {wrapped.reason}")
            return None
        steps.append(vplan.Step(step.label, tuple(wrapped.argv), step.source or step.argv))
    return vplan.Plan(tuple(steps))
