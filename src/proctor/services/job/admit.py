"""Admission: everything a job is refused for before anything is made on disk — the request on this
machine (repo, base ref, the job's dirs), the argv (a too-large prompt, a missing program), the stop
switch, the confinement the policy asks for, the spend budgets, then the breaker — and, once the job is
over, its booking settled and the breaker told. Never launches anything."""

from __future__ import annotations

from dataclasses import dataclass

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms import confine
from proctor.mechanisms.adapters.spec import Invocation, Refused, build, pool_key
from proctor.mechanisms.git import worktree
from proctor.mechanisms.ledger.store import LedgerError
from proctor.mechanisms.policy.breaker import Breaker, evidence_for
from proctor.mechanisms.policy.governor import Booking
from proctor.mechanisms.policy.windows import iso
from proctor.services.job import continued, record
from proctor.services.job.attempts import missing_program
from proctor.services.job.boundary import agent_env
from proctor.services.job.context import Job
from proctor.services.job.record import refused
from proctor.services.job.gate import gate_dir


@dataclass(frozen=True)
class Admitted:
    """What admission fixed: where the job runs, how it is confined, the agent's argv and environment
    (its credentials still in it: boundary.confine_agent moves them to the agent alone), and what it holds
    (a booking, the breaker's pool)."""

    repo: worktree.Repo
    base: worktree.Base
    confiner: confine.Confiner
    invocation: Invocation
    env: dict[str, str]
    pool: str
    booking: Booking
    settings: worktree.Base  # the commit whose `.proctor.toml` the job's settings come from
    earlier: continued.Earlier | None = None  # a follow-up's: the job whose tree it starts from


def admit(job: Job, breaker: Breaker) -> Admitted | RunAgentResult:
    """The job admitted, or the refusal it gets (a `failed` result whose risks say why, nothing launched)."""
    req, spec = job.request, job.spec
    job.progress.phase("checking the request")
    repo = worktree.open_repo(req.repo)
    if isinstance(repo, worktree.Failure):
        return refused(req, [f"invalid request: {repo.reason}"], Code.INVALID_REQUEST, job.start)
    earlier = continued.resolve(job, repo) if req.continues else None
    if isinstance(earlier, str):
        return refused(req, [f"invalid request: {earlier}"], Code.INVALID_REQUEST, job.start)
    if earlier is not None and req.branch:
        return refused(req, ["invalid request: a follow-up starts from the job it continues, on that job's base: "
                             "give continues or branch, not both"], Code.INVALID_REQUEST, job.start)
    base = earlier.base if earlier is not None else _base(job, repo)
    if isinstance(base, worktree.Failure):
        return refused(req, [f"invalid request: {base.reason}"], Code.INVALID_REQUEST, job.start)
    # Whose `.proctor.toml` the job trusts: the base's for the person; for anyone else the default branch's,
    # fixed now and used for the job, its validation and its landing alike.
    settings = base if job.trusted else worktree.default_base(repo)
    if isinstance(settings, worktree.Failure):
        return refused(req, [f"invalid request: {settings.reason}"], Code.INVALID_REQUEST, job.start)
    # Every dir the job keeps state in is this user's and writable by nobody else, before anything is
    # written or launched: `{repo}-agents/`, the two TMPDIRs, and the job's record dir (issue 21).
    why = record.unsafe_dirs(job.job_id) or worktree.unsafe_dirs(repo, (job.agent_tmp, job.host_tmp))
    if why:
        return refused(req, [f"{why}; nothing was launched"], Code.UNSAFE_DIRECTORY, job.start)

    # The argv is built (and a too-large prompt refused) before anything is created on disk.
    wt_path = worktree.path_for(repo, job.job_id)
    prompt_file = job.agent_tmp / "prompt.md" if spec.prompt == "file" else None
    task = continued.prompt(req.task, earlier) if earlier is not None else req.task
    if prompt_file is not None:
        prompt_file.write_text(task, encoding="utf-8")
    env = agent_env(job, wt_path)
    inv = build(spec, task, wt_path, prompt_file, env, gate_dir=gate_dir(job) if spec.gate else None)
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
    return Admitted(repo, base, confiner, inv, env, pool, booking, settings, earlier)


def _base(job: Job, repo: worktree.Repo) -> worktree.Base | worktree.Failure:
    """The request's base: the branch it names (refs/heads/<name>, which a tag or a stash of that name never
    shadows), else, for the person only, any commit the name resolves to; no name: the default branch."""
    name = job.request.branch
    if not name:
        return worktree.default_base(repo)
    branch = worktree.resolve_branch(repo, name)
    if isinstance(branch, worktree.Failure) and job.trusted:
        return worktree.resolve_base(repo, name)
    return branch


def release(job: Job, admitted: Admitted, breaker: Breaker, result: RunAgentResult) -> None:
    """Whatever happened after admission, the breaker hears of it (a half-open trial is never left held).
    The booking first (settled with what the CLI reported, or released if nothing launched), and the
    breaker whatever that did: a ledger row refused on one side must not leave the other held."""
    try:
        result.budget = _settle(job, admitted.booking)
    finally:
        seen = evidence_for(result.status, result.code, job.backend.status if job.backend else None,
                            job.backend.source if job.backend else "")
        after = breaker.record(admitted.pool, seen.signal, job_id=job.job_id)
        result.breaker = {"pool": admitted.pool, "admitted": True, "signal": seen.signal.value,
                          "source": seen.source, "state": after.state.value}


def _book(job: Job) -> Booking | RunAgentResult:
    """Book the job's estimate against every budget covering its agent (and lane) before anything is made
    on disk. No room: `rate_limited`/BUDGET_DENIED with `retry_after`, when the window frees; a tally that
    cannot be reached: `failed`/BUDGET_UNAVAILABLE. Either is a `usage.denied` row; a booking, `usage.booked`."""
    req = job.request
    if job.governor is None:
        return Booking(job.job_id, req.agent, None, None)
    got = job.booked.take() if job.booked is not None else job.governor.book(req.agent, job.job_id)
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


def _settle(job: Job, booking: Booking) -> dict | None:
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
