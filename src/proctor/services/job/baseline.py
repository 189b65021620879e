"""The base's own validation, before the agent: the plan run on a fresh checkout of the base in exactly the
environment and confinement validation will use, every test's outcome kept by id (the baseline the job's
run is held to: proctor.mechanisms.evidence.compare), and the job refused before any agent runs when the
base cannot run (no runner, a missing generated file, a cache path the runner cannot write, no test found
where the repo has tests), with the cause read from the runner's output and the config line that fixes it.

A baseline is kept ($PROCTOR_HOME/baselines, sealed by the host) keyed on everything that changes it
without a new commit: the base commit and the settings read from it, the plan, the shared dependency dirs
and the venv, the toolchains' executables, the copied files, the host's evidence hooks, the confinement.
Only a confined run's baseline is kept: under `--confine off` validation runs as the person, and so could
a previous job's code that wrote one.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from proctor.contract import Code, RunAgentResult, Status
from proctor.home import proctor_home
from proctor.mechanisms.evidence import baseline as base_mod
from proctor.mechanisms.evidence import runners
from proctor.mechanisms.evidence.baseline import Baseline, Cache, Cause, Facts, StepBase
from proctor.mechanisms.git import worktree
from proctor.mechanisms.git.command import git
from proctor.mechanisms.validation import plan as vplan
from proctor.mechanisms.validation.shares import node_modules_dirs
from proctor.mechanisms.validation.venvs import python_env
from proctor.services.job import judge, trial
from proctor.services.job.context import Job

TOOLS = ("python", "python3", "node", "npm", "npx", "pnpm", "yarn", "bun", "go", "cargo", "rustc", "make", "cc",
         "gcc", "pytest", "tox", "uv", "poetry", "cmake", "ctest")
VOLATILE = frozenset({"HOME", "TMPDIR", "PWD", "OLDPWD", "SHLVL", "_", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                      "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR"})


@functools.cache
def _hooks_version() -> str:
    """The host's evidence code (its hooks and readers): a baseline read by other code is not this one's."""
    here = Path(base_mod.__file__).parent
    h = hashlib.sha256()
    for p in sorted([*here.glob("*.py"), *here.glob("*.cjs")]):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cache_key(job: Job, wt: worktree.Worktree, plan: vplan.Plan, env: dict[str, str]) -> str:
    main, cfg = wt.repo.path, job.settings
    path = env.get("PATH", "")
    tools = {t: base_mod.identity(Path(w)) for t in {*TOOLS, *(s.argv[0] for s in plan.steps if s.argv)}
             if (w := shutil.which(t, path=path))}
    penv, _ = python_env(main, os.environ, Path(os.environ.get("HOME") or str(Path.home())))
    venvs = [v for v in {env.get("VIRTUAL_ENV"), str(penv.venv) if penv else None} if v]
    deps: dict[str, object] = {}
    for v in venvs:
        for sp in sorted(glob.glob(f"{v}/lib/python*/site-packages"))[:4]:
            deps[sp] = base_mod.identity(Path(sp))
    shared = cfg.share if cfg is not None and cfg.share is not None else ("node_modules", ".venv", "venv", "vendor")
    for rel in shared:
        deps[rel] = base_mod.identity(main / rel)
    for rel in node_modules_dirs(main):
        deps[rel] = base_mod.identity(main / rel)
    for var in ("GOMODCACHE", "CARGO_HOME", "GOPATH"):
        if env.get(var):
            deps[var] = base_mod.identity(Path(env[var]))
    return base_mod.key({
        "base": wt.base_sha, "plan": [list(s.argv) for s in plan.steps],
        "settings": asdict(cfg) if cfg is not None else None, "validate": job.request.validate_command,
        "confinement": job.confiner.name if job.confiner is not None else None,
        "hooks": _hooks_version(), "tools": tools, "deps": deps,
        "copies": {c: base_mod.digest(main / c) for c in (cfg.copy if cfg is not None else ())},
        "env": sorted((k, v) for k, v in env.items() if k not in VOLATILE and not k.startswith("PROCTOR_")),
    })


@dataclass(frozen=True)
class NotRunnable:
    """The base cannot run (or its run was stopped): `result` says why; nothing may launch."""

    reason: str


def baseline(job: Job, wt: worktree.Worktree, plan: vplan.Plan, env: dict[str, str],
             result: RunAgentResult, *, fresh: bool = False) -> Baseline | NotRunnable | None:
    """The base's baseline (cached or run now), or None: with no plan there is nothing to run. When the base
    cannot run, `result` says why (failed / BASELINE_FAILED, or the stop's code) and nothing launches."""
    if not plan.steps or job.confiner is None:
        return None
    start = time.monotonic()
    confined = job.confiner.name != "none"
    cache = Cache(proctor_home() / "baselines")
    key = cache_key(job, wt, plan, env)
    got = cache.load(key) if confined and not fresh else None
    if got is None and confined and not fresh:
        job.progress.phase("waiting for another job's run of the same base")
        with cache.running(key, job.poll) as waited:  # one job of a race (a batch) runs the base; the rest load it
            got = cache.load(key)
            if got is None and not waited:
                got = _run_and_keep(job, wt, plan, env, result, key, cache)
        if got is None and waited:  # the run waited for could not be kept: this job's own, unlocked
            got = _run_and_keep(job, wt, plan, env, result, key, cache)
    elif got is None:  # unconfined (never cached), or asked to run afresh (and then kept)
        got = _run_and_keep(job, wt, plan, env, result, key, cache if confined else None)
    if got is None:
        return NotRunnable(result.summary)
    got = dataclasses.replace(got, key=key)
    result.baseline = {**got.view(), "key": key[:16], "duration_s": round(time.monotonic() - start, 3)}
    job.ledger.append("job.baseline", {"jobId": job.job_id, "source": got.source, "key": key,
                                       "steps": [s.view() for s in got.steps]}, job_id=job.job_id)
    return got


def _run_and_keep(job: Job, wt: worktree.Worktree, plan: vplan.Plan, env: dict[str, str], result: RunAgentResult,
                  key: str, cache: Cache | None) -> Baseline | None:
    """The base run now, and kept in `cache` (None: an unconfined run, never cached)."""
    job.progress.phase("running the base's tests")
    got = _run(job, wt, plan, env, result, key, cache is not None)
    if got is not None and cache is not None:
        why = cache.store(key, got)
        if why:
            job.risks.append(f"the base's run was not kept ({why}): the next job runs it again")
    return got


def _run(job: Job, wt: worktree.Worktree, plan: vplan.Plan, env: dict[str, str], result: RunAgentResult,
         key: str, confined: bool) -> Baseline | None:
    said = len(job.risks)
    # A confined run of the base's code keeps its build caches (Go's) for the job's runs to start from.
    given = trial.Trial(wt, plan, env, "baseline", trial.fresh_base(job, wt), observe=True, seed=key,
                        keep_seed=confined)
    try:
        run = trial.run(job, given, None)
        steps, causes = ([], []) if run is None else _read(job, wt, run)
    finally:
        removed = worktree.remove_tree(job.work)  # the agent's directory takes its place once it exits
    # What kept the run from running (a copy that could not be made, confinement unavailable) is a cause;
    # any other risk it raised (a build cache not kept) stays a risk.
    raised = job.risks[said:]
    del job.risks[said:]
    causes = [Cause(r.removeprefix("validation not run: ")) for r in raised if r.startswith("validation not run: ")] \
        + causes
    job.risks.extend(r for r in raised if not r.startswith("validation not run: "))
    if not removed:
        job.risks.append(f"the base's checkout {job.work} could not be removed")
    if run is not None and run.killed_reason:
        reason = run.killed_reason
        result.status = Status.failed
        result.code = judge.killed_code(reason)
        result.summary = f"the base's validation {reason}; nothing was launched"
        job.risks.append(result.summary)
        return None
    if causes or run is None:
        first = causes[0].line() if causes else "it did not run"
        result.status, result.code = Status.failed, Code.BASELINE_FAILED
        result.summary = f"the base's own validation cannot run, so no agent was launched: {first}"
        job.risks.append(result.summary)
        job.risks.extend(f"the base's validation: {c.line()}" for c in causes[1:3])
        result.validation += [{**a.record(), "label": f"{a.label} (the base)"} for a in (run.attempts if run else [])]
        job.ledger.append("job.baseline", {"jobId": job.job_id, "runnable": False,
                                           "causes": [c.line() for c in causes]}, job_id=job.job_id)
        return None
    return Baseline(tuple(steps), "ran", job.confiner.name if job.confiner is not None else "")


def _read(job: Job, wt: worktree.Worktree, run: vplan.Run) -> tuple[list[StepBase], list[Cause]]:
    """Each step of the base's run as a StepBase, and what kept any from running. Read while the base's
    checkout is still there: which runners a step runs is read from its package.json and Makefile."""
    steps, causes = [], []
    facts: Facts | None = None
    timeout = job.config.validate_timeout
    for a in run.attempts:
        setup = a.label.startswith(vplan.SETUP_LABEL)
        if a.timed_out:
            causes.append(Cause(f"`{a.label}` timed out after {timeout:.0f}s on the base (validate_timeout)"))
            continue
        if setup:
            if not a.passed:
                causes.append(Cause(f"the repo's setup fails on the base: {a.line(timeout)}: {_last_line(a.output)}"))
            steps.append(StepBase(a.label, a.exit_code, setup=True, duration_s=a.duration_s))
            continue
        seen = runners.seen(a.argv, job.work) if a.argv else []
        facts = facts or _facts(job, wt)
        cause = base_mod.diagnose(a.label, a.exit_code, a.output, a.found, facts, argv=a.argv,
                                  django=(job.work / "manage.py").is_file())
        if cause is not None:
            causes.append(cause)
        steps.append(base_mod.step_base(a.label, a.exit_code, a.found, seen, duration_s=a.duration_s))
    return steps, causes


def _facts(job: Job, wt: worktree.Worktree) -> Facts:
    listing = git(["ls-tree", "-r", "--name-only", "-z", wt.base_sha], git_dir=wt.repo.common_dir)
    tracked = frozenset(p.decode("utf-8", "surrogateescape") for p in listing.out.split(b"\0") if p)
    cfg = job.settings
    shared = tuple(cfg.share) if cfg is not None and cfg.share is not None else ("node_modules",)
    return Facts(tracked, wt.repo.path.resolve(), job.work, shared)


def _last_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("[stderr]")]
    return lines[-1][:300] if lines else "no output"


def plan_of(job: Job, plan: vplan.Plan) -> vplan.Plan:
    """The plan validation runs: the repo's configured `validate` counts where autodetection found nothing
    (issue 24: it was "validation skipped"); read from config and the base's committed file."""
    if not plan.steps and job.settings is not None and job.settings.validate:
        return vplan.given(job.settings.validate)
    return plan

