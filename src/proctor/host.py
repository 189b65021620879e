"""The run_agent service: one job, from a validated request to the host's own verdict.

Owns the order of a job — check the request on this machine, admit it (stop switch, confinement policy,
breaker), cut the worktree, launch the adapter confined, collect the diff, validate, judge — the rule for
`needs_human_review`, and the ledger rows that make every job visible, a crashed one included. It never
trusts the agent's word: `claimed_status` is recorded and decides nothing; `changed_files` and
`tests_attempted` are what the host itself observed.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from proctor import cgroup, confine, validate, worktree
from proctor.adapters.spec import AdapterSpec, Refused, build
from proctor.agent_version import agent_version
from proctor.attempts import run_attempts
from proctor.breaker import Breaker, signal_for
from proctor.config import Config, ConfigError, load_config
from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.git import unredirected_env
from proctor.ledger import Ledger
from proctor.process import LocalRunner, ProcessRunner
from proctor.progress import NullProgress, Progress
from proctor.stop import StopSwitch

# Files that decide what autodetected validation runs; an agent that edits one may be choosing its own test.
PLAN_FILES = ("Makefile", "pyproject.toml", "setup.cfg", "pytest.ini", "tox.ini", "conftest.py", "package.json",
              "Cargo.toml", "go.mod")
PYTEST_NO_TESTS = 5


def new_job_id() -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def refused(request_like: dict | RunAgentRequest | None, risks: list[str], code: Code, start: float) -> RunAgentResult:
    """A `failed` result for a job that never launched: the risks name why."""
    if isinstance(request_like, RunAgentRequest):
        agent, mode = request_like.agent, request_like.mode
    else:
        agent = str((request_like or {}).get("agent") or "")
        mode = (request_like or {}).get("mode")
    return RunAgentResult(
        status=Status.failed,
        summary=risks[0] if risks else "refused",
        known_risks=risks,
        needs_human_review=True,
        agent=agent,
        duration_seconds=round(time.monotonic() - start, 3),
        mode=mode if isinstance(mode, str) else None,
        code=code,
    )


@dataclass
class _Job:
    request: RunAgentRequest
    config: Config
    runner: ProcessRunner
    progress: Progress
    cancel: Callable[[], str | None] | None
    job_id: str
    start: float
    ledger: Ledger
    stop: StopSwitch
    risks: list[str] = field(default_factory=list)
    # Set once the agent's plan is made; validation runs under the same confiner, network off.
    confiner: confine.Confiner | None = None
    roots: confine.ConfineRequest | None = None


def run_agent(
    request: RunAgentRequest,
    *,
    config: Config | None = None,
    runner: ProcessRunner | None = None,
    progress: Progress | None = None,
    cancel: Callable[[], str | None] | None = None,
    job_id: str | None = None,
    ledger: Ledger | None = None,
    stop: StopSwitch | None = None,
) -> RunAgentResult:
    """Have `request.agent` do `request.task` in a new worktree of `request.repo`; never raises for a bad
    request or a misbehaving agent: every outcome is a result with a status and a code.

    `cancel` is polled while the agent and validation run (as is the stop switch); a reason kills the whole
    tree. Every job writes a `job.start` row before anything happens and a `job.end` row with its verdict,
    so a crash in between shows as an interrupted job, never as nothing.
    """
    start = time.monotonic()
    own_ledger = ledger is None
    try:
        ledger = ledger or Ledger.default()
    except Exception as exc:  # noqa: BLE001 - an unusable ledger: refuse rather than run unrecorded
        return refused(request, [f"the ledger cannot be opened: {exc}"], Code.HOST_ERROR, start)
    job_id = job_id or new_job_id()
    try:
        ledger.append("job.start", {"jobId": job_id, "agent": request.agent, "ticket": request.ticket,
                                    "repo": request.repo, "mode": request.mode, "branch": request.branch},
                      job_id=job_id)
        result = _admit_and_run(request, config, runner, progress, cancel, job_id, ledger, stop, start)
        result.job_id = job_id
        ledger.append("job.end", {"jobId": job_id, "status": result.status.value, "code": result.code.value,
                                  "needs_human_review": result.needs_human_review,
                                  "worktreePath": result.worktree_path}, job_id=job_id)
        return result
    finally:
        if own_ledger:
            ledger.close()


def _admit_and_run(request, config, runner, progress, cancel, job_id, ledger, stop, start) -> RunAgentResult:
    try:
        swept = cgroup.sweep_orphans()
    except OSError:
        swept = 0
    if swept:
        # Agents of a host that died (kill -9, crash) ran on unwatched until now; the ledger says so.
        ledger.append("host.orphans_killed", {"processes": swept})
    try:
        config = config or load_config()
    except ConfigError as exc:
        return refused(request, [str(exc)], Code.CONFIG_INVALID, start)
    spec = config.adapter(request.agent)
    if spec is None:
        known = ", ".join(sorted(config.agents))
        return refused(request, [f"unknown agent {request.agent!r} (known: {known})"], Code.UNKNOWN_AGENT, start)
    job = _Job(request, config, runner or LocalRunner(), progress or NullProgress(), cancel, job_id, start,
               ledger, stop or StopSwitch())
    breaker = Breaker(ledger, threshold=config.breaker.threshold, cooldown_s=config.breaker.cooldown_s,
                      backoff_s=config.breaker.backoff_s)
    # Two private dirs: the agent's TMPDIR (writable by it) and the host's own (never granted to it).
    agent_tmp = Path(tempfile.mkdtemp(prefix=f"proctor-{job_id}-"))
    host_tmp = Path(tempfile.mkdtemp(prefix=f"proctor-host-{job_id}-"))
    try:
        return _run(job, spec, breaker, agent_tmp, host_tmp)
    finally:
        shutil.rmtree(agent_tmp, ignore_errors=True)
        shutil.rmtree(host_tmp, ignore_errors=True)


def _agent_env(job: _Job, spec: AdapterSpec, wt_path: Path, agent_tmp: Path) -> dict[str, str]:
    return {**unredirected_env(), **spec.env, "PROCTOR_JOB_ID": job.job_id, "PROCTOR_WORKTREE": str(wt_path),
            "TMPDIR": str(agent_tmp)}


def _run(job: _Job, spec: AdapterSpec, breaker: Breaker, agent_tmp: Path, host_tmp: Path) -> RunAgentResult:
    req = job.request
    job.progress.phase("checking the request")
    repo = worktree.open_repo(req.repo)
    if isinstance(repo, worktree.Failure):
        return refused(req, [f"invalid request: {repo.reason}"], Code.INVALID_REQUEST, job.start)
    base = worktree.resolve_base(repo, req.branch) if req.branch else worktree.default_base(repo)
    if isinstance(base, worktree.Failure):
        return refused(req, [f"invalid request: {base.reason}"], Code.INVALID_REQUEST, job.start)

    # The argv is built (and a too-large prompt refused) before anything is created on disk.
    wt_path = worktree.path_for(repo, job.job_id)
    prompt_file = agent_tmp / "prompt.md" if spec.prompt == "file" else None
    if prompt_file is not None:
        prompt_file.write_text(req.task, encoding="utf-8")
    env = _agent_env(job, spec, wt_path, agent_tmp)
    inv = build(spec, req.task, wt_path, prompt_file, env)
    if isinstance(inv, Refused):
        return refused(req, [inv.reason], Code(inv.code), job.start)

    stopped = job.stop.reason()
    if stopped:
        return refused(req, [f"proctor is stopped ({stopped}); nothing was launched"], Code.STOPPED, job.start)
    mode = req.confine or job.config.confine
    confiner = confine.choose(mode, confine.detect())
    if isinstance(confiner, confine.Unavailable):
        return refused(req, [confiner.reason], confiner.code, job.start)
    admission = breaker.admit(req.agent, job_id=job.job_id)
    if not admission.allowed:
        return refused(req, [admission.reason], admission.code, job.start)

    result = RunAgentResult(status=Status.failed, agent=req.agent, job_id=job.job_id, base_ref=base.ref,
                            mode=req.mode, code=Code.HOST_ERROR)
    try:
        _in_worktree(job, spec, repo, base, confiner, mode, inv, env, agent_tmp, host_tmp, result)
    finally:
        # Whatever happened after admission, the breaker hears of it (a half-open trial is never left held).
        breaker.record(req.agent, signal_for(result.status, result.code), job_id=job.job_id)
    result.known_risks = job.risks
    result.needs_human_review = not (
        result.status is Status.completed
        and result.tests_attempted
        and result.code is Code.OK
        and result.agent_changed_files
        and not job.risks
    )
    result.duration_seconds = round(time.monotonic() - job.start, 3)
    job.progress.done(result)
    return result


def _in_worktree(job, spec, repo, base, confiner, mode, inv, env, agent_tmp, host_tmp, result) -> None:
    req = job.request
    job.progress.phase("creating the worktree")
    wt = worktree.create(repo, job.job_id, req.ticket, base, host_tmp)
    if isinstance(wt, worktree.Failure):
        result.code, result.summary = Code.WORKTREE_FAILED, wt.reason
        job.risks.append(wt.reason)
        return
    result.worktree_path, result.branch = str(wt.path), wt.branch
    # Decided on the fresh checkout, before the agent runs: the agent must not pick its own test.
    plan = validate.given(req.validate_command) if req.validate_command else validate.detect(wt.path)

    cplan = _confine(job, spec, confiner, mode, wt, agent_tmp, list(inv.argv), env)
    if isinstance(cplan, confine.Unavailable):
        result.code, result.summary = cplan.code, cplan.reason
        job.risks.append(f"{cplan.reason}; nothing was launched")
        return
    result.confinement = cplan.confinement
    result.confinement_details = {**cplan.details, "gaps": cplan.gaps}
    agent_env = {**env, **cplan.env}
    result.agent_version = agent_version(spec, agent_env, agent_tmp)

    out = run_attempts(spec=spec, argv=cplan.argv, stdin=inv.stdin, env=agent_env, cwd=wt.path, runner=job.runner,
                       progress=job.progress, poll=_poll(job), timeout_s=req.timeout_sec,
                       term_grace_s=job.config.term_grace, name=f"job-{job.job_id}",
                       confined=cplan.confinement != "none")
    result.status, result.code, result.attempts = out.status, out.code, out.attempts
    result.exit_codes, result.retry_after = out.exit_codes, out.retry_after
    result.summary = out.reading.summary or f"{req.agent} exited {out.exit_codes[-1]}"
    result.claimed_status = out.reading.claimed_status
    result.confinement_details["cleanup"] = f"{cplan.details.get('cleanup', 'none')}+{out.cleanup}"
    job.risks.extend(out.risks)
    for tamper in worktree.tampered_pointers(wt):
        job.risks.append(f"the job's git metadata was tampered with: {tamper}")

    job.progress.phase("collecting the agent's changes")
    before = worktree.changed_files(wt)
    if isinstance(before, worktree.Failure):
        job.risks.append(f"could not list the agent's changes: {before.reason}")
    else:
        result.agent_changed_files = before
        if not before:
            job.risks.append("the agent changed no files")
        touched = [p for p in before if Path(p).name in PLAN_FILES or p.endswith((".sln", ".csproj"))]
        if touched and not req.validate_command:
            job.risks.append(f"the agent changed files that define the tests: {', '.join(touched[:5])}")

    validated = result.status is Status.completed and _validate(job, wt, plan, env, result)
    # Nothing ran after the first listing unless validation did: the same listing stands.
    after = worktree.changed_files(wt) if validated else before
    if isinstance(after, worktree.Failure):
        job.risks.append(f"could not list changed files after validation: {after.reason}")
    else:
        result.changed_files = after


def _confine(job: _Job, spec: AdapterSpec, confiner: confine.Confiner, mode: str, wt: worktree.Worktree,
             agent_tmp: Path, argv: list[str], env: dict[str, str]) -> confine.ConfinePlan | confine.Unavailable:
    """The OS-enforced plan for this job's agent, never silently weaker than the policy asked."""
    planted = confine.refuse_hard_links(wt.path)
    if planted:
        # A hard link the host left in the worktree is writable under every layer (research/sandbox.md).
        return confine.Unavailable(f"worktree files with more than one hard link: {', '.join(planted[:5])}")
    state_dirs = []
    # `~` is the agent's HOME (an adapter's env may move it), which is where its CLI writes its state.
    home = env.get("HOME") or str(Path.home())
    for raw in spec.state_dirs:
        d = Path(home + raw[1:]) if raw == "~" or raw.startswith("~/") else Path(raw)
        if d.exists() and not d.is_dir():
            return confine.Unavailable(f"state_dirs entry {raw!r} of agent {spec.name!r} is not a directory")
        d.mkdir(parents=True, exist_ok=True)
        state_dirs.append(d)
    roots = confine.job_roots(wt.common_dir, wt.git_dir, wt.branch, wt.path, agent_tmp, state_dirs,
                              network=spec.network)
    if isinstance(roots, confine.Unavailable):
        return roots
    job.confiner, job.roots = confiner, roots
    plan = confiner.wrap(argv, roots)
    if not isinstance(plan, confine.Unavailable) and plan.confinement == "none" and mode == "auto":
        job.risks.append("no OS confinement on this machine: the agent ran unconfined "
                         f"({'; '.join(plan.gaps) or 'neither bubblewrap nor Landlock'})")
    return plan


