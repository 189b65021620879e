"""Preparation: what stands before the agent starts — the job's worktree cut from the base, the
validation plan decided on the base's checkout (the agent must not pick its own test), the gate, the
OS-enforced plan, the CLI's version, the repo's settings and its `setup` run in the worktree. The order is
the rule: the plan is made on the host's fresh checkout (no hard links there by construction), and what
setup then leaves linked is a risk."""

from __future__ import annotations

import dataclasses
import threading
from importlib import resources
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from proctor.contract import Code, RunAgentResult
from proctor.mechanisms import confine
from proctor.mechanisms.adapters import versions
from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.git import worktree
from proctor.mechanisms.process.local import Limited, ProcessRunner
from proctor.mechanisms.process.spawn import Spawn
from proctor.mechanisms.validation import environment
from proctor.mechanisms.validation import plan as vplan
from proctor.mechanisms.evidence.baseline import Baseline
from proctor.services.job import continued, baseline, gate
from proctor.services.job.admit import Admitted
from proctor.services.job.agent_version import VERSION_TIMEOUT_S, agent_version, executable, inside
from proctor.services.job.boundary import (confine_agent, hide_holdout, hide_home, main_repo, person_checkout_hidden,
                                          without_credentials)
from proctor.services.job.context import Job
from proctor.services.job.record import validation_log
from proctor.services.job.network import registry_proxy


@dataclass(frozen=True)
class Prepared:
    """What the agent phase runs: its worktree, the validation plan fixed before it, the confined argv and
    environment (credentials only there), the job's environment without them, and the limited runner the
    agent shares with setup."""

    wt: worktree.Worktree
    plan: vplan.Plan
    confined: confine.ConfinePlan
    agent_env: dict[str, str]
    env: dict[str, str]
    runner: Limited
    baseline: Baseline | None = None  # the base's own run of the plan, every test's outcome by id


def prepare(job: Job, admitted: Admitted, result: RunAgentResult) -> Prepared | None:
    """The job prepared, or None with the result's code and a risk saying why nothing launched."""
    req = job.request
    job.progress.phase("creating the worktree")
    # The main checkout's state and the base's settings (from its objects) are read while git writes the
    # job's checkout: git processes that share nothing, and the checkout is most of a small job's time.
    with ThreadPoolExecutor(1, thread_name_prefix=f"risks-{job.job_id}") as pool:
        risks = pool.submit(worktree.checkout_risks, admitted.repo, admitted.base)
        settings = pool.submit(environment.settings, job.config.repos, admitted.repo.path,
                               admitted.repo.common_dir, admitted.settings.sha)
        wt = worktree.create(admitted.repo, job.job_id, req.ticket, admitted.base)
        if isinstance(wt, worktree.Failure):
            result.code, result.summary = Code(wt.code) if wt.code else Code.WORKTREE_FAILED, wt.reason
            job.risks.append(wt.reason)
            return None
        job.risks.extend(risks.result())
        repo_settings = settings.result()
    if wt.recorded is not None:
        # The checkout's index is read while the job gets ready and the agent runs: landing compares each file
        # to it (100,000 entries: 0.3 s of the time after the agent, off it now).
        threading.Thread(target=wt.recorded.entries, name=f"index-{job.job_id}", daemon=True).start()
    moved = job.config.moved(admitted.repo.path)
    if moved:
        job.warnings.append(f"config names {', '.join(moved[:3])}, which no longer exist{'s' if len(moved) == 1 else ''}, "
                            f"and nothing for {admitted.repo.path}: if this repo moved from there, its settings, "
                            f"held-out tests and landing policy are not applied; re-key them to \"{admitted.repo.path}\"")
    result.worktree_path, result.branch = str(wt.path), wt.branch
    result.settings_commit = admitted.settings.sha
    job.work = wt.path.with_name(f".{wt.path.name}.work")
    # Decided on the fresh checkout of the base, before the agent runs: the agent must not pick its own test.
    plan = vplan.given(req.validate_command) if req.validate_command else vplan.detect(wt.path)

    started = gate.start(job, wt, result)
    if isinstance(started, str):
        result.code, result.summary = Code.CONFIG_INVALID, started
        job.risks.append(f"{started}; nothing was launched")
        return None
    job.gate = started

    env = dict(admitted.env)  # confine_agent takes the credentials out: the agent's alone
    job.settings = _repo_settings(job, admitted, repo_settings)  # its `copy` files are what the agent may read of the person's
    cplan = confine_agent(job, admitted.confiner, wt, list(admitted.invocation.argv), env)
    if isinstance(cplan, confine.Unavailable):
        result.code, result.summary = cplan.code, cplan.reason
        job.risks.append(f"{cplan.reason}; nothing was launched")
        return None
    result.confinement = cplan.confinement
    result.confinement_details = {**cplan.details, "gaps": cplan.gaps}
    agent_env = {**env, **cplan.env, **(job.gate.dialect.env(job.gate.dir) if job.gate is not None else {})}
    if job.spec.node_proxy and job.spec.network and result.confinement != "none":
        agent_env["NODE_OPTIONS"] = node_proxy(job, agent_env.get("NODE_OPTIONS", ""))
    result.agent_version = _probe_version(job, admitted.confiner, wt, env)
    untested = versions.untested(job.spec.name, job.spec.tested, result.agent_version)
    if untested is not None and job.config.cli_versions == "strict":
        result.code, result.summary = Code.AGENT_UNTESTED, untested
        job.risks.append(f"{untested}; cli_versions = \"strict\": nothing was launched")
        return None
    if untested is not None:
        job.risks.append(untested)

    # The job's limits (memory, pids, CPU weight; disk added to the worktree and the agent's TMPDIR). The
    # stop switch is read once more by the runner, as the last thing before each spawn.
    limited = Limited(job.runner, job.limits, (wt.path, job.agent_tmp))
    plan = baseline.plan_of(job, plan)
    if job.settings is not None and job.settings.setup:
        _setup(job, wt, limited, env, result)
        job.risks.extend(setup_links(wt))
    # Last before the agent: the base proven runnable in validation's own environment (after setup, which
    # may warm what validation reads), or the job ends here with the cause and nothing launched.
    base = baseline.baseline(job, wt, plan, env, result)
    if isinstance(base, baseline.NotRunnable):
        return None
    if admitted.earlier is not None:  # a follow-up: the chain's work, laid over the base its run was of
        job.progress.phase(f"laying job {admitted.earlier.job.job_id}'s tree over the base")
        why = continued.lay(job, wt, admitted.earlier)
        if why is not None:
            result.code, result.summary = Code.HOST_ERROR, f"the earlier job's tree could not be laid: {why}"
            job.risks.append(f"{result.summary}; nothing was launched")
            return None
    return Prepared(wt, plan, cplan, agent_env, env, limited, base)


