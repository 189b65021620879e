"""The surface every tool call shares: the jobs this server runs, what its client was granted, who it is.

Owns each tool's service call (the host's `run_agent`, the review reads and verbs of proctor.services.review,
the policy half of proctor.mechanisms.policy.gate, as `proctor check-task|decide` do) and the ledger rows
naming the MCP client. A `taskDecl` is validated here and capped by the trusted policy's ceilings in the
job's gate, as a queue job's is. It never decides anything itself: the host, the gate and the review verbs
do; and it never speaks MCP (tools.py does).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import ValidationError

from proctor.contract import Code as JobCode
from proctor.contract import Requester, RunAgentRequest, request_errors
from proctor.mechanisms.config.load import ConfigError
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.ledger.summary import Summary
from proctor.mechanisms.policy.gate import Gate
from proctor.mechanisms.policy.plan import plan
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Policy, PolicyError
from proctor.services.review import gc as gc_mod
from proctor.services.review import jobs as jobs_mod
from proctor.services.review import land as land_mod
from proctor.services.review.diff import Diff, diff
from proctor.services.review.outcome import Code as ReviewCode
from proctor.services.review.outcome import Outcome
from proctor.surfaces.mcp.arguments import (
    CancelArgs,
    CheckTaskArgs,
    DecideArgs,
    DiffArgs,
    JobArgs,
    LandArgs,
    ListArgs,
    RaceArgs,
)
from proctor.surfaces.mcp.grants import Grants, over_privileged
from proctor.surfaces.mcp.jobs import Jobs, LiveJob
from proctor.surfaces.mcp.results import (
    INVALID_ARGUMENTS,
    JOB_ENDED,
    NOT_RUNNING_HERE,
    OVER_PRIVILEGED,
    POLICY_INVALID,
    TASK_INVALID,
    VERB_NOT_ALLOWED,
    Refusal,
)


log = logging.getLogger("proctor.mcp")

def _ledger() -> Ledger:
    try:
        return Ledger.default()
    except Exception as exc:
        raise Refusal(ReviewCode.LEDGER_FAILED.value, f"the ledger cannot be opened: {exc}") from exc


def _refused(out: Outcome) -> Refusal:
    return Refusal(out.code.value, out.reason, **out.details)


def _find(ledger: Ledger, ident: str, verb: str) -> jobs_mod.Job:
    found = jobs_mod.find(ledger, ident)
    if isinstance(found, Outcome):
        # As the CLI records a verb refused for an unknown job.
        jobs_mod.note(ledger, f"review.{verb}", {"ok": False, "job": ident, "code": found.code.value, "via": "mcp"})
        raise _refused(found)
    return found


class Surface:
    """What every tool call shares: the jobs this server runs, what its client was granted, who the client is."""

    def __init__(self, jobs: Jobs, grants: Grants | None = None) -> None:
        self.jobs = jobs
        self.grants = grants or Grants()
        self.client = "?"  # the client's own name and version (initialize's clientInfo), for the ledger rows
        # Reads are one row a client a minute (and per job for a diff), the rest counted: 1,000 list_jobs calls
        # wrote 1,000 rows (issue 41). `close` writes the counts still open.
        self.reads = Summary()
        self.closers: list[threading.Thread] = []  # a race's ranking, made once its jobs have ended

    def close(self) -> None:
        for closer in self.closers:  # the jobs were cancelled (Jobs.shutdown): their races end now
            closer.join(10)
        try:
            with Ledger.default() as ledger:
                self.reads.flush(ledger)
        except Exception:  # noqa: BLE001 - the server is ending; the counts are what is lost
            log.warning("the read counts of this MCP session could not be written", exc_info=True)

    def _verb_granted(self, ledger: Ledger, verb: str, job: str) -> None:
        """A review verb only when granted; refused or not, a row naming the client."""
        ok = verb in self.grants.verbs
        jobs_mod.note(ledger, f"mcp.{verb}", {"ok": ok, "job": job, "client": self.client,
                                              **({} if ok else {"code": VERB_NOT_ALLOWED})})
        if not ok:
            raise Refusal(VERB_NOT_ALLOWED, f"this MCP server does not offer {verb}: a person reviews and runs "
                          f"`proctor {verb}`, or starts `proctor mcp --allow-verb {verb}`")

    # run_agent ------------------------------------------------------------------------------------------

    def start(self, request: RunAgentRequest) -> dict[str, Any]:
        row = {"agent": request.agent, "ticket": request.ticket, "repo": request.repo, "mode": request.mode,
               "client": self.client}

        def admitted(job_id: str) -> None:
            # Written ahead, before the host's own job.start: which surface asked. No row, no job.
            try:
                ledger.append("mcp.run_agent", {"ok": True, "jobId": job_id, **row}, job_id=job_id)
            except Exception as exc:
                raise Refusal(ReviewCode.LEDGER_FAILED.value, f"the mcp.run_agent row could not be written ({exc}); "
                              "nothing was launched") from exc

        with _ledger() as ledger:
            try:
                config = self.jobs.config()
                self._capped(request, config)
                job = self.jobs.start(request, config, admitted,
                                      Requester(f"mcp:{self.client}", self.grants.may_set_validate_command))
            except ConfigError as exc:
                jobs_mod.note(ledger, "mcp.run_agent", {"ok": False, "code": JobCode.CONFIG_INVALID.value, **row})
                raise Refusal(JobCode.CONFIG_INVALID.value, str(exc)) from exc
            except Refusal as refusal:
                if refusal.code != ReviewCode.LEDGER_FAILED.value:
                    jobs_mod.note(ledger, "mcp.run_agent", {"ok": False, "code": refusal.code, **row})
                raise
        return {"jobId": job.job_id, "status": "running", "agent": request.agent, "ticket": request.ticket,
                "repo": request.repo, "next": "job_status or job_result (wait_s) with this jobId"}

    # race -------------------------------------------------------------------------------------------------

    def race(self, args: RaceArgs) -> dict[str, Any]:
        """Admit a race whole (every job room here and booked) and start its jobs; a thread of its own ranks
        them once all have ended (`race.end`). Each job is this server's, followed as any (job_result)."""
        from proctor.services.race import race as race_mod

        requests = []
        for agent in args.agents:
            try:
                requests.append(RunAgentRequest.model_validate({**args.job, "agent": agent}))
            except ValidationError as exc:
                raise Refusal(JobCode.INVALID_REQUEST.value, "invalid request: " + "; ".join(
                    r.removeprefix("invalid request: ") for r in request_errors(exc))) from exc
        try:
            config = self.jobs.config()
        except ConfigError as exc:
            raise Refusal(JobCode.CONFIG_INVALID.value, str(exc)) from exc
        for request in requests:
            self._capped(request, config)
        self.jobs.room(len(requests))
        requester = Requester(f"mcp:{self.client}", self.grants.may_set_validate_command)
        gov = race_mod.own_governor()  # closed by the race's closer: it outlives this call
        opened = race_mod.open_race(requests, parallel=len(requests), config=config, governor=gov)
        if not isinstance(opened, race_mod.Opened):
            if not isinstance(gov, PolicyError):
                gov.close()
            raise Refusal(opened.code.value, opened.summary, **({"budget": opened.budget} if opened.budget else {}))
        assert not isinstance(gov, PolicyError)  # open_race refused the race over it
        try:
            with _ledger() as ledger:  # which surface asked, written ahead, as run_agent's own row is
                for request, job_id in zip(opened.requests, opened.ids):
                    ledger.append("mcp.run_agent", {"ok": True, "jobId": job_id, "agent": request.agent,
                                                    "ticket": request.ticket, "repo": request.repo,
                                                    "client": self.client, "race": opened.race_id}, job_id=job_id)
            started = self.jobs.start_race(list(opened.requests), config, requester, opened.ids, opened.booked,
                                           opened.race_id)
        except BaseException:
            race_mod.release_untaken(opened, gov)  # nothing started: every booking goes back
            gov.close()
            raise

        def close() -> None:
            try:
                for job in started:
                    job.finished.wait()
                results = [j.result for j in started]
                if all(r is not None for r in results):  # every job's, in the order asked (_run always sets it)
                    # Someone else's race: its winner waits for the person (never landed on its own).
                    race_mod.close_race(opened, results, gov, land=False)  # type: ignore[arg-type]
                else:
                    race_mod.release_untaken(opened, gov)
            except Exception:  # noqa: BLE001 - the jobs stand on their own; the race's end row is what is lost
                log.exception("race %s could not be ranked", opened.race_id)
            finally:
                gov.close()

        closer = threading.Thread(target=close, name=f"close-{opened.race_id}", daemon=True)
        self.closers.append(closer)
        closer.start()
        return {"raceId": opened.race_id, "jobs": list(opened.ids), "agents": list(args.agents),
                "next": "race_result with this raceId (wait_s); each job with job_status or job_result"}

    def race_result(self, ident: str) -> dict[str, Any]:
        from proctor.services.race import races

        with _ledger() as ledger:
            found = races.find(ledger, ident)
        if isinstance(found, str):
            raise Refusal(ReviewCode.UNKNOWN_JOB.value, found)
        return {"done": found.ended, **found.to_dict()}

    def _capped(self, request: RunAgentRequest, config: Config) -> None:
        """The queue's caps on what a request may ask (`over_privileged`), and a taskDecl that is a task."""
        why = over_privileged(request, config.confine, self.grants)
        if why:
            raise Refusal(OVER_PRIVILEGED, why)
        if request.task_decl is not None:
            try:
                AgentTask.model_validate(request.task_decl)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise Refusal(TASK_INVALID, f"taskDecl.{'.'.join(map(str, err['loc']))}: {err['msg']}") from exc

    # job_status / job_result ------------------------------------------------------------------------------

    def status(self, ident: str) -> dict[str, Any]:
        live = self.jobs.get(ident)
        with _ledger() as ledger:
            found = jobs_mod.find(ledger, ident)
        if isinstance(found, Outcome):
            live = live or self.jobs.by_prefix(ident)
            if live is None:
                raise _refused(found)
            # Started a moment ago: the host has not written its job.start row yet.
            return {"jobId": live.job_id, "status": "running", "state": "open", "agent": live.request.agent,
                    "ticket": live.request.ticket, "repo": live.request.repo, "live": live.live()}
        live = live or self.jobs.get(found.job_id)
        return {**found.to_dict(), "live": live.live() if live else None}

    def result_now(self, ident: str) -> tuple[dict[str, Any], LiveJob | None]:
        """(answer, the live job when it is still running here); answer["done"] says whether it ended."""
        live = self.jobs.get(ident)
        if live is None:
            with _ledger() as ledger:
                found = jobs_mod.find(ledger, ident)
            if isinstance(found, Outcome):
                live = self.jobs.by_prefix(ident)
                if live is None:
                    raise _refused(found)
            else:
                live = self.jobs.get(found.job_id)
                if live is None:
                    return self._recorded(found), None
        if live.finished.is_set() and live.result is not None:
            result = live.result.model_dump(mode="json", by_alias=True)
            return {"done": True, "jobId": live.job_id, "status": result["status"], "code": result["code"],
                    "result": result}, None
        return {"done": False, "jobId": live.job_id, "status": "running", "live": live.live()}, live

    @staticmethod
    def _recorded(job: jobs_mod.Job) -> dict[str, Any]:
        if job.ended is None and job.status == "running":
            return {"done": False, "jobId": job.job_id, "status": "running", "live": None}
        if job.ended is None:
            raise Refusal(ReviewCode.NO_RESULT.value,
                          f"job {job.job_id} was interrupted: its host died before it ended")
        if job.record.result is None:
            raise Refusal(ReviewCode.NO_RESULT.value,
                          f"job {job.job_id} ended {job.status} but its host kept no result.json")
        return {"done": True, "jobId": job.job_id, "status": job.status, "code": job.code,
                "result": job.record.result}

    # review verbs -----------------------------------------------------------------------------------------

    def list_jobs(self, args: ListArgs) -> dict[str, Any]:
        with _ledger() as ledger:
            found = jobs_mod.select(jobs_mod.load_jobs(ledger), repo=args.repo, statuses=tuple(args.status))
            late = self.reads.note(ledger, "review.jobs", {"ok": True, "repo": args.repo, "statuses": args.status,
                                                           "count": len(found), "via": "mcp", "client": self.client},
                                   principal=self.client)
        out: dict[str, Any] = {"count": len(found), "jobs": [j.to_dict() for j in found]}
        for j in out["jobs"]:
            live = self.jobs.get(j["jobId"])
            j["live"] = live.live() if live else None
        return {**out, **({"ledger_warning": late} if late else {})}

    def diff(self, args: DiffArgs) -> dict[str, Any]:
        with _ledger() as ledger:
            found = _find(ledger, args.job, "diff")
            got = diff(found, binary=args.binary)
            ok = isinstance(got, Diff)
            self.reads.note(ledger, "review.diff", {"ok": ok, "jobId": found.job_id, "via": "mcp", "client": self.client,
                                                    **({"code": got.code.value} if not ok else {})},
                            principal=self.client, subject=found.job_id, job_id=found.job_id)
        if isinstance(got, Outcome):
            raise _refused(got)
        out: dict[str, Any] = {"ok": True, "jobId": found.job_id, "base": got.base, "commit": got.commit,
                               "files": got.files, "stat": got.stat}
        if not args.stat_only:
            patch = got.patch[: args.max_bytes]
            out.update(patch=patch.decode("utf-8", "replace"), truncated=len(got.patch) > args.max_bytes,
                       patch_bytes=len(got.patch))
        return out

    def land(self, args: LandArgs) -> dict[str, Any]:
        if args.reason and not args.force:
            raise Refusal(INVALID_ARGUMENTS, "reason goes with force: give force true, or no reason")
        with _ledger() as ledger:
            self._verb_granted(ledger, "land", args.job)
            found = _find(ledger, args.job, "land")
            out = land_mod.land(ledger, found, into=args.into, mode=args.mode, force=args.force, reason=args.reason,
                                via="mcp")
        if not out.ok:
            raise _refused(out)
        return out.to_dict()

    def cancel(self, args: CancelArgs) -> dict[str, Any]:
        """Cancel a job this server runs: the host kills its whole tree and ends it CANCELLED, its end row
        written, as for `proctor run-agent` on Ctrl-C. A job of another process is not this server's to stop."""
        live = self.jobs.get(args.job) or self.jobs.by_prefix(args.job)
        if live is None:
            raise Refusal(NOT_RUNNING_HERE, f"no job {args.job!r} runs in this server (a queued job is cancelled "
                          "with `proctor cancel`; one of another process with its own Ctrl-C)")
        if live.finished.is_set():
            raise Refusal(JOB_ENDED, f"job {live.job_id} has already ended: nothing to cancel")
        with _ledger() as ledger:
            jobs_mod.note(ledger, "mcp.cancel", {"jobId": live.job_id, "reason": args.reason, "client": self.client},
                          live.job_id)
        live.cancelled = live.cancelled or args.reason
        return {"jobId": live.job_id, "cancelled": True, "reason": live.cancelled,
                "next": "job_result (wait_s) for its CANCELLED result"}

    def discard(self, args: JobArgs) -> dict[str, Any]:
        with _ledger() as ledger:
            self._verb_granted(ledger, "discard", args.job)
            found = _find(ledger, args.job, "discard")
            out = gc_mod.discard(ledger, found, via="mcp")
        if not out.ok:
            raise _refused(out)
        return out.to_dict()

    # policy -----------------------------------------------------------------------------------------------

    @staticmethod
    def _policy() -> Policy:
        try:
            return Policy.load()
        except PolicyError as exc:
            raise Refusal(POLICY_INVALID, str(exc)) from exc

    def check_task(self, args: CheckTaskArgs) -> dict[str, Any]:
        return plan(args.task, self._policy()).model_dump(mode="json")

    def decide(self, args: DecideArgs) -> dict[str, Any]:
        gate = Gate(args.task, policy=self._policy(), dry_run=not args.live, stop=StopSwitch().reason)
        return gate.decide(args.call).to_dict()
