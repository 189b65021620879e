"""What of the host a job is given: its declared environment (never the host's whole one), a HOME of its
own with copies of the adapter's state, the user's home hidden but for what it needs, the held-out tests
unreadable, and the OS-enforced plan that wraps the agent. Never weaker than the policy asked, silently:
every gap is a refusal or a risk."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from proctor.mechanisms import confine
from proctor.mechanisms.config.load import builtin_agents
from proctor.mechanisms.confine.plan import programs_of
from proctor.mechanisms.git import worktree
from proctor.mechanisms.git.command import unredirected_env
from proctor.mechanisms.validation import environment
from proctor.mechanisms.validation import plan as vplan
from proctor.contract import RunAgentResult
from proctor.services.job import sandbox_home
from proctor.services.job.context import Job, names
from proctor.services.job.network import start_proxy


def agent_env(job: Job, wt_path: Path) -> dict[str, str]:
    """The declared environment (sandbox_home.declared_env), never the host's whole one: a key exported for
    proctor reached every agent and the code under test (issue 21). HOME is the job's own, in its private
    tmp, where its copy of the adapter's state dirs goes (confine_agent)."""
    declared = sandbox_home.declared_env(unredirected_env(), job.spec, job.config.env_pass)
    home = str(job.home)
    # An adapter's `env` value "~/x" is under the agent's HOME, as its state_dirs are (CLAUDE_CONFIG_DIR).
    return {**declared.env, "HOME": home, **job.spec.env_under(home), "PROCTOR_JOB_ID": job.job_id,
            "PROCTOR_WORKTREE": str(wt_path), "TMPDIR": str(job.agent_tmp)}


def without_credentials(job: Job, env: dict[str, str]) -> dict[str, str]:
    """`env` minus the adapter's login: for everything of the job but the agent's own process."""
    creds = set(sandbox_home.credential_names(job.spec))
    return {k: v for k, v in env.items() if k not in creds}


def main_repo(wt: worktree.Worktree) -> tuple[Path, ...]:
    # Visible (its objects are borrowed) and never writable, even where it sits under a private /tmp.
    return (wt.repo.path, wt.repo.common_dir)


def person_checkout_hidden(job: Job, wt: worktree.Worktree, roots: confine.ConfineRequest | confine.Unavailable,
                           visible: tuple[Path, ...] = ()) -> confine.ConfineRequest | confine.Unavailable:
    """`roots` with the person's checkout hidden but its git dir (the job borrows its objects), the files
    config's `copy` names and `visible` (what validation shares: node_modules, the repo's venv): the agent
    and the code under test see the base, never the person's untracked and ignored files (`.env`, a key,
    notes; issue 39: the agent read an ignored `.env` that `copy` did not name and committed it)."""
    if isinstance(roots, confine.Unavailable):
        return roots
    cfg = job.settings
    main = wt.repo.path
    copies = tuple(main / c for c in (cfg.copy if cfg is not None else ()) if (main / c).is_file())
    hidden = confine.checkout_hidden(roots, main, (wt.repo.common_dir, *copies, *visible))
    if isinstance(hidden, str):
        # Said, never silent (a linked worktree or a git dir elsewhere is hidden as any checkout is: found
        # in review).
        if hidden not in job.risks:
            job.risks.append(hidden)
        return roots
    return hidden


def shown_to_code(job: Job, wt: worktree.Worktree, env: dict[str, str]) -> tuple[Path, ...]:
    """What of the person's checkout the agent sees as validation does (its node_modules, the repo's venv):
    an agent running the tests as it works needs them (found in review: the venv on its PATH was hidden)."""
    jenv = environment.prepare(wt.path, wt.repo.path, vplan.Plan(()), job.settings, tmp=job.agent_tmp / "agent-env",
                               env=env, bind=False)
    return jenv.shown


def holdout(job: Job) -> list[str]:
    return [*job.config.holdout_for(Path(job.request.repo)), *(job.request.holdout or [])]


def hide_holdout(job: Job, roots: confine.ConfineRequest | confine.Unavailable,
                 ) -> confine.ConfineRequest | confine.Unavailable:
    """The held-out tests and sealed checks are never readable in a sandbox: not the agent's, not setup's,
    not validation's (whose code is the agent's): an agent cannot tune to what it cannot read, and a cheat in
    the code under test cannot read the answers (docs "What the verdict rests on")."""
    dirs = tuple(Path(d).resolve() for d in holdout(job) if Path(d).is_dir())
    if isinstance(roots, confine.Unavailable) or not dirs:
        return roots
    return dataclasses.replace(roots, hidden=(*roots.hidden, *dirs))


