"""Whoever holds an answer can already read its ledger rows: the listener commits `queue.end`, `queue.refused`
and `queue.released` before it publishes the result (or hands the job back), even with a batched audit that
would otherwise flush later. Deterministic: the audit's own timer never runs here, so a row is in the ledger
at publish time only if the listener flushed it first (the CI flake: `queue.end` missing under load)."""

from __future__ import annotations

import asyncio
import json
import threading

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import keys, sender
from proctor.services.listen.audit import BatchedAudit
from proctor.mechanisms.queue.envelope import job_fields, seal
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import trusted_home


class Snapshotting(MemoryBackend):
    """Records, at each published answer and each nak, which ledger rows exist for the job."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.seen: list[tuple[str, set[str]]] = []

    def kinds_for(self, job_id: str) -> set[str]:
        return {r.kind for r in self.ledger.rows(job_id=job_id)}

    async def put_result(self, key, data, *, only_if_absent=False):
        job_id = key.split(".")[1]
        self.seen.append((key, self.kinds_for(job_id)))
        return await super().put_result(key, data, only_if_absent=only_if_absent)


def test_rows_are_in_the_ledger_before_the_answer_is_published(proctor_home):
    th = trusted_home(proctor_home)
    ledger = Ledger(proctor_home / "ledger.sqlite3")
    audit = BatchedAudit(ledger, flush_every_s=3600.0)  # its timer never fires in this test

    async def go():
        backend = Snapshotting(ledger)
        listener = Listener(Settings("hostA", {"default": 1}, ack_wait_s=30.0), backend, load_trust(proctor_home),
                            keys.load("host", proctor_home), JobStore(proctor_home / "queue.sqlite3"), audit,
                            {"noop": NoopRunner()})
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        (ok,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        done = await sender.publish(backend, ok)
        res = await sender.wait(backend, load_trust(proctor_home), done, 5)
        bad = seal(job_fields(kind="noop", target="elsewhere", lane="default", payload={}, signer_kid=th.sender.kid,
                              ttl_s=60), th.sender)
        await backend.publish_raw("hostA", "default", bad.to_wire())
        bad_id = json.loads(bad.body)["jobId"]
        while not any(bad_id in k for k, _ in backend.seen):
            await asyncio.sleep(0.01)
        stop.set()
        await task
        return res, done.job_id, bad_id, backend.seen

    res, ok_id, bad_id, seen = asyncio.run(go())
    assert res.refusal is None  # control: the job ran and was answered
    at_result = [kinds for key, kinds in seen if key == f"hostA.{ok_id}"]
    assert at_result and {"queue.start", "queue.end"} <= at_result[0], at_result
    at_refusal = [kinds for key, kinds in seen if bad_id in key]
    assert at_refusal and "queue.refused" in at_refusal[0], at_refusal


def test_a_flush_waits_for_rows_another_flush_is_writing(proctor_home):
    """Two flushes at once: the second must not return while the first still writes the second's rows."""
    ledger = Ledger(proctor_home / "ledger.sqlite3")
    audit = BatchedAudit(ledger, flush_every_s=3600.0)
    writing, release = threading.Event(), threading.Event()
    real_update = ledger.update

    def slow_update(apply):
        writing.set()
        release.wait(5)
        return real_update(apply)

    ledger.update = slow_update  # type: ignore[method-assign]
    audit.append("queue.start", {}, job_id="j1")
    audit.append("queue.end", {}, job_id="j2")
    first = threading.Thread(target=audit.flush)
    first.start()
    writing.wait(5)
    second_done = threading.Event()
    threading.Thread(target=lambda: (audit.flush(), second_done.set())).start()
    assert not second_done.wait(0.3)  # still waiting for the first flush's write
    release.set()
    first.join(5)
    assert second_done.wait(5)
    assert [r.kind for r in Ledger(proctor_home / "ledger.sqlite3").rows()] == ["queue.start", "queue.end"]
