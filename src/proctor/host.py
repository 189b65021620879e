"""The run_agent service: one job, from a validated request to the host's own verdict.

Owns the order of a job — check the request on this machine, cut the worktree, launch the adapter under the
deadline, retry once, classify, read the agent's claim, collect the diff, validate, judge — and the rule for
`needs_human_review`. It never trusts the agent's word: `claimed_status` is recorded and decides nothing;
`changed_files` and `tests_attempted` are what the host itself observed.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from proctor import cgroup, confine, validate, worktree
from proctor.adapters.output import READERS, WATCHERS
from proctor.adapters.spec import AdapterSpec, TooLarge, build
from proctor.agent_version import agent_version
from proctor.breaker import Breaker, signal_for
from proctor.classify import Patterns, classify
from proctor.config import Config, ConfigError, load_config
from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.ledger import Ledger
from proctor.process import Exit, LocalRunner, ProcessRunner, Spawn
from proctor.progress import NullProgress, Progress
from proctor.stop import StopSwitch

MAX_ATTEMPTS = 2  # one retry on a nonzero exit


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
    spec: AdapterSpec
    config: Config
    runner: ProcessRunner
    progress: Progress
    cancel: Callable[[], str | None] | None
    job_id: str
    start: float
    ledger: Ledger
    breaker: Breaker
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

    `cancel` is polled while the agent runs (as is the stop switch); a reason kills the whole tree. Every
    job writes a `job.start` row before anything happens and a `job.end` row with its verdict, so a crash in
    between shows as an interrupted job, never as nothing.
    """
    start = time.monotonic()
    try:
        config = config or load_config()
    except ConfigError as exc:
        return refused(request, [str(exc)], Code.CONFIG_INVALID, start)
    spec = config.adapter(request.agent)
    if spec is None:
        known = ", ".join(sorted(config.agents))
        return refused(request, [f"unknown agent {request.agent!r} (known: {known})"], Code.UNKNOWN_AGENT, start)
    orphans = cgroup.sweep_orphans()
    own_ledger = ledger is None
    try:
        ledger = ledger or Ledger.default()
    except Exception as exc:  # noqa: BLE001 - an unusable ledger is an edge failure: refuse, do not run unrecorded
        return refused(request, [f"the ledger cannot be opened: {exc}"], Code.HOST_ERROR, start)
    job = _Job(request, spec, config, runner or LocalRunner(), progress or NullProgress(), cancel,
               job_id or new_job_id(), start, ledger,
               Breaker(ledger, threshold=config.breaker.threshold, cooldown_s=config.breaker.cooldown_s,
                       backoff_s=config.breaker.backoff_s),
               stop or StopSwitch())
    try:
        if orphans:
            # Agents of a host that died (kill -9, crash) ran on unwatched until now; the ledger says so.
            ledger.append("host.orphans_killed", {"processes": orphans})
        ledger.append("job.start", {"jobId": job.job_id, "agent": request.agent, "ticket": request.ticket,
                                    "repo": request.repo, "mode": request.mode, "branch": request.branch},
                      job_id=job.job_id)
        result = _run(job)
        result.job_id = job.job_id
        ledger.append("job.end", {"jobId": job.job_id, "status": result.status.value, "code": result.code.value,
                                  "needs_human_review": result.needs_human_review,
                                  "worktreePath": result.worktree_path}, job_id=job.job_id)
        return result
    finally:
        if own_ledger:
            ledger.close()


