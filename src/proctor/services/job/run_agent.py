"""The run_agent service: one job, from a validated request to the host's own verdict.

Owns the order of a job — check the request on this machine, admit it (stop switch, confinement policy,
breaker), cut the worktree, launch the adapter confined, collect the diff, validate, judge — the rule for
`needs_human_review`, and the ledger rows that make every job visible, a crashed one included. It never
trusts the agent's word: `claimed_status` is recorded and decides nothing; `changed_files` and
`tests_attempted` are what the host itself observed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from proctor.mechanisms import confine
from proctor.mechanisms.adapters.output import Backend, Usage
from proctor.mechanisms.adapters.spec import AdapterSpec, Invocation, Refused, build, pool_key
from proctor.mechanisms.config.load import Config, ConfigError, load_config
from proctor.mechanisms.confine.egress import EgressProxy
from proctor.mechanisms.confine.plan import programs_of
from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.mechanisms.evidence import holdout as held
from proctor.mechanisms.evidence import preempt, recipe, signals
from proctor.mechanisms.evidence.instrument import instrument, strip_bytecode
from proctor.home import proctor_home
from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.config.settings import RepoSettings
from proctor.mechanisms.validation import environment, plan as validate
from proctor.mechanisms.git import frozen, landing, worktree
from proctor.mechanisms import gatekeeper
from proctor.services.job import record, sandbox_home
from proctor.services.job.agent_version import VERSION_TIMEOUT_S, agent_version, executable, inside
from proctor.services.job.attempts import missing_program, run_attempts
from proctor.mechanisms.confine.cgroup import Limits
from proctor.mechanisms.git.command import git, unredirected_env
from proctor.mechanisms.process.local import Limited, LocalRunner, ProcessRunner, Spawn
from proctor.mechanisms.ledger.store import Ledger, LedgerError, LedgerFull, LedgerTampered
from proctor.mechanisms.policy import diffcheck
from proctor.mechanisms.policy.breaker import Breaker, evidence_for
from proctor.mechanisms.policy.governor import Booking, Spend, UsageGovernor, iso
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.tally import SqliteTally
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.services.job.progress import NullProgress, Progress

PYTEST_NO_TESTS = 5


def validation_log(job_id: str) -> Path:
    """Where a job's validation output is kept in full (what the runner kept: 1 MB a stream), host-owned:
    under $PROCTOR_HOME, which no agent can read or write."""
    return proctor_home() / "jobs" / job_id / "validation.log"


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
    spec: AdapterSpec
    limits: Limits  # config's [limits], resolved once: the agent, its validation and its probe get them
    # Two private dirs: the agent's TMPDIR (writable by it) and the host's own (never granted to it).
    agent_tmp: Path
    host_tmp: Path
    risks: list[str] = field(default_factory=list)
    mode: str = "auto"
    # Set once the agent's plan is made; validation runs under the same confiner, network off.
    confiner: confine.Confiner | None = None
    # The agent's directory once it exited, taken aside and made exactly a tree; validation runs there.
    work: Path = Path()
    state_dirs: tuple[Path, ...] = ()  # the job's copies of the adapter's, under its own HOME (sandbox_home)
    state: sandbox_home.StateCopy | None = None  # settled when the agent exited (_settle_state)
    egress: EgressProxy | None = None  # the host-run proxy to the adapter's declared hosts, while the agent runs
    refused_egress: dict[str, str] = field(default_factory=dict)  # host:port -> why, every proxy of the job
    gate: gatekeeper.GateService | None = None  # the gate the agent's CLI asks before each tool call
    backend: Backend | None = None  # an HTTP status the CLI's protocol reported for the deciding run
    # The repo's keys (config over the base's .proctor.toml), read once: its setup, shares and validate.
    settings: RepoSettings | None = None
    governor: UsageGovernor | None = None  # books the job against the trusted policy's spend budgets
    usage: Usage | None = None  # what the CLI's protocol reported using, every attempt's
    # Did the agent's process start: False until the launch is tried, None while it is in flight (unknown
    # if it raised), then what the runner saw. Decides whether the job's booking is settled or released.
    launched: bool | None = False


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
    spend: Spend | None = None,
) -> RunAgentResult:
    """Have `request.agent` do `request.task` in a new worktree of `request.repo`; never raises for a bad
    request or a misbehaving agent: every outcome is a result with a status and a code.

    The job is booked against the trusted policy's spend budgets (never a caller's) in `spend`'s tally;
    default: this home's SQLite tally with no lane (a queued job's runner passes the fleet's and its lane).

    `cancel` is polled while the agent and validation run (as is the stop switch); a reason kills the whole
    tree. Every job writes a `job.start` row before anything happens and a `job.end` row with its verdict,
    so a crash in between shows as an interrupted job, never as nothing.
    """
    start = time.monotonic()
    own_ledger = ledger is None
    try:
        ledger = ledger or Ledger.default()
    except LedgerFull as exc:
        return refused(request, [f"{exc}; nothing was launched"], Code.DISK_FULL, start)
    except Exception as exc:  # noqa: BLE001 - an unusable ledger: refuse rather than run unrecorded
        return refused(request, [f"the ledger cannot be opened: {exc}"], Code.HOST_ERROR, start)
    # A chain already broken is refused before any row: one chained onto an edited row would vouch for it.
    broken = ledger.chain_problems()
    if broken:
        if own_ledger:
            ledger.close()
        return refused(request, [f"the ledger {ledger.path} was changed outside proctor: "
                                 f"{broken[0]}; nothing was launched or recorded (`proctor ledger verify`)"],
                       Code.LEDGER_TAMPERED, start)
    job_id = job_id or new_job_id()
    try:
        result = _recorded(request, config, runner, progress, cancel, job_id, ledger, stop, start, spend=spend)
        result.job_id = job_id
        return result
    finally:
        if own_ledger:
            ledger.close()


def _recorded(request, config, runner, progress, cancel, job_id, ledger, stop, start, *,
              spend=None) -> RunAgentResult:
    """The job between its `job.start` and `job.end` rows. A row that cannot be written ends the job with a
    result all the same (DISK_FULL when the disk is full): the ledger keeps what it had, never half a row.
    The end row may use the ledger's reserve, so a disk that filled up during the job still records it."""
    space = ledger.space_problem()
    if space:
        return refused(request, [f"{space}; nothing was launched"], Code.DISK_FULL, start)
    try:
        ledger.append("job.start", {"jobId": job_id, "agent": request.agent, "ticket": request.ticket,
                                    "repo": request.repo, "mode": request.mode, "branch": request.branch},
                      job_id=job_id)
    except LedgerError as exc:
        return refused(request, [f"the job's start could not be recorded ({exc}); nothing was launched"],
                       _ledger_code(exc), start)
    record.started(job_id)  # host.json: who runs the job, so review tells running from abandoned
    live = record.LiveProgress(job_id, progress or NullProgress())  # progress.json: the review page's
    try:
        result = _admit_and_run(request, config, runner, live, cancel, job_id, ledger, stop, start,
                                spend=spend)
    except LedgerError as exc:
        result = refused(request, [f"a ledger row could not be written, so the job was ended: {exc}"],
                         _ledger_code(exc), start)
    result.job_id = job_id
    try:
        ledger.append("job.end", {"jobId": job_id, "status": result.status.value, "code": result.code.value,
                                  "needs_human_review": result.needs_human_review,
                                  "worktreePath": result.worktree_path}, job_id=job_id, reserve=True)
    except LedgerError as exc:
        result.status, result.code, result.needs_human_review = Status.failed, _ledger_code(exc), True
        result.known_risks = [*result.known_risks, f"the job's end could not be recorded: {exc}"]
    record.ended(request, result)  # result.json + request.json, for `proctor show` and `proctor land`
    return result


