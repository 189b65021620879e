"""The run_agent service: one job, from a validated request to the host's own verdict, as its phases.

    record    the job's start and end rows in the ledger, whatever happens between   (record.py)
    admit     refusals, the spend budgets, the breaker                             (admit.py)
    prepare   worktree, validation plan, gate, confinement, environment, setup     (prepare.py)
    agent     the CLI's attempts under the deadline                                (agent.py)
    land      the tree that would land, hashed by the host, and its diff's risks   (land.py)
    validate  the host's own run of the base's checks, on per-test evidence        (validate.py)
    judge     the verdict: `needs_human_review` false only when all was checked    (judge.py)

It never trusts the agent's word: `claimed_status` is recorded and decides nothing; `changed_files` and
`tests_attempted` are what the host itself observed.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from proctor.contract import Code, Requester, RunAgentRequest, RunAgentResult, Status
from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.ledger.store import Ledger, LedgerFull
from proctor.mechanisms.policy.breaker import Breaker
from proctor.mechanisms.policy.governor import Prebooked, Spend, UsageGovernor
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.tally import SqliteTally
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.mechanisms.process.local import LocalRunner, ProcessRunner
from proctor.services.job import admit, agent, gate, judge, land, prepare, record, validate
from proctor.services.job.context import Job
from proctor.services.job.network import never_reached, refused_egress
from proctor.services.job.progress import Progress
from proctor.services.job.record import refused


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
    requester: Requester | None = None,
    booked: Prebooked | None = None,
) -> RunAgentResult:
    """Have `request.agent` do `request.task` in a new worktree of `request.repo`; never raises for a bad
    request or a misbehaving agent: every outcome is a result with a status and a code.

    The job is booked against the trusted policy's spend budgets (never a caller's) in `spend`'s tally;
    default: this home's SQLite tally with no lane (a queued job's runner passes the fleet's and its lane).

    `requester`: who asked, when not the person at this machine (a queue signer, an MCP client): such a job
    never picks the config proctor trusts (proctor.contract.Requester).

    `booked`: the job's booking made before it was asked (a race books all its runs before any launches):
    admission takes it, and from then on the job settles or releases it as its own; one a job never took
    (refused before admission) is the caller's to release (`Prebooked.taken` says which).

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
    job_id = job_id or record.new_job_id()
    try:
        def body(live: Progress) -> RunAgentResult:
            return _job(request, config, runner, live, cancel, job_id, ledger, stop, start, spend, requester,
                        booked)

        result = record.recorded(request, ledger, job_id, start, progress, body)
        result.job_id = job_id
        return result
    finally:
        if own_ledger:
            ledger.close()


def _job(request: RunAgentRequest, config: Config | None, runner: ProcessRunner | None, progress: Progress,
         cancel: Callable[[], str | None] | None, job_id: str, ledger: Ledger, stop: StopSwitch | None,
         start: float, spend: Spend | None, requester: Requester | None = None,
         booked: Prebooked | None = None) -> RunAgentResult:
    """The job's state made from this machine's config and trusted policy (refused when either is
    unusable), its phases run, and its private dirs and proxies gone whatever happened."""
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
    job = Job(request, config, runner or LocalRunner(limits=limits), progress, cancel, job_id, start, ledger,
              stop or StopSwitch(), spec, limits, Path(tempfile.mkdtemp(prefix=f"proctor-{job_id}-")),
              Path(tempfile.mkdtemp(prefix=f"proctor-host-{job_id}-")), governor=governor, requester=requester,
              booked=booked)
    try:
        return _phases(job, breaker)
    finally:
        governor.close()
        if job.egress is not None:
            job.egress.stop()
        shutil.rmtree(job.agent_tmp, ignore_errors=True)
        shutil.rmtree(job.host_tmp, ignore_errors=True)


def _phases(job: Job, breaker: Breaker) -> RunAgentResult:
    admitted = admit.admit(job, breaker)
    if isinstance(admitted, RunAgentResult):
        return admitted
    result = RunAgentResult(status=Status.failed, agent=job.request.agent, job_id=job.job_id,
                            base_ref=admitted.base.ref, mode=job.request.mode, code=Code.HOST_ERROR,
                            chain=list(admitted.earlier.chain) if admitted.earlier is not None else [])
    try:
        try:
            prepared = prepare.prepare(job, admitted, result)
            if prepared is not None:
                agent.run(job, admitted, prepared, result)
                _land_and_validate(job, prepared, result)
        finally:
            gate.finish(job, result)  # the gate's word (a held call, a bypass) is had after all the rest
    finally:
        admit.release(job, admitted, breaker, result)
    refused_egress(job)  # once, after every proxy of the job has stopped
    judge.verdict(job, result)
    result.warnings = list(job.warnings)
    job.progress.done(result)
    return result


def _land_and_validate(job: Job, prepared: prepare.Prepared, result: RunAgentResult) -> None:
    """The tree that would land, validated when the agent completed, and the review checkout made of it
    whatever happened (validation ran agent code in the work directory)."""
    job.progress.phase("building the job's tree")
    landed = land.land(job, prepared.wt, result)
    dirty = False
    try:
        if landed is not None:
            touched = land.diff_risks(job, landed)
            unreached = never_reached(job) if result.status is Status.completed else None
            if unreached is not None:  # nothing to validate: what changed is the CLI's own, not the model's work
                result.status, result.code = Status.failed, Code.AGENT_FAILED
                result.summary = f"{unreached} ({job.spec.name} said: {result.summary[:300]})"
                job.risks.append(unreached)
            if result.status is Status.completed:
                dirty = True  # until validate says nothing was put in the work directory
                dirty = validate.validate(job, prepared, landed, touched, result)
    finally:
        land.review_checkout(job, prepared.wt, landed, dirty)