def confine_agent(job: Job, confiner: confine.Confiner, wt: worktree.Worktree, argv: list[str],
                  env: dict[str, str]) -> confine.ConfinePlan | confine.Unavailable:
    """The OS-enforced plan for this job's agent, never silently weaker than the policy asked.

    The adapter's state dirs are the job's copies under its own HOME; the user's home is hidden but for
    what the job needs from it (hide_home). The adapter's credentials move from `env` into the plan's env:
    the agent's process gets them, the version probe, setup and validation (which get `env`) do not."""
    spec = job.spec
    # No hard-link check here: the worktree is the host's fresh checkout (git creates every file new, in a
    # directory of the host's made 0700 for the job), which has none by construction. The repo's `setup` is
    # the one writer before the agent: prepare looks after it (`setup_links`).
    user_home = sandbox_home.user_home(unredirected_env())
    if user_home is not None and Path(env.get("HOME", "")) == job.home:
        copied = sandbox_home.copy_state(job.home, user_home, spec)
        if isinstance(copied, str):
            return confine.Unavailable(copied)
        job.state = copied
    state_dirs = _state_dirs(job, env)
    if isinstance(state_dirs, confine.Unavailable):
        return state_dirs
    job.state_dirs = tuple(state_dirs)
    roots = hide_holdout(job, confine.job_roots(wt.path, job.agent_tmp, state_dirs, readonly=main_repo(wt),
                                                network=spec.network))
    roots = person_checkout_hidden(job, wt, roots, shown_to_code(job, wt, env))
    if isinstance(roots, confine.Unavailable):
        return roots
    if job.gate is not None:
        # The hook runs inside the sandbox: its dir read-only at the same path, its interpreter visible.
        roots = dataclasses.replace(roots, ro_binds=(*roots.ro_binds, (job.gate.dir, job.gate.dir)),
                                    readonly=(*roots.readonly, Path(sys.base_prefix).resolve()))
    if spec.network and confiner.name != "none":
        # The network is the adapter's declared hosts only, through a proxy the host runs: an agent with
        # the whole network reached the loopback NATS server and deleted the job stream (found in review).
        try:
            job.egress = start_proxy(job, spec.egress, "egress.sock", agent=True)
        except (OSError, RuntimeError, ValueError) as exc:
            return confine.Unavailable(f"the egress proxy did not start: {exc}")
        roots = dataclasses.replace(roots, egress_socket=job.egress.socket_path, egress=spec.egress)
    job.confiner = confiner
    programs = programs_of(argv, env.get("PATH"))
    if confiner.name != "none" and programs and spec.name not in builtin_agents():
        # A declared CLI kept in ~/work/bin/ shows the agent all of ~/work: the person should hear it (a
        # warning, not a risk: it is their config, and the verdict does not rest on what the agent read).
        home = sandbox_home.user_home(unredirected_env())
        broad = sandbox_home.exposes_more(programs[0], home) if home is not None else None
        if broad:
            job.warnings.append(broad)
    hidden = hide_home(job, roots, programs)
    if isinstance(hidden, confine.Unavailable):
        return hidden
    plan = confiner.wrap(argv, hidden)
    if not isinstance(plan, confine.Unavailable):
        creds = {k: env.pop(k) for k in sandbox_home.credential_names(spec) if k in env}
        plan = dataclasses.replace(plan, env={**plan.env, **creds},
                                   details={**plan.details, **_details(job, roots, programs, plan.confinement)})
    if not isinstance(plan, confine.Unavailable) and plan.confinement == "none":
        # Validation runs under the same confiner: it ran unconfined too, agent-written code with the host
        # user's rights. Never a verdict a person may skip.
        why = ("confinement is off by request" if job.mode == "off" else
               f"no OS confinement on this machine ({'; '.join(plan.gaps) or 'neither bubblewrap nor Landlock'})")
        job.risks.append(f"{why}: the agent and its validation ran unconfined")
    return plan