def _ledger_code(exc: LedgerError) -> Code:
    if isinstance(exc, LedgerTampered):
        return Code.LEDGER_TAMPERED
    return Code.DISK_FULL if isinstance(exc, LedgerFull) else Code.HOST_ERROR


def _admit_and_run(request, config, runner, progress, cancel, job_id, ledger, stop, start, *,
                   spend=None) -> RunAgentResult:
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
    breaker = Breaker(ledger, threshold=config.breaker.threshold, cooldown_s=config.breaker.cooldown_s,
                      backoff_s=config.breaker.backoff_s)
    spend = spend or Spend(SqliteTally.default)
    try:
        governor = UsageGovernor(Policy.load().budgets, spend.tally, lane=spend.lane)
    except PolicyError as exc:
        return refused(request, [f"the trusted policy cannot be read: {exc}"], Code.CONFIG_INVALID, start)
    limits = config.limits.resolve()
    job = _Job(request, config, runner or LocalRunner(limits=limits), progress or NullProgress(), cancel, job_id,
               start, ledger, stop or StopSwitch(), spec, limits, Path(tempfile.mkdtemp(prefix=f"proctor-{job_id}-")),
               Path(tempfile.mkdtemp(prefix=f"proctor-host-{job_id}-")), governor=governor)
    try:
        return _run(job, breaker)
    finally:
        governor.close()
        if job.egress is not None:
            job.egress.stop()
        shutil.rmtree(job.agent_tmp, ignore_errors=True)
        shutil.rmtree(job.host_tmp, ignore_errors=True)


def _agent_env(job: _Job, wt_path: Path) -> dict[str, str]:
    """The declared environment (sandbox_home.declared_env), never the host's whole one: a key exported for
    proctor reached every agent and the code under test (issue 21). HOME is the job's own, in its private
    tmp, where its copy of the adapter's state dirs goes (_confine)."""
    declared = sandbox_home.declared_env(unredirected_env(), job.spec, job.config.env_pass)
    home = str(_job_home(job))
    # An adapter's `env` value "~/x" is under the agent's HOME, as its state_dirs are (CLAUDE_CONFIG_DIR).
    return {**declared.env, "HOME": home, **job.spec.env_under(home), "PROCTOR_JOB_ID": job.job_id,
            "PROCTOR_WORKTREE": str(wt_path), "TMPDIR": str(job.agent_tmp)}


def _job_home(job: _Job) -> Path:
    return job.agent_tmp / "home"


def _without_credentials(job: _Job, env: dict[str, str]) -> dict[str, str]:
    """`env` minus the adapter's login: for everything of the job but the agent's own process."""
    creds = set(sandbox_home.credential_names(job.spec))
    return {k: v for k, v in env.items() if k not in creds}


def _run(job: _Job, breaker: Breaker) -> RunAgentResult:
    req, spec = job.request, job.spec
    job.progress.phase("checking the request")
    repo = worktree.open_repo(req.repo)
    if isinstance(repo, worktree.Failure):
        return refused(req, [f"invalid request: {repo.reason}"], Code.INVALID_REQUEST, job.start)
    base = worktree.resolve_base(repo, req.branch) if req.branch else worktree.default_base(repo)
    if isinstance(base, worktree.Failure):
        return refused(req, [f"invalid request: {base.reason}"], Code.INVALID_REQUEST, job.start)
    # Every dir the job keeps state in is this user's and writable by nobody else, before anything is
    # written or launched: `{repo}-agents/`, the two TMPDIRs, and the job's record dir (issue 21).
    why = record.unsafe_dirs(job.job_id) or worktree.unsafe_dirs(repo, (job.agent_tmp, job.host_tmp))
    if why:
        return refused(req, [f"{why}; nothing was launched"], Code.UNSAFE_DIRECTORY, job.start)

    # The argv is built (and a too-large prompt refused) before anything is created on disk.
    wt_path = worktree.path_for(repo, job.job_id)
    prompt_file = job.agent_tmp / "prompt.md" if spec.prompt == "file" else None
    if prompt_file is not None:
        prompt_file.write_text(req.task, encoding="utf-8")
    env = _agent_env(job, wt_path)
    inv = build(spec, req.task, wt_path, prompt_file, env, gate_dir=_gate_dir(job) if spec.gate else None)
    if isinstance(inv, Refused):
        return refused(req, [inv.reason], Code(inv.code), job.start)
    # Before any worktree, probe or sandbox: inside one, a missing program read as a confinement refusal
    # and was retried (issue 24).
    missing = missing_program(inv.argv[0], env.get("PATH"), repo.path) if inv.argv else None
    if missing:
        return refused(req, [f"{missing}; nothing was launched"], Code.AGENT_NOT_FOUND, job.start)

    stopped = job.stop.reason()
    if stopped:
        return refused(req, [f"proctor is stopped ({stopped}); nothing was launched"], Code.STOPPED, job.start)
    job.mode = req.confine or job.config.confine
    confiner = confine.choose(job.mode, confine.detect())
    if isinstance(confiner, confine.Unavailable):
        return refused(req, [confiner.reason], confiner.code, job.start)
    pool = pool_key(spec, env)
    # The budget before the breaker: a denied job must not take the breaker's half-open trial with it.
    booking = _book(job)
    if isinstance(booking, RunAgentResult):
        return booking
    try:
        admission = breaker.admit(pool, job_id=job.job_id)
    except BaseException:
        _settle(job, booking)  # a ledger that refused the breaker's row: the unit booked goes back
        raise
    if not admission.allowed:
        out = refused(req, [admission.reason], admission.code, job.start)
        out.breaker = {"pool": pool, "admitted": False, "retry_at": admission.retry_at}
        out.budget = _settle(job, booking)
        return out

    result = RunAgentResult(status=Status.failed, agent=req.agent, job_id=job.job_id, base_ref=base.ref,
                            mode=req.mode, code=Code.HOST_ERROR)
    try:
        _in_worktree(job, repo, base, confiner, inv, env, result)
    finally:
        # Whatever happened after admission, the breaker hears of it (a half-open trial is never left held).
        # The booking first (settled with what the CLI reported, or released if nothing launched), and the
        # breaker whatever that did: a ledger row refused on one side must not leave the other held.
        try:
            result.budget = _settle(job, booking)
        finally:
            seen = evidence_for(result.status, result.code, job.backend.status if job.backend else None,
                                job.backend.source if job.backend else "")
            after = breaker.record(pool, seen.signal, job_id=job.job_id)
            result.breaker = {"pool": pool, "admitted": True, "signal": seen.signal.value, "source": seen.source,
                              "state": after.state.value}
    _refused_egress(job)
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


