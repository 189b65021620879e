"""The agent phase: the CLI run confined under the job's deadline, retried once on a nonzero exit, and
what it reported (status, exit codes, usage, its claim) taken into the result — its claim as a claim. The
egress proxy stops and the state copy is settled the moment it exits. Never reads the agent's files."""

from __future__ import annotations

from proctor.contract import RunAgentResult
from proctor.services.job.admit import Admitted
from proctor.services.job.attempts import run_attempts
from proctor.services.job.boundary import settle_state
from proctor.services.job.context import Job
from proctor.services.job.network import stop_egress
from proctor.services.job.prepare import Prepared


def run(job: Job, admitted: Admitted, prepared: Prepared, result: RunAgentResult) -> None:
    req, limited = job.request, prepared.runner
    job.launched = None
    try:
        out = run_attempts(spec=job.spec, argv=prepared.confined.argv, stdin=admitted.invocation.stdin,
                           env=prepared.agent_env, cwd=prepared.wt.path, runner=limited, progress=job.progress,
                           poll=job.poll, timeout_s=req.timeout_sec, term_grace_s=job.config.term_grace,
                           name=f"job-{job.job_id}", confined=prepared.confined.confinement != "none",
                           watch=job.gate.watch() if job.gate is not None else None)
    finally:
        stop_egress(job)
        settle_state(job, result)
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
    result.confinement_details["cleanup"] = f"{prepared.confined.details.get('cleanup', 'none')}+{out.cleanup}"
    job.risks.extend(out.risks)