def _run(job: _Job) -> RunAgentResult:
    req, spec = job.request, job.spec
    job.progress.phase("checking the request")
    repo = worktree.open_repo(req.repo)
    if isinstance(repo, worktree.Failure):
        return refused(req, [f"invalid request: {repo.reason}"], Code.INVALID_REQUEST, job.start)
    base = worktree.resolve_base(repo, req.branch) if req.branch else worktree.default_base(repo)
    if isinstance(base, worktree.Failure):
        return refused(req, [f"invalid request: {base.reason}"], Code.INVALID_REQUEST, job.start)

    # The argv is built (and a too-large prompt refused) before anything is created on disk.
    wt_path = repo.path.parent / f"{repo.path.name}-agents" / job.job_id
    tmpdir = Path(tempfile.mkdtemp(prefix=f"proctor-{job.job_id}-"))
    prompt_file = tmpdir / "prompt.md" if spec.prompt == "file" else None
    if prompt_file is not None:
        prompt_file.write_text(req.task, encoding="utf-8")
    env = {**os.environ, **spec.env, "PROCTOR_JOB_ID": job.job_id, "PROCTOR_WORKTREE": str(wt_path),
           "TMPDIR": str(tmpdir)}
    inv = build(spec, req.task, wt_path, prompt_file, env)
    if isinstance(inv, TooLarge):
        shutil.rmtree(tmpdir, ignore_errors=True)
        return refused(req, [inv.reason], Code.PROMPT_TOO_LARGE, job.start)

    stopped = job.stop.reason()
    if stopped:
        shutil.rmtree(tmpdir, ignore_errors=True)
        return refused(req, [f"proctor is stopped ({stopped}); nothing was launched"], Code.STOPPED, job.start)
    mode = req.confine or job.config.confine
    confiner = confine.choose(mode, confine.detect())
    if isinstance(confiner, confine.Unavailable):
        shutil.rmtree(tmpdir, ignore_errors=True)
        return refused(req, [confiner.reason], confiner.code, job.start)
    admission = job.breaker.admit(req.agent, job_id=job.job_id)
    if not admission.allowed:
        shutil.rmtree(tmpdir, ignore_errors=True)
        return refused(req, [admission.reason], admission.code, job.start)

    job.progress.phase("creating the worktree")
    wt = worktree.create(repo, job.job_id, req.ticket, base)
    if isinstance(wt, worktree.Failure):
        shutil.rmtree(tmpdir, ignore_errors=True)
        job.breaker.record(req.agent, signal_for(Status.failed, Code.WORKTREE_FAILED), job_id=job.job_id)
        return refused(req, [wt.reason], Code.WORKTREE_FAILED, job.start)

    result = RunAgentResult(
        status=Status.failed, agent=req.agent, worktree_path=str(wt.path), job_id=job.job_id,
        branch=wt.branch, base_ref=base.ref, mode=req.mode,
    )
    try:
        plan = _confine(job, confiner, mode, wt, tmpdir, list(inv.argv))
        if isinstance(plan, confine.Unavailable):
            result.code = plan.code
            result.summary = plan.reason
            job.risks.append(f"{plan.reason}; nothing was launched")
        else:
            result.confinement = plan.confinement
            result.confinement_details = {**plan.details, "gaps": plan.gaps}
            _launch_and_judge(job, wt, plan.argv, inv.stdin, {**env, **plan.env}, result)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    job.breaker.record(req.agent, signal_for(result.status, result.code), job_id=job.job_id)
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


def _confine(job: _Job, confiner: confine.Confiner, mode: str, wt: worktree.Worktree, tmpdir: Path,
             argv: list[str]) -> confine.ConfinePlan | confine.Unavailable:
    """The OS-enforced plan for this job's agent, never silently weaker than the policy asked."""
    planted = confine.refuse_hard_links(wt.path)
    if planted:
        # A hard link the host left in the worktree is writable under every layer (research/sandbox.md).
        return confine.Unavailable(f"worktree files with more than one hard link: {', '.join(planted[:5])}")
    state_dirs = []
    for raw in job.spec.state_dirs:
        d = Path(raw).expanduser()
        d.mkdir(parents=True, exist_ok=True)
        state_dirs.append(d)
    roots = confine.job_roots(wt.common_dir, wt.git_dir, wt.branch, wt.path, tmpdir, state_dirs,
                              network=job.spec.network)
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


BLOCKED_MARKERS = ("Read-only file system", "Permission denied", "Operation not permitted", "proctor-landlock:")


def _blocked_attempts(ex: Exit) -> str | None:
    """A line of the agent's output that shows the confinement refusing it something, if any."""
    text = (ex.stderr[-200_000:] + b"\n" + ex.stdout[-200_000:]).decode("utf-8", "replace")
    for line in text.splitlines():
        if any(m in line for m in BLOCKED_MARKERS):
            return line.strip()[:300]
    return None


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