def _book(job: _Job) -> Booking | RunAgentResult:
    """Book the job's estimate against every budget covering its agent (and lane) before anything is made
    on disk. No room: `rate_limited`/BUDGET_DENIED with `retry_after`, when the window frees; a tally that
    cannot be reached: `failed`/BUDGET_UNAVAILABLE. Either is a `usage.denied` row; a booking, `usage.booked`."""
    req = job.request
    if job.governor is None:
        return Booking(job.job_id, req.agent, None, None)
    got = job.governor.book(req.agent, job.job_id)
    if isinstance(got, Booking):
        if got.parts:
            try:
                job.ledger.append("usage.booked", got.record(), job_id=job.job_id)
            except LedgerError:
                job.governor.release(got)  # unrecorded, the job ends here: its booking must not outlive it
                raise
        return got
    job.ledger.append("usage.denied", got.record(), job_id=job.job_id)
    risks = [f"{o.line()}; nothing was launched" for o in got.over] or [got.reason]
    out = refused(req, risks, got.code, job.start)
    if got.code is Code.BUDGET_DENIED:
        out.status = Status.rate_limited
        out.retry_after = iso(got.retry_at) if got.retry_at is not None else None
    out.budget = got.record()
    return out


def _settle(job: _Job, booking: Booking) -> dict | None:
    """The booking settled with the CLI's reported usage once the agent launched, its estimate kept when the
    launch's fate is unknown (it raised), released when nothing launched; a `usage.settled` or
    `usage.released` row (through the reserve, like the job's end). The result's `budget` field."""
    if job.governor is None or not booking.parts:
        return None
    if job.launched is False:
        done, kind = job.governor.release(booking), "usage.released"
    else:
        done, kind = job.governor.settle(booking, job.usage if job.launched else None), "usage.settled"
    if done.error:
        job.risks.append(f"the spend tally could not be settled (the estimate stands): {done.error}")
    job.ledger.append(kind, done.record(), job_id=job.job_id, reserve=True)
    return done.view()


def _in_worktree(job: _Job, repo: worktree.Repo, base: worktree.Base, confiner: confine.Confiner,
                 inv: Invocation, env: dict[str, str], result: RunAgentResult) -> None:
    req = job.request
    job.progress.phase("creating the worktree")
    wt = worktree.create(repo, job.job_id, req.ticket, base)
    if isinstance(wt, worktree.Failure):
        result.code, result.summary = Code(wt.code) if wt.code else Code.WORKTREE_FAILED, wt.reason
        job.risks.append(wt.reason)
        return
    result.worktree_path, result.branch = str(wt.path), wt.branch
    job.risks.extend(worktree.checkout_risks(repo, base))
    job.work = wt.path.with_name(f".{wt.path.name}.work")
    # Decided on the fresh checkout of the base, before the agent runs: the agent must not pick its own test.
    plan = validate.given(req.validate_command) if req.validate_command else validate.detect(wt.path)

    gate = _start_gate(job, wt, result)
    if isinstance(gate, str):
        result.code, result.summary = Code.CONFIG_INVALID, gate
        job.risks.append(f"{gate}; nothing was launched")
        return
    job.gate = gate
    try:
        _agent_phase(job, wt, confiner, inv, env, result, plan)
    finally:
        if gate is not None:
            gate.stop()
            _gate_result(job, gate, result)


def _agent_phase(job: _Job, wt: worktree.Worktree, confiner: confine.Confiner, inv: Invocation,
                 env: dict[str, str], result: RunAgentResult, plan: validate.Plan) -> None:
    req, spec = job.request, job.spec
    cplan = _confine(job, confiner, wt, list(inv.argv), env)
    if isinstance(cplan, confine.Unavailable):
        result.code, result.summary = cplan.code, cplan.reason
        job.risks.append(f"{cplan.reason}; nothing was launched")
        return
    result.confinement = cplan.confinement
    result.confinement_details = {**cplan.details, "gaps": cplan.gaps}
    agent_env = {**env, **cplan.env, **(job.gate.dialect.env(job.gate.dir) if job.gate is not None else {})}
    result.agent_version = _probe_version(job, confiner, wt, env)

    # The job's limits (memory, pids, CPU weight; disk added to the worktree and the agent's TMPDIR). The
    # stop switch is read once more by the runner, as the last thing before each spawn.
    limited = Limited(job.runner, job.limits, (wt.path, job.agent_tmp))
    job.settings = _repo_settings(job, wt)
    if job.settings is not None and job.settings.setup:
        _setup(job, wt, limited, env, result)
    job.launched = None
    try:
        out = run_attempts(spec=spec, argv=cplan.argv, stdin=inv.stdin, env=agent_env, cwd=wt.path,
                           runner=limited, progress=job.progress, poll=_poll(job), timeout_s=req.timeout_sec,
                           term_grace_s=job.config.term_grace, name=f"job-{job.job_id}",
                           confined=cplan.confinement != "none",
                           watch=job.gate.watch() if job.gate is not None else None)
    finally:
        _stop_egress(job)
        _settle_state(job, result)
    result.confinement_details["limits"] = list(limited.enforced)
    if limited.gaps:
        result.confinement_details["limit_gaps"] = list(limited.gaps)
        job.risks.extend(f"resource limit not enforced: {g}" for g in limited.gaps)
    result.status, result.code, result.attempts = out.status, out.code, out.attempts
    job.backend = out.backend
    job.launched, job.usage = out.launched, out.usage
    result.usage = out.usage.as_dict() if out.usage is not None else None
    result.exit_codes, result.retry_after = out.exit_codes, out.retry_after
    result.summary = out.reading.summary or f"{req.agent} exited {out.exit_codes[-1]}"
    result.claimed_status = out.reading.claimed_status
    result.confinement_details["cleanup"] = f"{cplan.details.get('cleanup', 'none')}+{out.cleanup}"
    job.risks.extend(out.risks)

    job.progress.phase("building the job's tree")
    landed = _land(job, wt, result)
    dirty = False
    try:
        if landed is not None:
            touched = frozen.test_defining(landed.changed)
            if touched:
                job.risks.append(f"the agent changed files that define the tests: {_names(touched)}")
            _diff_risks(job, landed)
            if result.status is Status.completed:
                dirty = True
                _validate(job, wt, landed, plan, env, result, touched)
    finally:
        _review_checkout(job, wt, landed, dirty)