def _confined_validation(job: _Job, plan: validate.Plan) -> validate.Plan | None:
    """Validation runs code the agent may have written (a conftest.py, a build script): it gets the agent's
    confinement, minus the network and the CLI's state dirs. None (and a risk) when it cannot be had."""
    if job.confiner is None or job.roots is None:
        return plan
    roots = dataclasses.replace(job.roots, network=False, state_dirs=())
    steps = []
    for step in plan.steps:
        wrapped = job.confiner.wrap(list(step.argv), roots)
        if isinstance(wrapped, confine.Unavailable):
            job.risks.append(f"validation not run: {wrapped.reason}")
            return None
        steps.append(validate.Step(step.label, tuple(wrapped.argv)))
    return validate.Plan(tuple(steps))


def _poll(job: _Job) -> Callable[[], str | None]:
    """The stop switch and the caller's cancel, checked by the runner's wait loop (every 0.1 s)."""
    stop, cancel = job.stop, job.cancel

    def poll() -> str | None:
        reason = stop.reason()
        if reason:
            return f"stopped: {reason}"
        reason = cancel() if cancel is not None else None
        return f"cancelled: {reason}" if reason else None

    return poll


def _validate(job: _Job, wt: worktree.Worktree, plan: validate.Plan, env, result: RunAgentResult) -> bool:
    """Run the host's own validation; False when nothing ran."""
    if not plan.steps:
        job.risks.append(plan.skipped_reason or "validation skipped")
        return False
    job.progress.phase("validating")
    confined = _confined_validation(job, plan)
    if confined is None:
        return False
    run = validate.run(confined, job.runner, cwd=wt.path, env=env, timeout_s=job.config.validate_timeout,
                       name=f"validate-{job.job_id}", poll=_poll(job))
    timeout = job.config.validate_timeout
    result.tests_attempted = [a.line(timeout) for a in run.attempts]
    if run.killed_reason:
        result.status = Status.failed
        result.code = Code.STOPPED if run.killed_reason.startswith("stopped") else Code.CANCELLED
        job.risks.append(f"validation {run.killed_reason}")
        return True
    failed = [a for a in run.attempts if not a.passed]
    if not failed:
        return True
    first = failed[0]
    if first.exit_code == PYTEST_NO_TESTS and first.label.endswith("-m pytest"):
        # pytest's "no tests collected": nothing was checked, which is not the same as a failure.
        job.risks.append(f"validation ran no test: {first.line(timeout)}")
        return True
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: {first.line(timeout)}")
    return True