def node_proxy(job: Job, options: str) -> str:
    """NODE_OPTIONS with the proxy preload required first: a copy in the agent's HOME, which the sandbox
    shows (the package's own path may sit in a hidden /tmp or home). It is the agent's to change, as its
    own process is: the proxy, not the preload, decides what the agent reaches."""
    target = job.home / ".proctor" / "node_proxy.cjs"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes((resources.files("proctor.mechanisms.confine") / "node_proxy.cjs").read_bytes())
    return f'--require "{target}" {options}'.strip()  # quoted: node splits NODE_OPTIONS on spaces


def setup_links(wt: worktree.Worktree) -> list[str]:
    """Files with more than one hard link that the repo's `setup` left in the worktree (a package manager
    linking from its store): each is writable through the worktree under every confinement layer, so the
    agent can change what the link's other name holds for every later job. A risk, not a refusal: the
    setup is the repo's own, and refusing would refuse those package managers outright."""
    planted = confine.refuse_hard_links(wt.path)
    if not planted:
        return []
    more = f" and {len(planted) - 5} more" if len(planted) > 5 else ""
    return [f"setup left {len(planted)} file(s) with more than one hard link in the worktree "
            f"({', '.join(planted[:5])}{more}): the agent could write through them to their other names"]


def _repo_settings(job: Job, admitted: Admitted, cfg: RepoSettings | str) -> RepoSettings | None:
    """The repo's settings as the job may use them; what was left out, and why, in its risks."""
    requester = job.requester
    if requester is not None and admitted.settings.sha != admitted.base.sha:
        git_dir = admitted.repo.common_dir
        if environment.base_file(git_dir, admitted.base.sha) != environment.base_file(git_dir, admitted.settings.sha):
            job.risks.append(f"{requester.name} named the base {admitted.base.ref!r}, whose {environment.PROCTOR_TOML} "
                             f"differs: the repo's settings from the default branch ({admitted.settings.ref} at "
                             f"{admitted.settings.sha[:12]}) were used (a request never picks the config proctor "
                             "trusts)")
    if isinstance(cfg, str):
        job.risks.append(cfg)
        return None
    if job.may_read_untracked or not (cfg.copy or cfg.registries):
        return cfg
    assert requester is not None  # only a requester's job may be refused them (Job.may_read_untracked)
    what = " and ".join(f"{k} ({', '.join(v)})" for k, v in (("copy", cfg.copy), ("registries", cfg.registries)) if v)
    job.risks.append(f"the repo's {what} not used for {requester.name} job: they need the "
                     "privilege validateCommand needs (whatever validation can read, its requester reads in the "
                     "output)")
    return dataclasses.replace(cfg, copy=(), registries=())