def _diff_risks(job: _Job, landed: landing.Landing) -> None:
    """What a person must look at in the diff whatever the tests said: files that run before or instead of
    the code under test (a stdlib-named module, a `.pth`, a dist-info, bytecode, a runner's config), and
    cheat signals in the code (reading its caller, ending the process, state across calls, answers copied
    from the tests). Each a risk naming the file (and line)."""
    listing = git(["ls-tree", "-r", "--name-only", "-z", landed.base_sha, "--", ":(glob)*", ":(glob)*/__init__.*",
                   ":(glob)src/*", ":(glob)src/*/__init__.*"], git_dir=landed.git_dir)
    ours = preempt.top_level_modules(p.decode("utf-8", "surrogateescape") for p in listing.out.split(b"\0") if p)
    job.risks.extend(preempt.preempting(landed.changed, base_modules=ours))
    job.risks.extend(signals.diff_signals(landed.git_dir, landed.base_sha, landed.commit, landed.changed,
                                          frozen.is_test_defining))
    # The gate decides calls, not effects: the diff is checked against the declaration too (issue 22).
    try:
        policy = job.gate.gate.policy if job.gate is not None else Policy.load()
    except PolicyError as exc:
        job.risks.append(f"the job's diff was not checked against the trusted policy: {exc}")
        return
    job.risks.extend(diffcheck.undeclared(job.gate.gate.task if job.gate is not None else None,
                                          policy.forbidden_paths, landed.changed))


def _gate_dir(job: _Job) -> Path:
    """The gate's socket, hook and CLI settings: host-owned, outside the worktree; the sandbox sees it at the
    same path through a read-only bind (a mount point the agent cannot replace)."""
    return job.host_tmp / "gate"


def _start_gate(job: _Job, wt: worktree.Worktree, result: RunAgentResult) -> gatekeeper.GateService | None | str:
    """The job's gate service, for a CLI with a hook dialect; None for one without (UNGATED: recorded, and
    confinement alone protects it); a str when the job cannot be gated (nothing may launch then)."""
    spec = job.spec
    if spec.gate is None:
        result.gate = {"gated": False, "cli": spec.name,
                       "why": f"{spec.name} has no gate hook: any tool calls it makes are not decided by the "
                              "gate; OS confinement alone bounds them"}
        job.ledger.append("gate.ungated", {"jobId": job.job_id, "cli": spec.name}, job_id=job.job_id)
        return None
    try:
        policy = Policy.load()
    except PolicyError as exc:
        return f"the trusted policy cannot be read: {exc}"
    dialect = gatekeeper.DIALECTS[spec.gate]()
    if job.request.task_decl is not None:
        try:
            task = gatekeeper.with_workspace(AgentTask.model_validate(job.request.task_decl), wt.path)
        except ValidationError as exc:
            err = exc.errors()[0]
            return f"the declared task is invalid: {'.'.join(map(str, err['loc']))}: {err['msg']}"
    else:
        task = gatekeeper.default_task(job.request.task, wt.path, spec.network and bool(spec.egress), dialect.tools)
    service = gatekeeper.GateService(dialect, task, policy, job.ledger, job.job_id, _gate_dir(job),
                                     stop=job.stop.reason, worktree=wt.path, ticket=job.request.ticket,
                                     repo=str(wt.repo.path))
    try:
        return service.start()
    except OSError as exc:
        return f"the job's gate service did not start: {exc}"


def _gate_result(job: _Job, gate: gatekeeper.GateService, result: RunAgentResult) -> None:
    summary = gate.summary
    result.gate = summary.as_dict(gate.dialect.name, gatekeeper.settings_path(gate.dir, gate.dialect.name))
    if gate.held:
        result.gate["pending"] = gate.held
        result.status, result.code = Status.approval_required, Code.APPROVAL_REQUIRED
        job.risks.append(f"a tool call is held for a person: {gate.held[0]['reason']}")
    if gate.bypassed:
        result.status, result.code = Status.failed, Code.BYPASS
        job.risks.append("tool calls the gate never decided (its hook did not run): " + _names(gate.bypassed))
    if summary.refused:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(summary.by_code.items()) if c != "OK")
        job.risks.append(f"the gate refused {summary.refused} of the agent's {summary.decided} tool call(s): {codes}")
    if gate.failures:
        job.risks.append(f"gate decisions failed and were denied: {gate.failures[0]}")
    if gate.flood:
        job.risks.append(gate.flood)


def _names(paths: list[str], most: int = 5) -> str:
    more = f" (+{len(paths) - most} more)" if len(paths) > most else ""
    return ", ".join(paths[:most]) + more


def _land(job: _Job, wt: worktree.Worktree, result: RunAgentResult) -> landing.Landing | None:
    """Take the agent's directory aside, commit its content on the job's branch in a git dir the host makes
    (at the review path, which holds nothing else yet), and make the directory exactly that commit's tree.
    Nothing of the agent's directory is read but through lstat and git's hashing of regular files."""
    try:
        os.rename(wt.path, job.work)
        wt.path.mkdir()
    except OSError as exc:
        result.status, result.code = Status.failed, Code.HOST_ERROR
        job.risks.append(f"could not take the agent's worktree for review: {exc}")
        return None
    found = landing.scan(job.work)
    if isinstance(found, worktree.Failure):
        result.status, result.code = Status.failed, Code.TAMPERED
        job.risks.append(f"the job's tree was not built: {found.reason}")
        return None
    _report_scan(job, found, result)
    built = landing.build(job.work, wt.path / ".git", wt, job.host_tmp, found,
                          f"proctor job {job.job_id} ({job.request.agent}): {job.request.ticket}\n")
    if isinstance(built, worktree.Failure):  # build also made the work directory exactly its tree
        result.status, result.code = Status.failed, Code.HOST_ERROR
        job.risks.append(f"the job's tree was not built: {built.reason}")
        return None
    big = [(p, n) for p, n in found.oversized if p not in built.left_out_ignored]
    if big:
        job.risks.append("files over the size cap were left out of the job's tree: "
                         + _names([f"{p} ({n} bytes)" for p, n in big]))
    result.commit = built.commit
    result.agent_changed_files = list(built.changed)
    result.changed_files = list(built.changed)
    if not built.changed:
        job.risks.append("the agent changed no files")
    job.ledger.append("job.tree", {"jobId": job.job_id, "commit": built.commit, "tree": built.tree,
                                   "changed": len(built.changed), "left_out": list(found.left_out)[:50]},
                      job_id=job.job_id)
    return built


