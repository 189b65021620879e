"""A job's gate: the per-job gate service started for a CLI with a hook dialect (or the job recorded as
ungated), and what it decided folded into the result once the agent is done. The decisions themselves
are the gate service's (proctor.mechanisms.gatekeeper); this module never decides a call."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms import gatekeeper
from proctor.mechanisms.git import worktree
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.services.job.context import Job, names


def gate_dir(job: Job) -> Path:
    """The gate's socket, hook and CLI settings: host-owned, outside the worktree; the sandbox sees it at the
    same path through a read-only bind (a mount point the agent cannot replace)."""
    return job.host_tmp / "gate"


def start(job: Job, wt: worktree.Worktree, result: RunAgentResult) -> gatekeeper.GateService | None | str:
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
    service = gatekeeper.GateService(dialect, task, policy, job.ledger, job.job_id, gate_dir(job),
                                     stop=job.stop.reason, worktree=wt.path, ticket=job.request.ticket,
                                     repo=str(wt.repo.path))
    try:
        return service.start()
    except OSError as exc:
        return f"the job's gate service did not start: {exc}"


def finish(job: Job, result: RunAgentResult) -> None:
    """The gate stopped and its summary in the result: a held call or a bypass decides the status whatever
    the agent and validation said."""
    gate = job.gate
    if gate is None:
        return
    journal = getattr(gate.dialect, "journal", None)  # optional: calls a CLI records outside its stream
    if journal is not None:
        gate.account(*journal(job.home))
    gate.stop()
    summary = gate.summary
    result.gate = summary.as_dict(gate.dialect.name, gatekeeper.settings_path(gate.dir, gate.dialect.name))
    if gate.held:
        result.gate["pending"] = gate.held
        result.status, result.code = Status.approval_required, Code.APPROVAL_REQUIRED
        job.risks.append(f"a tool call is held for a person: {gate.held[0]['reason']}")
    if gate.bypassed:
        result.status, result.code = Status.failed, Code.BYPASS
        job.risks.append("tool calls the gate never decided (its hook did not run): " + names(gate.bypassed))
    if summary.refused:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(summary.by_code.items()) if c != "OK")
        job.risks.append(f"the gate refused {summary.refused} of the agent's {summary.decided} tool call(s): {codes}")
    if gate.failures:
        job.risks.append(f"gate decisions failed and were denied: {gate.failures[0]}")
    if gate.flood:
        job.risks.append(gate.flood)
    unlisted = gate.unlisted
    if unlisted:
        job.risks.append(f"{gate.dialect.name} has {len(unlisted)} tool(s) the gate's table does not list: "
                         f"{names(unlisted)}; each was decided as `shell` and online, whatever a "
                         "declaration said (a CLI newer than the table: see its tested versions)")
        result.gate["unlisted"] = unlisted