def _probe_version(job: Job, confiner: confine.Confiner, wt: worktree.Worktree, env: dict[str, str]) -> str | None:
    """`CLI --version`, confined like the agent (network off, nothing writable but a scratch dir), in the
    job's cgroup and under the stop switch: it runs code a previous job may have written."""
    exe = executable(job.spec, env)
    if exe is not None and job.state_dirs and inside(exe, job.state_dirs):
        job.risks.append(f"the agent's executable {exe} is inside its writable state dirs: a job can rewrite "
                         "what the next job runs")
    scratch = job.agent_tmp / "version-probe"
    roots = confine.job_roots(scratch, scratch, readonly=main_repo(wt), network=False)
    env = without_credentials(job, env)  # it runs the CLI's code, which needs no login to say its version

    def probe(argv: list[str]) -> tuple[int | None, bytes, bytes]:
        req = roots if isinstance(roots, confine.Unavailable) else hide_home(job, roots, argv[:1])
        if isinstance(req, confine.Unavailable):
            return None, b"", b""
        plan = confiner.wrap(argv, req)
        if isinstance(plan, confine.Unavailable):
            return None, b"", b""
        ex = job.runner.run(Spawn(argv=plan.argv, cwd=scratch, env={**env, **plan.env}, deadline_s=VERSION_TIMEOUT_S,
                                  name=f"version-{job.job_id}", poll=job.poll, tail_bytes=64_000))
        return ex.exit_code, ex.stdout, ex.stderr

    return agent_version(job.spec, env, probe, job.state_dirs)


def _setup(job: Job, wt: worktree.Worktree, runner: ProcessRunner, env: dict[str, str],
           result: RunAgentResult) -> None:
    """The repo's `setup` commands in the agent's worktree before it starts (so the agent can run the
    tests as it works), confined like the agent, whose limits they share; their network is the repo's
    `registries` only, through a proxy of their own. A failure is a risk, never the job's end: validation
    runs setup again in its own checkout and judges there."""
    cfg = job.settings
    if cfg is None or job.confiner is None:
        return
    job.progress.phase("setting up the worktree")
    # The same variables as before validation (PATH, the repo's venv, the tools' settings): one environment
    # for the repo's commands, documented in docs "The validation environment". What it names outside
    # the worktree (a venv poetry keeps under ~/.cache) is shown read-only, as to validation.
    jenv = environment.prepare(wt.path, wt.repo.path, vplan.Plan(()), cfg, tmp=job.agent_tmp / "setup-env",
                               env=env, bind=False)
    roots = hide_holdout(job, confine.job_roots(wt.path, job.agent_tmp, readonly=(*main_repo(wt), *jenv.readonly),
                                                network=bool(cfg.registries)))
    # Hidden from setup as from the agent: a package's install script runs here with the registry's network.
    roots = person_checkout_hidden(job, wt, roots, jenv.shown)
    if not isinstance(roots, confine.Unavailable):
        roots = hide_home(job, roots, ["/bin/sh"])
    if isinstance(roots, confine.Unavailable):
        job.risks.append(f"setup before the agent not run: {roots.reason}")
        return
    proxy = registry_proxy(job, cfg, "setup-egress.sock", "setup before the agent")
    if isinstance(proxy, str):
        job.risks.append(proxy)
        return
    if proxy is not None:
        roots = dataclasses.replace(roots, egress_socket=proxy.socket_path,
                                    egress=tuple(str(e) for e in proxy.allowed))
    shared, dirs = environment.setup_env(jenv, network=proxy is not None)
    try:
        try:
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            job.risks.append(f"setup before the agent not run: its environment could not be made: {exc}")
            return
        steps, step_env = [], {**env, **shared}
        for command in cfg.setup:
            wrapped = job.confiner.wrap(["/bin/sh", "-c", command], roots)
            if isinstance(wrapped, confine.Unavailable):
                job.risks.append(f"setup before the agent not run: {wrapped.reason}")
                return
            steps.append(vplan.Step(f"setup before the agent: {command}", tuple(wrapped.argv)))
            step_env.update(wrapped.env)  # the proxy's variables, when it has a network
        run = vplan.run(vplan.Plan(tuple(steps)), runner, cwd=wt.path, env=step_env,
                        timeout_s=job.config.validate_timeout, name=f"setup-{job.job_id}", poll=job.poll,
                        log=validation_log(job.job_id), watch=job.progress.watch(None))
    finally:
        if proxy is not None:
            proxy.stop()
    result.validation += [a.record() for a in run.attempts]
    failed = [a for a in run.attempts if not a.passed]
    if run.killed_reason or failed:
        why = run.killed_reason or failed[0].line(job.config.validate_timeout)
        job.risks.append(f"setup before the agent failed ({why}): the agent ran without it")