def _review_checkout(job: _Job, wt: worktree.Worktree, landed: landing.Landing | None, dirty: bool) -> None:
    """The review surface at the job's path: the work directory made exactly the job's commit once more
    (validation ran agent code in it), with the job's git dir moved in. Until this rename the path holds
    only that git dir, so a crash never leaves agent-written files where a person reviews."""
    if landed is None:
        if not worktree.remove_tree(job.work):
            job.risks.append(f"the agent's scratch directory {job.work} could not be removed")
        return
    made = landing.materialise(job.work, landed.git_dir, landed.tree, landed.index,
                               known=landed.known) if dirty else None
    failure = made or landing.fresh_index_copy(landed.index, landed.git_dir)
    if failure is None:
        try:
            os.rename(landed.git_dir, job.work / ".git")
            os.rmdir(wt.path)
            os.rename(job.work, wt.path)
        except OSError as exc:
            failure = worktree.Failure(f"cannot move the review checkout in place: {exc}")
    if failure is not None:
        job.risks.append(f"the review checkout was not made: {failure.reason}")
        worktree.remove_tree(job.work)


def _report_scan(job: _Job, found: landing.Scan, result: RunAgentResult) -> None:
    if found.special:
        # A FIFO where the host reads hung it for ever in review; nothing honest leaves one.
        result.status, result.code = Status.failed, Code.TAMPERED
        job.risks.append("the agent left special files (FIFO, socket or device) in its worktree: "
                         f"{_names(list(found.special))}; left out of the job's tree")
    if found.nested:
        job.risks.append(f"the agent left nested git repositories: {_names(list(found.nested))}; "
                         "their files are not part of the job's tree")
    if found.unreadable:
        job.risks.append(f"unreadable entries in the agent's worktree were left out: {_names(list(found.unreadable))}")


def _confine(job: _Job, confiner: confine.Confiner, wt: worktree.Worktree, argv: list[str],
             env: dict[str, str]) -> confine.ConfinePlan | confine.Unavailable:
    """The OS-enforced plan for this job's agent, never silently weaker than the policy asked.

    The adapter's state dirs are the job's copies under its own HOME; the user's home is hidden but for
    what the job needs from it (_hide_home). The adapter's credentials move from `env` into the plan's env:
    the agent's process gets them, the version probe, setup and validation (which get `env`) do not."""
    spec = job.spec
    planted = confine.refuse_hard_links(wt.path)
    if planted:
        # A hard link the host left in the worktree is writable under every layer (research/sandbox.md).
        return confine.Unavailable(f"worktree files with more than one hard link: {', '.join(planted[:5])}")
    user_home = sandbox_home.user_home(unredirected_env())
    if user_home is not None and Path(env.get("HOME", "")) == _job_home(job):
        copied = sandbox_home.copy_state(_job_home(job), user_home, spec)
        if isinstance(copied, str):
            return confine.Unavailable(copied)
        job.state = copied
    state_dirs = []
    # `~` is the agent's HOME (an adapter's env may move it), which is where its CLI writes its state.
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
    job.state_dirs = tuple(state_dirs)
    roots = _hide_holdout(job, wt, confine.job_roots(wt.path, job.agent_tmp, state_dirs, readonly=_main_repo(wt),
                                                      network=spec.network))
    if isinstance(roots, confine.Unavailable):
        return roots
    if job.gate is not None:
        # The hook runs inside the sandbox: its dir read-only at the same path, its interpreter visible.
        roots = dataclasses.replace(roots, ro_binds=(*roots.ro_binds, (job.gate.dir, job.gate.dir)),
                                    readonly=(*roots.readonly, Path(sys.base_prefix).resolve()))
    if spec.network and confiner.name != "none":
        # The network is the adapter's declared hosts only, through a proxy the host runs: an agent with
        # the whole network reached the loopback NATS server and deleted the job stream (found in review).
        proxy = EgressProxy(spec.egress, job.host_tmp / "egress.sock", on_decision=_egress_row(job))
        try:
            job.egress = proxy.start()
        except (OSError, RuntimeError, ValueError) as exc:
            return confine.Unavailable(f"the egress proxy did not start: {exc}")
        roots = dataclasses.replace(roots, egress_socket=proxy.socket_path, egress=spec.egress)
    job.confiner = confiner
    programs = programs_of(argv, env.get("PATH"))
    hidden = _hide_home(job, roots, programs)
    if isinstance(hidden, confine.Unavailable):
        return hidden
    plan = confiner.wrap(argv, hidden)
    if not isinstance(plan, confine.Unavailable):
        creds = {k: env.pop(k) for k in sandbox_home.credential_names(spec) if k in env}
        plan = dataclasses.replace(plan, env={**plan.env, **creds},
                                   details={**plan.details, **_boundary(job, roots, programs, plan.confinement)})
    if not isinstance(plan, confine.Unavailable) and plan.confinement == "none":
        # Validation runs under the same confiner: it ran unconfined too, agent-written code with the host
        # user's rights. Never a verdict a person may skip.
        why = ("confinement is off by request" if job.mode == "off" else
               f"no OS confinement on this machine ({'; '.join(plan.gaps) or 'neither bubblewrap nor Landlock'})")
        job.risks.append(f"{why}: the agent and its validation ran unconfined")
    return plan


