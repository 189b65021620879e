"""One validation run of a tree in the job's work directory: the tree made there (a throw-away `.git`,
the held-out tests laid in, bytecode gone), the job's environment mirroring the developer's, the evidence
hooks laid out, every step wrapped in the agent's confinement minus the network. It reports what ran;
what that means is the judge's. The base's own run (before the agent) and the job's runs are the same
run of different trees: one environment, one confinement, one way of reading the runners."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from proctor.contract import RunAgentResult
from proctor.mechanisms import confine
from proctor.mechanisms.evidence import holdout as held
from proctor.mechanisms.evidence.baseline import Baseline
from proctor.mechanisms.evidence.compare import Rules
from proctor.mechanisms.evidence.instrument import instrument, strip_bytecode
from proctor.mechanisms.git import landing, worktree
from proctor.mechanisms.git.materialise import materialise
from proctor.mechanisms.git.vouch import GITLINK as GITLINK_MODE
from proctor.mechanisms.process.spawn import Exit, Spawn
from proctor.home import proctor_home
from proctor.mechanisms.validation import caches, environment
from proctor.mechanisms.validation import plan as vplan
from proctor.mechanisms.validation import probe
from proctor.mechanisms.validation.job_environment import JobEnvironment
from proctor.services.job.boundary import hide_holdout, hide_home, main_repo, person_checkout_hidden
from proctor.services.job.context import Job
from proctor.services.job.record import validation_log

Make = Callable[[], "worktree.Failure | None"]
RunOne = Callable[[Sequence[str], bytes, str], Exit]


@dataclasses.dataclass(frozen=True)
class Trial:
    """What one run validates: `make` puts the tree in the work directory (with its throw-away `.git`),
    `paths` are the tree's entries when the host knows them (no walk for bytecode then), `holdout` is laid
    in; `name` keeps its tmp and evidence apart from the job's other runs. `base`: the base's own run to hold
    each step to; `observe`: this is the base's own run; `select`: pytest ids to run alone (a failure run
    again)."""

    wt: worktree.Worktree
    plan: vplan.Plan
    env: dict[str, str]
    name: str
    make: Make
    paths: Callable[[], Iterable[str] | None] = lambda: None
    holdout: tuple[str, ...] = ()
    base: Baseline | None = None
    rules: Rules = Rules()
    touched: Callable[[str, str | None], bool] = lambda tid, file: False
    observe: bool = False
    select: tuple[str, ...] | None = None
    first: bool = False  # the job's first run of its own tree: the environment's risks and the probe are had here
    seed: str | None = None  # the baseline's key: its build caches are laid in (proctor.mechanisms.validation.caches)
    keep_seed: bool = False  # the base's own (confined) run: its build caches are kept for the runs after it
    # Run after the plan, in the same checkout, environment and confinement: `after(run_one, scratch)`, where
    # run_one(argv, stdin, name) runs one command there and `scratch` is a host dir it sees read-only.
    after: Callable[[RunOne, Path], None] | None = None
    log: Path | None = None  # where its output goes (default: the job's validation.log)
    visible: tuple[Path, ...] = ()  # what of the person's checkout validation shows (set by run itself)


def job_tree(job: Job, wt: worktree.Worktree, landed: landing.Landing, tree: str | None) -> Make:
    """The job's `tree` (None: the one already in the work directory, the job's own) in the work dir."""
    def make() -> worktree.Failure | None:
        made = (materialise(job.work, landed.git_dir, tree, landed.index, known=landed.known)
                if tree is not None else None)
        return made or landing.scratch_git_dir(job.work, landed, wt, landed.index)
    return make


def tree_paths(landed: landing.Landing) -> Callable[[], Iterable[str] | None]:
    def paths() -> Iterable[str] | None:
        known = landed.known  # the work dir is exactly its tree now, when the host knows it (no walk then)
        return None if known is None or known.lost else (p for p, m in known.modes.items() if m != GITLINK_MODE)
    return paths


def fresh_base(job: Job, wt: worktree.Worktree) -> Make:
    """The base, checked out fresh in the work dir before the agent runs (the dir must not be there: it is
    the agent's once it exits, and is removed after the base's run)."""
    def make() -> worktree.Failure | None:
        try:
            job.work.mkdir(0o700)
        except OSError as exc:
            return worktree.Failure(f"cannot make {job.work}: {exc}")
        gd = job.work / ".git"
        return (worktree.init_git_dir(job.work, wt.repo, wt.branch) or worktree.set_ref(gd, f"refs/heads/{wt.branch}",
                                                                                       wt.base_sha)
                or worktree.checkout(gd, job.work, wt.base_sha))
    return make


def run(job: Job, trial: Trial, result: RunAgentResult | None) -> vplan.Run | None:
    """One validation in the work directory, made the trial's tree first, with a throw-away `.git`; the
    job's git dir (at the review path) is read-only to it. The job's environment
    (proctor.mechanisms.validation.environment) mirrors the developer's: the repo's keys from config and the
    base's `.proctor.toml`, a private HOME and caches, the validated tree's code first on the import path, the
    main checkout's dependency dirs shared read-only; on the job's first run a probe in that environment says
    where the code under test resolves, and one outside the validated tree is a risk. The held-out tests are
    laid in last; `result` (the first run's) is told how many. Network: none, setup included. Setup that needs
    the registries ran before the agent, on the base's files (code the agent wrote never has a network).
    None (and a risk) when it could not run."""
    wt, name = trial.wt, trial.name
    # A fresh dir for every run, never one an earlier run's code wrote (a symlink planted in a reused one
    # had the host copy a cache through it, outside the sandbox: found in review).
    tmpdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=job.host_tmp))
    made = trial.make()
    if made is not None:
        job.risks.append(f"validation not run: {made.reason}")
        return None
    try:
        strip_bytecode(job.work, trial.paths())
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
    cfg = job.settings
    bind = job.confiner is not None and "bwrap" in job.confiner.name
    jenv = environment.prepare(job.work, wt.repo.path, trial.plan, cfg, tmp=tmpdir, env=trial.env, bind=bind)
    failure = environment.apply(jenv)
    if failure is not None:
        job.risks.append(f"validation not run: {failure}")
        return None
    seeds = caches.Seeds(proctor_home() / "caches")
    if trial.seed and not trial.keep_seed:
        for var in caches.SEEDED:
            if var in jenv.env:
                seeds.lay(trial.seed, var, Path(jenv.env[var]))
    if trial.first:  # every run has the same environment: its risks are said once
        job.risks.extend(jenv.risks)
        if jenv.shares and (job.confiner is None or job.confiner.name == "none"):
            job.risks.append("validation ran unconfined with the main checkout's "
                             f"{', '.join(s.target.name for s in jenv.shares)} linked in: writable to it")
        job.ledger.append("job.environment", {"jobId": job.job_id, **environment.describe(jenv)},
                          job_id=job.job_id)
    plan = environment.plan_for(trial.plan, cfg, given=bool(job.request.validate_command))
    readonly = (*main_repo(wt), wt.path, *jenv.readonly)
    # The person's checkout is hidden from the code under test but what validation shares from it (its
    # node_modules, the repo's own venv there); a copied file is laid in by the host.
    run = _run_in(job, plan, jenv, readonly, tmpdir, dataclasses.replace(trial, visible=jenv.shown))
    if run is not None and trial.seed and trial.keep_seed and not run.killed_reason:
        for var in caches.SEEDED:
            if var in jenv.env:
                why = seeds.keep(trial.seed, var, Path(jenv.env[var]))
                if why:
                    job.risks.append(f"{why}: each job's validation builds it cold")
    return run


def _run_in(job: Job, plan: vplan.Plan, jenv: JobEnvironment, readonly: tuple[Path, ...],
            tmpdir: Path, trial: Trial) -> vplan.Run | None:
    # The evidence hooks sit in a host-owned dir the sandbox sees read-only at the same path; what they
    # report goes to the run's private tmp (proctor.mechanisms.evidence.instrument says why env, not argv).
    base_env = {**trial.env, **jenv.env}
    try:
        inst = instrument(Path(tempfile.mkdtemp(prefix=f"{trial.name}-evidence-", dir=job.host_tmp)), tmpdir,
                          base_env, select=trial.select, root=job.work)
    except OSError as exc:
        job.risks.append(f"validation not run: its evidence reporter could not be laid out: {exc}")
        return None
    binds = (*jenv.ro_binds, (inst.plugin_dir, inst.plugin_dir))
    confined = _confined(job, plan, job.work, readonly, tmpdir, binds, trial.visible, trial.wt)
    if confined is None:
        return None
    run_env = {**base_env, **inst.env, "TMPDIR": str(tmpdir)}
    checks = vplan.Checks(inst, job.work, trial.base, trial.rules, trial.touched, trial.observe)
    if trial.first:
        def run_probe(argv: list[str]) -> tuple[int | None, bytes]:
            wrapped = _confined(job, vplan.Plan((vplan.Step("probe", tuple(argv)),)), job.work, readonly, tmpdir,
                                jenv.ro_binds, trial.visible, trial.wt)
            if wrapped is None:
                return None, b""
            # The probe runs without the evidence hooks (their dir is not shown to it): it asks Python and
            # node where a name resolves, and reports nothing of a test run.
            ex = job.runner.run(Spawn(argv=wrapped.steps[0].argv, cwd=job.work,
                                      env={**base_env, "TMPDIR": str(tmpdir)}, deadline_s=60,
                                      name=f"probe-{job.job_id}", poll=job.poll, tail_bytes=64_000))
            return ex.exit_code, ex.stdout

        probe_risks, found = probe.check(jenv, run_env, run_probe)
        job.risks.extend(probe_risks)
        job.ledger.append("job.probe", {"jobId": job.job_id, "found": found, "risks": probe_risks},
                          job_id=job.job_id)
    run = vplan.run(confined, job.runner, cwd=job.work, env=run_env, timeout_s=job.config.validate_timeout,
                    name=f"{trial.name}-{job.job_id}", poll=job.poll, log=trial.log or validation_log(job.job_id),
                    watch=job.progress.watch(None), checks=checks)
    if trial.after is not None and not run.killed_reason:
        env = {**base_env, "TMPDIR": str(tmpdir)}

        def run_one(argv: Sequence[str], stdin: bytes, name: str) -> Exit:
            wrapped = _confined(job, vplan.Plan((vplan.Step(name, tuple(argv)),)), job.work, readonly, tmpdir, binds,
                                trial.visible, trial.wt)
            if wrapped is None:
                return Exit(None, spawn_error="confinement could not be had")
            return job.runner.run(Spawn(argv=wrapped.steps[0].argv, cwd=job.work, env=env, stdin=stdin,
                                        deadline_s=job.config.validate_timeout, name=f"{name}-{job.job_id}",
                                        poll=job.poll))

        trial.after(run_one, inst.plugin_dir)
    return run


def _confined(job: Job, plan: vplan.Plan, checkout: Path, readonly: tuple[Path, ...], tmpdir: Path,
              ro_binds: tuple[tuple[Path, Path], ...] = (), visible: tuple[Path, ...] = (),
              wt: worktree.Worktree | None = None) -> vplan.Plan | None:
    """Validation runs code the agent may have written (a conftest.py, a build script): it gets the agent's
    confinement in a checkout of its own, minus the network and the CLI's state dirs, with the review
    checkout read-only; its setup steps too (a setup script the agent rewrote sent `.env` to a listener
    through the registry proxy, found in review). `ro_binds` are the job environment's read-only shares
    (proctor.mechanisms.validation.environment) and the evidence hooks' dir. None (and a risk) when it
    cannot be had."""
    roots = confine.job_roots(checkout, tmpdir, readonly=readonly, network=False)
    if not isinstance(roots, confine.Unavailable) and ro_binds:
        roots = dataclasses.replace(roots, ro_binds=ro_binds)
    if not isinstance(roots, confine.Unavailable):
        # The user's home is hidden from the code under test as from the agent: it is the agent's code. So are
        # the held-out dirs: their files are laid in by the host, their sealed answers never enter at all.
        roots = hide_holdout(job, roots)
        if wt is not None:
            roots = person_checkout_hidden(job, wt, roots, visible)
        if not isinstance(roots, confine.Unavailable):
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
