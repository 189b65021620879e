"""A race over the queue: one task to several agents, each a signed `run_agent` job for a host of the fleet.

Owns fanning the race's jobs out over the target hosts of a lane (round robin, so two hosts run a four-job
race two and two) and ranking the signed results that come back. Each job is an ordinary `run_agent`
envelope: the frozen contract, the listeners and what they check are unchanged, and each host books, confines,
validates and keeps its job reviewable as it does any. A result is taken only when it verifies and answers
this sender's own envelope (sender.wait); a job with no such answer in time ranks as not finished. The diff
sizes a local race weighs are not read here (the jobs' objects are on their hosts): ties go to the other keys.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from proctor.contract import Code, RaceResult, RunAgentRequest, RunAgentResult, Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import sender
from proctor.mechanisms.queue.backend import QueueBackend
from proctor.mechanisms.queue.envelope import Sealed
from proctor.mechanisms.queue.results import SignedResult
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import TrustStore
from proctor.services.job.record import new_job_id
from proctor.services.race.race import race_errors, ranked, started
from proctor.services.race.rank import rank


def envelopes(requests: Sequence[RunAgentRequest], targets: Sequence[str], lane: str, signer: object,
              ttl_s: float) -> tuple[list[Sealed], list[str]]:
    """One signed run_agent envelope a request, its target the next host in turn; and what was wrong."""
    out: list[Sealed] = []
    for i, request in enumerate(requests):
        payload = request.model_dump(mode="json", by_alias=True, exclude_none=True)
        built = sender.build(targets=[targets[i % len(targets)]], kind="run_agent", lane=lane, payload=payload,
                             signer=signer, ttl_s=ttl_s)  # type: ignore[arg-type]
        if isinstance(built, sender.Rejected):
            return [], built.errors
        out.extend(built)
    return out, []


async def race_over_queue(backend: QueueBackend, trust: TrustStore, requests: Sequence[RunAgentRequest], *,
                          targets: Sequence[str], lane: str, signer: object, ttl_s: float, wait_s: float,
                          sent: SentStore | None = None) -> RaceResult:
    start = time.monotonic()
    race_id = f"race-{new_job_id()}"
    errors = race_errors(requests, 1) + ([] if targets else ["a race over the queue needs at least one target"])
    sealed, wrong = envelopes(requests, targets, lane, signer, ttl_s) if not errors else ([], [])
    errors += wrong
    if errors:
        return RaceResult(raceId=race_id, status=Status.failed, code=Code.INVALID_REQUEST, summary="; ".join(errors),
                          durationSeconds=round(time.monotonic() - start, 3))
    bodies = [json.loads(s.body) for s in sealed]
    started(race_id, requests, [b["jobId"] for b in bodies], lane=lane, targets=[b["target"] for b in bodies])
    queued = [await sender.publish(backend, s, sent=sent) for s in sealed]
    answers = await asyncio.gather(*(sender.wait(backend, trust, q, wait_s, sent=sent) for q in queued))
    results = [_result(q.job_id, q.target, r, requests[i].agent, wait_s) for i, (q, r) in enumerate(zip(queued, answers))]
    hosts = {q.job_id: q.target for q in queued}
    out = ranked(race_id, results, rank(results), start, lambda s: {"host": hosts[s.job_id]})
    with Ledger.default() as ledger:
        ledger.append("race.end", {"raceId": race_id, "winner": out.winner, "ranking": out.ranking})
    return out


def _result(job_id: str, host: str, answer: object, agent: str, wait_s: float) -> RunAgentResult:
    """The host's signed result, or a failed one saying why there is none (never a result the sender made up
    as a success)."""
    if isinstance(answer, SignedResult):
        answer.result.job_id = job_id
        return answer.result
    why = (f"no verified result from {host} within {wait_s:.0f} s" if answer is None
           else f"the answer from {host} was not taken: {getattr(answer, 'code', '?')}: {getattr(answer, 'reason', '')}")
    return RunAgentResult(status=Status.failed, code=Code.HOST_ERROR, summary=why, known_risks=[why], agent=agent,
                          job_id=job_id)