def _hide_home(job: _Job, roots: confine.ConfineRequest,
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


def _boundary(job: _Job, roots: confine.ConfineRequest, programs: list[str], confinement: str) -> dict[str, object]:
    """What of the host the job was given, for the result's confinement_details: the names of the host
    variables passed (never values), its HOME, what of the user's home it could read, its state copy."""
    host = unredirected_env()
    declared = sandbox_home.declared_env(host, job.spec, job.config.env_pass)
    home = sandbox_home.user_home(host)
    hidden = home is not None and confinement != "none"
    return {"env": list(declared.names), "credentials": list(declared.credentials),
            "home": {"path": str(_job_home(job)), "user_home": str(home) if home else None,
                     "user_home_hidden": hidden,
                     "readable": [str(p) for p in _home_shown(
                         home, sandbox_home.home_keep(home, host, job.config.read_home, programs), roots)][:50]
                     if hidden else None},
            "state": job.state.describe() if job.state is not None else None}


def _settle_state(job: _Job, result: RunAgentResult) -> None:
    """After the agent: the must-keep files of its state copy written back, a change to the CLI's config,
    hooks, MCP servers or extensions a risk (the copy, and the change, go with the job's tmp)."""
    if job.state is None:
        return
    done = sandbox_home.settle(job.state)
    details = result.confinement_details.get("state")
    if isinstance(details, dict):
        details.update(kept=list(done.kept), not_kept=list(done.not_kept), changed_config=list(done.changed_config))
    if done.changed_config:
        job.risks.append("the agent changed its CLI's config, hooks, MCP servers or extensions in its state dir: "
                         f"{_names(list(done.changed_config))} (the job's copy only: discarded, never seen by "
                         "another job)")


def _repo_settings(job: _Job, wt: worktree.Worktree) -> RepoSettings | None:
    cfg = environment.settings(job.config.repos, wt.repo.path, wt.repo.common_dir, wt.base_sha)
    if isinstance(cfg, str):
        job.risks.append(cfg)
        return None
    return cfg


def _setup(job: _Job, wt: worktree.Worktree, runner: ProcessRunner, env: dict[str, str],
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
    # for the repo's commands, documented in README "The validation environment". What it names outside
    # the worktree (a venv poetry keeps under ~/.cache) is shown read-only, as to validation.
    jenv = environment.prepare(wt.path, wt.repo.path, validate.Plan(()), cfg, tmp=job.agent_tmp / "setup-env",
                               env=env, bind=False)
    roots = _hide_holdout(job, wt, confine.job_roots(wt.path, job.agent_tmp,
                                                      readonly=(*_main_repo(wt), *jenv.readonly),
                                                      network=bool(cfg.registries)))
    if not isinstance(roots, confine.Unavailable):
        roots = _hide_home(job, roots, ["/bin/sh"])
    if isinstance(roots, confine.Unavailable):
        job.risks.append(f"setup before the agent not run: {roots.reason}")
        return
    proxy = _registry_proxy(job, cfg, "setup-egress.sock", "setup before the agent")
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
            steps.append(validate.Step(f"setup before the agent: {command}", tuple(wrapped.argv)))
            step_env.update(wrapped.env)  # the proxy's variables, when it has a network
        run = validate.run(validate.Plan(tuple(steps)), runner, cwd=wt.path, env=step_env,
                           timeout_s=job.config.validate_timeout, name=f"setup-{job.job_id}", poll=_poll(job),
                           log=validation_log(job.job_id), watch=job.progress.watch(None))
    finally:
        if proxy is not None:
            proxy.stop()
    result.validation += [a.record() for a in run.attempts]
    failed = [a for a in run.attempts if not a.passed]
    if run.killed_reason or failed:
        why = run.killed_reason or failed[0].line(job.config.validate_timeout)
        job.risks.append(f"setup before the agent failed ({why}): the agent ran without it")


def _egress_row(job: _Job) -> Callable[[dict], None]:
    def row(decision: dict) -> None:
        job.ledger.append("egress.decision", {"jobId": job.job_id, **decision}, job_id=job.job_id)
        if not decision.get("allowed"):
            where = f"{decision.get('host')}:{decision.get('port')}"
            job.refused_egress.setdefault(where, str(decision.get("reason") or "refused"))

    return row


def _refused_egress(job: _Job) -> None:
    """A refused request is a cause a person should read in the result, not only in the ledger (a refused
    registry read as "no version found", issue 24): each host:port once, with the proxy's reason."""
    if job.refused_egress:
        shown = [f"{where} ({why})" for where, why in list(job.refused_egress.items())[:5]]
        more = f" (+{len(job.refused_egress) - 5} more)" if len(job.refused_egress) > 5 else ""
        job.risks.append(f"the network proxy refused requests to: {'; '.join(shown)}{more}")


def _stop_egress(job: _Job) -> None:
    if job.egress is None:
        return
    job.egress.stop()
    if job.egress.decisions_dropped:
        job.risks.append(f"{job.egress.decisions_dropped} network requests past the proxy's cap were refused "
                         "without a ledger row each")
    if job.egress.callback_errors:
        job.risks.append(f"network requests were refused because their ledger row failed: "
                         f"{job.egress.callback_errors[0]}")


def _probe_version(job: _Job, confiner: confine.Confiner, wt: worktree.Worktree, env: dict[str, str]) -> str | None:
    """`CLI --version`, confined like the agent (network off, nothing writable but a scratch dir), in the
    job's cgroup and under the stop switch: it runs code a previous job may have written."""
    exe = executable(job.spec, env)
    if exe is not None and job.state_dirs and inside(exe, job.state_dirs):
        job.risks.append(f"the agent's executable {exe} is inside its writable state dirs: a job can rewrite "
                         "what the next job runs")
    scratch = job.agent_tmp / "version-probe"
    roots = confine.job_roots(scratch, scratch, readonly=_main_repo(wt), network=False)
    env = _without_credentials(job, env)  # it runs the CLI's code, which needs no login to say its version

    def probe(argv: list[str]) -> tuple[int | None, bytes, bytes]:
        req = roots if isinstance(roots, confine.Unavailable) else _hide_home(job, roots, argv[:1])
        if isinstance(req, confine.Unavailable):
            return None, b"", b""
        plan = confiner.wrap(argv, req)
        if isinstance(plan, confine.Unavailable):
            return None, b"", b""
        ex = job.runner.run(Spawn(argv=plan.argv, cwd=scratch, env={**env, **plan.env}, deadline_s=VERSION_TIMEOUT_S,
                                  name=f"version-{job.job_id}", poll=_poll(job), tail_bytes=64_000))
        return ex.exit_code, ex.stdout, ex.stderr

    return agent_version(job.spec, env, probe, job.state_dirs)


def _main_repo(wt: worktree.Worktree) -> tuple[Path, ...]:
    # Visible (its objects are borrowed) and never writable, even where it sits under a private /tmp.
    return (wt.repo.path, wt.repo.common_dir)


def _confined_validation(job: _Job, plan: validate.Plan, checkout: Path, readonly: tuple[Path, ...],
                         tmpdir: Path, ro_binds: tuple[tuple[Path, Path], ...] = ()) -> validate.Plan | None:
    """Validation runs code the agent may have written (a conftest.py, a build script): it gets the agent's
    confinement in a checkout of its own, minus the network and the CLI's state dirs, with the review
    checkout read-only; its setup steps too (a setup script the agent rewrote sent `.env` to a listener
    through the registry proxy, found in review). `ro_binds` are the job environment's read-only shares
    (proctor.mechanisms.validation.environment) and the evidence plugin's dir. None (and a risk) when it cannot be had."""
    roots = confine.job_roots(checkout, tmpdir, readonly=readonly, network=False)
    if not isinstance(roots, confine.Unavailable) and ro_binds:
        roots = dataclasses.replace(roots, ro_binds=ro_binds)
    if not isinstance(roots, confine.Unavailable):
        # The user's home is hidden from the code under test as from the agent: it is the agent's code.
        roots = _hide_home(job, roots, [s.argv[0] for s in plan.steps if s.argv])
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
        steps.append(validate.Step(step.label, tuple(wrapped.argv), step.source or step.argv))
    return validate.Plan(tuple(steps))


def _holdout(job: _Job, wt: worktree.Worktree) -> list[str]:
    return [*job.config.holdout_for(wt.repo.path), *(job.request.holdout or [])]


def _hide_holdout(job: _Job, wt: worktree.Worktree,
                  roots: confine.ConfineRequest | confine.Unavailable) -> confine.ConfineRequest | confine.Unavailable:
    """The held-out tests are not even readable before validation: an agent cannot tune to what it cannot
    read (README "What the verdict rests on")."""
    dirs = tuple(Path(d).resolve() for d in _holdout(job, wt) if Path(d).is_dir())
    if isinstance(roots, confine.Unavailable) or not dirs:
        return roots
    return dataclasses.replace(roots, hidden=(*roots.hidden, *dirs))


def _registry_proxy(job: _Job, cfg: RepoSettings, sock: str, what: str) -> EgressProxy | None | str:
    """A proxy to the repo's `registries` for its setup steps; None without registries or confinement (no
    network to restrict), a str when it could not start (why)."""
    if not cfg.registries or job.confiner is None or job.confiner.name == "none":
        return None
    try:
        return EgressProxy(cfg.registries, job.host_tmp / sock, on_decision=_egress_row(job)).start()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"{what} not run: its registry proxy did not start: {exc}"


def _poll(job: _Job) -> Callable[[], str | None]:
    """The stop switch and the caller's cancel, checked by the runner's wait loop (every 0.1 s)."""
    stop, cancel = job.stop, job.cancel

    def poll() -> str | None:
        reason = stop.reason()
        if reason:
            return f"stopped: {reason}"
        if job.gate is not None and job.gate.held:
            return f"approval: {job.gate.held[0]['tool']} is held for a person"
        reason = cancel() if cancel is not None else None
        return f"cancelled: {reason}" if reason else None

    return poll


def _validate(job: _Job, wt: worktree.Worktree, landed: landing.Landing, plan: validate.Plan, env: dict[str, str],
              result: RunAgentResult, touched: list[str]) -> None:
    """Validate exactly the tree that would land, with the base's recipe: the work directory made the
    job's commit (ignored files the agent left are gone) with the base's version of every recipe file the
    agent changed (proctor.mechanisms.evidence.recipe) and the held-out tests laid in; with test-defining files
    touched, once more with the base's versions of those too, whose failure is a risk (the task may have
    been to change a test). Each test step is judged on its runner's evidence, not its exit code alone."""
    if not plan.steps and job.settings is not None and job.settings.validate:
        # The repo's configured `validate` counts where autodetection found nothing (issue 24: it was
        # "validation skipped"); read from config and the base's committed file, never the agent's copy.
        plan = validate.given(job.settings.validate)
    if not plan.steps:
        job.risks.append(plan.skipped_reason or "validation skipped")
        return
    cfg = job.settings
    commands = [c for c in (job.request.validate_command or (cfg.validate if cfg else None), *(cfg.setup if cfg else ()))
                if c]
    recipe_changed = recipe.recipe_changes(commands, landed.changed, recipe.runner_of(s.argv for s in plan.steps))
    if recipe_changed:
        job.risks.append(f"the agent changed the validation recipe ({_names(recipe_changed)}): validation ran the "
                         "base's version")
    holdout = _holdout(job, wt)
    bad = held.check_dirs(holdout)
    if bad:
        result.status, result.code = Status.failed, Code.VALIDATION_FAILED
        job.risks.append(f"validation not run: {bad[0]}")
        return
    job.progress.phase("validating")
    tree = _tree_with_base(job, landed, recipe_changed, "recipe")
    if isinstance(tree, worktree.Failure):
        return
    run = _validation_run(job, wt, landed, plan, env, "validate", tree, holdout, result)
    if run is None or _judge(job, run, result, ""):
        return
    if _base_tests_missing(job, wt, landed, plan, env, run, result, touched):
        return
    frozen_paths = sorted({*touched, *recipe_changed})
    if touched:
        job.progress.phase("validating with the base's test files")
        tree = _tree_with_base(job, landed, frozen_paths, "frozen")
        if isinstance(tree, worktree.Failure):
            return
        run = _validation_run(job, wt, landed, plan, env, "frozen", tree, holdout, None)
        if run is not None:
            _judge(job, run, result, " (with the base's test files)")


def _base_tests_missing(job: _Job, wt: worktree.Worktree, landed: landing.Landing, plan: validate.Plan,
                        env: dict[str, str], run: validate.Run, result: RunAgentResult, touched: list[str]) -> bool:
    """Every test the base defines ran (pytest): the base's tree collected once (`--collect-only`, cached by
    base commit and recipe), held against the node ids the job's run reported. A base test that is missing
    while the agent changed no test-defining file fails validation (True): the code under test made it go
    (a parametrize list emptied from the library); with test files changed it is a risk naming them."""
    if not any(a.counts and a.counts.get("source") == "pytest" for a in run.attempts):
        return False
    base = _base_tests(job, wt, landed, plan, env)
    if not base:
        return False
    ran = frozenset().union(*(a.ran_ids for a in run.attempts))
    # A held-out file laid over a visible one replaces its tests: those are the held-out file's to define.
    held_paths = {rel for d in _holdout(job, wt) for rel in held.held_files(Path(d))}
    missing = sorted(t for t in base - ran if t.split("::", 1)[0] not in held_paths)
    if not missing:
        return False
    what = f"{len(missing)} of the base's {len(base)} tests did not run: {_names(missing)}"
    if touched:
        job.risks.append(f"{what} (the agent changed files that define the tests)")
        return False
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: {what}, and the agent changed no file that defines the tests")
    return True


def _base_tests(job: _Job, wt: worktree.Worktree, landed: landing.Landing, plan: validate.Plan,
                env: dict[str, str]) -> frozenset[str] | None:
    cfg = job.settings
    key = hashlib.sha256(json.dumps([landed.base_sha, [s.argv for s in plan.steps],
                                     dataclasses.asdict(cfg) if cfg else None], default=str).encode()).hexdigest()
    cache = proctor_home() / "baselines" / f"{key}.json"
    try:
        return frozenset(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    job.progress.phase("collecting the base's tests")
    run = _validation_run(job, wt, landed, plan, env, "base", landed.base_sha, [], None, collect_only=True)
    ids = frozenset().union(*(a.item_ids for a in run.attempts)) if run is not None else frozenset()
    if ids:
        try:
            cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            cache.write_text(json.dumps(sorted(ids)))
        except OSError:
            pass  # uncached, the next job collects again
    return ids or None


def _tree_with_base(job: _Job, landed: landing.Landing, paths: list[str], what: str) -> str | None | worktree.Failure:
    """The job's tree with `paths` as the base has them; None when there are none (the job's own tree)."""
    if not paths:
        return None
    tree = frozen.frozen_tree(landed.git_dir, job.host_tmp / f"{what}.index", landed.commit, landed.base_sha, paths)
    if isinstance(tree, worktree.Failure):
        job.risks.append(f"validation not run: the tree with the base's {what} files was not built: {tree.reason}")
    return tree


def _judge(job: _Job, run: validate.Run, result: RunAgentResult, suffix: str) -> bool:
    """Record one validation run; True when it ended the job's chances (killed or failed)."""
    timeout = job.config.validate_timeout
    result.tests_attempted += [f"{a.line(timeout)}{suffix}" for a in run.attempts]
    result.validation += [{**a.record(), "label": f"{a.label}{suffix}"} for a in run.attempts]
    log = validation_log(job.job_id)
    result.validation_log = str(log) if log.exists() else None
    if run.killed_reason:
        result.status = Status.failed
        reason = run.killed_reason
        result.code = (Code.STOPPED if reason.startswith("stopped") else Code.RESOURCE_LIMIT
                       if reason.startswith("resource_limit") else Code.CANCELLED)
        job.risks.append(f"validation {run.killed_reason}")
        return True
    for a in run.attempts:
        job.risks.extend(f"{r}{suffix}" for r in a.risks)
    failed = [a for a in run.attempts if not a.passed]
    if not failed:
        return False
    first = failed[0]
    why = f" ({first.failure})" if first.failure else ""
    if first.exit_code == PYTEST_NO_TESTS and first.label.endswith("-m pytest"):
        # pytest's "no tests collected": nothing was checked, which is not the same as a failure.
        job.risks.append(f"validation ran no test: {first.line(timeout)}{suffix}")
        return False
    if suffix:
        job.risks.append(f"validation failed{suffix}: {first.line(timeout)}{why}")
        return True
    result.status, result.code = Status.failed, Code.VALIDATION_FAILED
    job.risks.append(f"validation failed: {first.line(timeout)}{why}")
    return True


def _validation_run(job: _Job, wt: worktree.Worktree, landed: landing.Landing, plan: validate.Plan,
                    env: dict[str, str], name: str, tree: str | None, holdout: list[str],
                    result: RunAgentResult | None, *, collect_only: bool = False) -> validate.Run | None:
    """One validation in the work directory, made `tree` first (when not the job's own, already there),
    with a throw-away `.git`; the job's git dir (at the review path) is read-only to it. The job's
    environment (proctor.mechanisms.validation.environment) mirrors the developer's: the repo's keys from config and the
    base's `.proctor.toml`, a private HOME and caches, the validated tree's code first on the import path,
    the main checkout's dependency dirs shared read-only; a probe in that environment says where the code
    under test resolves, and one outside the validated tree is a risk. The held-out tests are laid in
    last; `result` (the first run's) is told how many. Network: none, setup included. Setup that needs the
    registries ran before the agent, on the base's files (code the agent wrote never has a network)."""
    tmpdir = job.host_tmp / f"{name}-tmp"
    made = (landing.materialise(job.work, landed.git_dir, tree, landed.index, known=landed.known)
            if tree is not None else None) or landing.scratch_git_dir(job.work, landed, wt, landed.index)
    if made is not None:
        job.risks.append(f"validation not run: {made.reason}")
        return None
    try:
        strip_bytecode(job.work)
    except OSError as exc:
        job.risks.append(f"validation not run: the tree's bytecode could not be removed: {exc}")
        return None
    if holdout:
        laid = held.lay(job.work, holdout)
        if isinstance(laid, str):
            job.risks.append(f"validation failed: {laid}")
            return validate.Run([validate.Attempt("held-out tests", None, False, failure=laid)])
        if result is not None:
            result.holdout = laid.record()
    first = name == "validate"  # the frozen run has the same environment: its risks are said once
    cfg = job.settings
    bind = job.confiner is not None and "bwrap" in job.confiner.name
    jenv = environment.prepare(job.work, wt.repo.path, plan, cfg, tmp=tmpdir, env=env, bind=bind)
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
    plan = environment.plan_for(plan, cfg, given=bool(job.request.validate_command))
    readonly = (*_main_repo(wt), wt.path, *jenv.readonly)
    return _run_validation(job, plan, jenv, readonly, tmpdir, env, name, first, frozenset(landed.changed),
                           collect_only)


def _run_validation(job: _Job, plan: validate.Plan, jenv: environment.JobEnvironment, readonly: tuple[Path, ...],
                    tmpdir: Path, env: dict[str, str], name: str, first: bool,
                    changed: frozenset[str], collect_only: bool = False) -> validate.Run | None:
    # The evidence plugin sits in a host-owned dir the sandbox sees read-only at the same path; what it
    # reports goes to the run's private tmp (proctor.mechanisms.evidence.instrument says why env, not argv).
    run_env = {**env, **jenv.env}
    try:
        inst = instrument(job.host_tmp / f"{name}-evidence", tmpdir, run_env)
    except OSError as exc:
        job.risks.append(f"validation not run: its evidence reporter could not be laid out: {exc}")
        return None
    binds = (*jenv.ro_binds, (inst.plugin_dir, inst.plugin_dir))
    confined = _confined_validation(job, plan, job.work, readonly, tmpdir, binds)
    if confined is None:
        return None
    run_env = {**run_env, **inst.env, "TMPDIR": str(tmpdir)}
    if collect_only:
        run_env["PYTEST_ADDOPTS"] += " --collect-only"
    checks = validate.Evidence.of_change(inst, job.work, changed)
    if first:
        def run_probe(argv: list[str]) -> tuple[int | None, bytes]:
            wrapped = _confined_validation(job, validate.Plan((validate.Step("probe", tuple(argv)),)), job.work,
                                           readonly, tmpdir, jenv.ro_binds)
            if wrapped is None:
                return None, b""
            ex = job.runner.run(Spawn(argv=wrapped.steps[0].argv, cwd=job.work, env=run_env, deadline_s=60,
                                      name=f"probe-{job.job_id}", poll=_poll(job), tail_bytes=64_000))
            return ex.exit_code, ex.stdout

        probe_risks, found = environment.check(jenv, run_env, run_probe)
        job.risks.extend(probe_risks)
        job.ledger.append("job.probe", {"jobId": job.job_id, "found": found, "risks": probe_risks},
                          job_id=job.job_id)
    return validate.run(confined, job.runner, cwd=job.work, env=run_env, timeout_s=job.config.validate_timeout,
                        name=f"{name}-{job.job_id}", poll=_poll(job), log=validation_log(job.job_id),
                        watch=job.progress.watch(None), checks=checks)