def _state_dirs(job: Job, env: dict[str, str]) -> list[Path] | confine.Unavailable:
    """The adapter's state dirs, made where missing; `~` is the agent's HOME (an adapter's env may move
    it), which is where its CLI writes its state."""
    spec, state_dirs = job.spec, []
    home = env.get("HOME") or str(Path.home())
    for raw in spec.state_dirs:
        d = Path(home + raw[1:]) if raw == "~" or raw.startswith("~/") else Path(raw)
        if d.is_file():
            # A state file (a CLI's config) is granted itself: written in place it works; replaced by a
            # rename it cannot be (its directory is not the agent's), so built-ins keep their state in dirs.
            state_dirs.append(d)
            continue
        if d.exists() and not d.is_dir():
            return confine.Unavailable(f"state_dirs entry {raw!r} of agent {spec.name!r} is neither a "
                                       "directory nor a regular file")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return confine.Unavailable(f"state_dirs entry {raw!r} of agent {spec.name!r} cannot be made: {exc}")
        state_dirs.append(d)
    return state_dirs


def hide_home(job: Job, roots: confine.ConfineRequest,
              programs: list[str]) -> confine.ConfineRequest | confine.Unavailable:
    """`roots` with the user's home hidden (~/.ssh, cloud credentials, other tools' tokens: issue 21) but
    what the job needs from it: its own roots, the toolchains, the programs' installs, `read_home`."""
    host = unredirected_env()
    home = sandbox_home.user_home(host)
    if home is None:
        return roots
    keep = sandbox_home.home_keep(home, host, job.config.read_home, programs)
    hidden = sandbox_home.hidden_home(home, _home_shown(home, keep, roots))
    if isinstance(hidden, str):
        return confine.Unavailable(f"{hidden}: name what it needs in read_home, or move it")
    extra = tuple(h for h in hidden if not any(h == a or h.is_relative_to(a) for a in roots.hidden))
    # What stays shown is also bound read-only: under bwrap a home below /tmp (a private tmpfs there)
    # would otherwise show nothing of it.
    shown = tuple(p for p in keep if p.exists() and p not in roots.readonly)
    return dataclasses.replace(roots, hidden=(*roots.hidden, *extra), readonly=(*roots.readonly, *shown))


def _home_shown(home: Path, keep: list[Path], roots: confine.ConfineRequest) -> list[Path]:
    """What of `home` the job reads: `keep` (sandbox_home.home_keep) and its own roots that live there."""
    own = (Path(os.path.realpath(p)) for p in (*roots.writable, *roots.readonly, *(s for s, _ in roots.ro_binds)))
    return list(dict.fromkeys(k for k in (*keep, *own) if k.is_relative_to(home)))


def _details(job: Job, roots: confine.ConfineRequest, programs: list[str], confinement: str) -> dict[str, object]:
    """What of the host the job was given, for the result's confinement_details: the names of the host
    variables passed (never values), its HOME, what of the user's home it could read, its state copy."""
    host = unredirected_env()
    declared = sandbox_home.declared_env(host, job.spec, job.config.env_pass)
    home = sandbox_home.user_home(host)
    hidden = home is not None and confinement != "none"
    return {"env": list(declared.names), "credentials": list(declared.credentials),
            "home": {"path": str(job.home), "user_home": str(home) if home else None,
                     "user_home_hidden": hidden,
                     "readable": [str(p) for p in _home_shown(
                         home, sandbox_home.home_keep(home, host, job.config.read_home, programs), roots)][:50]
                     if hidden else None},
            "state": job.state.describe() if job.state is not None else None}


def settle_state(job: Job, result: RunAgentResult) -> None:
    """After the agent: the must-keep files of its state copy written back, a change to the CLI's config,
    hooks, MCP servers or extensions a risk (the copy, and the change, go with the job's tmp)."""
    if job.state is None:
        return
    done = sandbox_home.settle(job.state)
    details = result.confinement_details.get("state")
    if isinstance(details, dict):
        details.update(login_changed=list(done.login_changed), login_rotated=list(done.rotated),
                       changed_config=list(done.changed_config))
        if done.login_changed:
            # Not a risk of the diff: what the person must know of their login.
            rotated = (f"; its refresh token changed ({names(list(done.rotated))}): the one your CLI keeps may "
                       "be spent, and if it says you are logged out, log in again") if done.rotated else ""
            details["login"] = (f"the job's CLI changed its login ({names(list(done.login_changed))}): not "
                                f"written back, proctor cannot tell from the job's copy whose it is{rotated}")
    if done.other_account:
        job.risks.append(f"the job changed its CLI's login to another account: {names(list(done.other_account))} "
                         "(not written back: the user's login stands)")
    if done.changed_config:
        job.risks.append("the agent changed its CLI's config, hooks, MCP servers or extensions in its state dir: "
                         f"{names(list(done.changed_config))} (the job's copy only: discarded, never seen by "
                         "another job)")