def _launch_and_judge(job: _Job, wt: worktree.Worktree, argv, stdin, env, result: RunAgentResult) -> None:
    req, spec = job.request, job.spec
    result.agent_version = agent_version(spec, env, Path(env["TMPDIR"]))
    patterns = Patterns.build(spec.rate_limit_patterns, spec.approval_patterns)
    last: Exit | None = None
    for attempt in range(1, MAX_ATTEMPTS + 1):
        job.progress.phase(f"running {req.agent} (attempt {attempt})")
        watcher = WATCHERS[spec.output]() if spec.output in WATCHERS else None
        last = job.runner.run(Spawn(
            argv=argv, cwd=wt.path, env=env, deadline_s=req.timeout_sec, stdin=stdin,
            watch=job.progress.watch(watcher), poll=_poll(job), name=f"job-{job.job_id}-{attempt}",
            term_grace_s=job.config.term_grace,
        ))
        result.attempts = attempt
        result.exit_codes.append(last.exit_code)
        if result.confinement_details is not None:
            result.confinement_details["cleanup"] = f"{result.confinement_details.get('cleanup', 'none')}+{last.cleanup}"
        blocked = _blocked_attempts(last) if result.confinement not in (None, "none") else None
        if blocked:
            job.risks.append(f"the agent tried something its confinement refused: {blocked!r}")
        if last.leftovers_killed:
            job.risks.append(f"the agent left {last.leftovers_killed} process(es) running after it exited; "
                             f"killed by {last.cleanup}")
        if last.stdout_dropped or last.stderr_dropped:
            job.risks.append(f"agent output exceeded the tail: {last.stdout_dropped} stdout and "
                             f"{last.stderr_dropped} stderr bytes were not kept")
        if last.spawn_error:
            result.status, result.code = Status.failed, Code.AGENT_NOT_FOUND
            job.risks.append(f"agent {req.agent!r} could not be started: {last.spawn_error}")
            break
        if last.timed_out:
            result.status, result.code = Status.timed_out, Code.TIMED_OUT
            job.risks.append(f"agent killed at the {req.timeout_sec}s deadline (whole tree, by {last.cleanup}); "
                             "no retry after a timeout")
            break
        if last.killed_reason and last.killed_reason.startswith(("cancelled", "stopped")):
            code = Code.CANCELLED if last.killed_reason.startswith("cancelled") else Code.STOPPED
            result.status, result.code = Status.failed, code
            job.risks.append(f"job {last.killed_reason}; the agent's process tree was killed")
            break
        if last.exit_code == 0:
            result.status, result.code = Status.completed, Code.OK
            break
        text = (last.stdout + b"\n" + last.stderr).decode("utf-8", "replace")
        verdict = classify(last.exit_code, text, patterns)
        if last.killed_reason and last.killed_reason.startswith("rate_limit_event"):
            verdict = type(verdict)(Status.rate_limited, last.killed_reason, verdict.retry_after)
        if verdict.status is not None:
            result.status = verdict.status
            result.code = Code.RATE_LIMITED if verdict.status is Status.rate_limited else Code.APPROVAL_REQUIRED
            result.retry_after = verdict.retry_after
            job.risks.append(f"agent exited {last.exit_code} and its output matched {verdict.matched!r}: "
                             f"{verdict.status.value}; not retried")
            break
        if attempt < MAX_ATTEMPTS:
            job.risks.append(f"agent exited {last.exit_code}; retried once in the same worktree")
            continue
        result.status, result.code = Status.failed, Code.AGENT_FAILED
        job.risks.append(f"agent exited {last.exit_code} twice")

    assert last is not None
    reading = READERS[spec.output](last.stdout.decode("utf-8", "replace"), last.stderr.decode("utf-8", "replace"))
    result.summary = reading.summary or f"{req.agent} exited {last.exit_code}"
    result.claimed_status = reading.claimed_status
    result.retry_after = result.retry_after or (reading.retry_after if result.status is Status.rate_limited else None)

    job.progress.phase("collecting the agent's changes")
    before = worktree.changed_files(wt)
    if isinstance(before, worktree.Failure):
        job.risks.append(f"could not list the agent's changes: {before.reason}")
    else:
        result.agent_changed_files = before
        if not before:
            job.risks.append("the agent changed no files")

    validated = result.status is Status.completed and _validate(job, wt, env, result)
    # Nothing ran after the first listing unless validation did: the same listing stands.
    after = worktree.changed_files(wt) if validated else before
    if isinstance(after, worktree.Failure):
        job.risks.append(f"could not list changed files after validation: {after.reason}")
    else:
        result.changed_files = after


def _validate(job: _Job, wt: worktree.Worktree, env, result: RunAgentResult) -> bool:
    """Run the host's own validation; False when nothing ran."""
    req = job.request
    plan = validate.given(req.validate_command) if req.validate_command else validate.detect(wt.path)
    if not plan.steps:
        job.risks.append(plan.skipped_reason or "validation skipped")
        return False
    job.progress.phase("validating")
    plan = _confined_validation(job, plan)
    if plan is None:
        return False
    attempts = validate.run(plan, job.runner, cwd=wt.path, env=env, timeout_s=job.config.validate_timeout,
                            name=f"validate-{job.job_id}")
    result.tests_attempted = [a.line(job.config.validate_timeout) for a in attempts]
    failed = [a for a in attempts if not a.passed]
    if failed:
        result.status, result.code = Status.failed, Code.VALIDATION_FAILED
        job.risks.append(f"validation failed: {failed[0].line(job.config.validate_timeout)}")
    return True
