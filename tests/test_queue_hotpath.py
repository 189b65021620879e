"""The listener's hot path (issue 25): a fetched batch is verified and claimed in one store transaction on the
event loop, a store another process holds is waited for in a worker thread (never on the loop), the ledger's
end rows are group-committed, and the running record is written only for a job that is still running.

Every check is a count or an order, never a duration (a machine's load must not fail them)."""

from __future__ import annotations

import asyncio
import json
import sqlite3

from proctor.contract import RunAgentResult, Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import keys, sender
from proctor.services.listen.audit import BatchedAudit
from proctor.mechanisms.queue.backend import record_key
from proctor.mechanisms.queue.envelope import envelope_digest, job_fields, seal
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.results import open_result
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import TrustedHome, trusted_home


def on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class CountingStore(JobStore):
    """Notes each transaction the listener makes: (ops in it, whether it may wait, whether on the event loop)."""

    def __init__(self, *a, fail_job: str | None = None, **kw):
        self.batches: list[tuple[int, bool, bool]] = []
        self.fail_job = fail_job
        super().__init__(*a, **kw)

    def transact(self, ops, *, wait=True):
        self.batches.append((len(ops), wait, on_loop()))
        return super().transact(ops, wait=wait)

    def op_admit(self, job_id, **kw):
        if job_id == self.fail_job:
            raise sqlite3.OperationalError("disk I/O error (test)")
        return super().op_admit(job_id, **kw)


class CountingLedger(Ledger):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.updates: list[bool] = []  # one per ledger transaction: made on the event loop?

    def update(self, apply, **kw):
        self.updates.append(on_loop())
        return super().update(apply, **kw)


def home_keys(proctor_home) -> TrustedHome:
    if (proctor_home / "signers.toml").exists():
        return TrustedHome(proctor_home, *(keys.load(n, proctor_home) for n in ("default", "admin", "stranger", "host")))
    return trusted_home(proctor_home)


def make(proctor_home, *, slots=1, store=None, runner=None, backend=None, ack_wait=30.0):
    th = home_keys(proctor_home)
    ledger = CountingLedger(proctor_home / "ledger.sqlite3")
    audit = BatchedAudit(ledger, flush_every_s=3600.0)  # its timer never fires here: only commits write
    store = store or CountingStore(proctor_home / "queue.sqlite3")
    backend = backend or MemoryBackend()
    listener = Listener(Settings("hostA", {"default": slots}, ack_wait_s=ack_wait), backend, load_trust(proctor_home),
                        keys.load("host", proctor_home), store, audit, {"noop": runner or NoopRunner()})
    return th, ledger, store, backend, listener


def noop(th):
    (sealed,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
    return sealed


async def results_for(backend, th, home, sealed_list):
    trust = load_trust(home)
    return [await sender.wait(backend, trust, s, 10) for s in sealed_list]


def test_a_fetched_batch_is_claimed_in_one_transaction_on_the_loop(proctor_home):
    th, ledger, store, backend, listener = make(proctor_home, slots=5)

    async def go():
        jobs = [noop(th) for _ in range(5)]
        for s in jobs:
            await sender.publish(backend, s)  # all queued before the listener's first fetch
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        res = await results_for(backend, th, proctor_home, jobs)
        stop.set()
        await task
        return res

    res = asyncio.run(go())
    assert [r.result.status for r in res] == [Status.completed] * 5  # control: every job ran and was answered
    assert (5, False, True) in store.batches  # the five claims: one transaction, on the loop, never waiting
    assert all(not (wait and loop) for _, wait, loop in store.batches)
    assert ledger.updates and not any(ledger.updates)  # the ledger is written from worker threads only
    # Group commit: the five end rows (and the starts before them) took fewer ledger transactions than jobs.
    assert len(ledger.updates) < 5
    rows = ledger.rows()
    assert sorted(r.kind for r in rows) == ["queue.end"] * 5 + ["queue.start"] * 5


def test_a_replay_and_a_squatter_in_the_same_batch_are_refused_as_one_by_one(proctor_home):
    """Claims made together are made in stream order, each as it would be alone: the second copy of an
    envelope (same nonce, another message) is a replay, another envelope reusing a job id in the same batch
    is DUPLICATE_JOB_ID, and the real job runs once."""
    th, _, store, backend, listener = make(proctor_home, slots=4)

    async def go():
        real = noop(th)
        job_id = json.loads(real.body)["jobId"]
        squat = seal(job_fields(kind="noop", target="hostA", lane="default", payload={"x": 1},
                                signer_kid=th.sender.kid, ttl_s=600, job_id=job_id),
                     th.sender)
        await sender.publish(backend, real)
        await backend.publish_raw("hostA", "default", real.to_wire())  # a captured copy, replayed
        await backend.publish_raw("hostA", "default", squat.to_wire())
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        trust = load_trust(proctor_home)
        res = await sender.wait(backend, trust, real, 10)
        host = "hostA"
        while not any(".replay-" in k for k in backend.kv.get("results", {})) or \
                not any(".env-" in k for k in backend.kv.get("results", {})):
            await asyncio.sleep(0.01)
        stop.set()
        await task
        return res, job_id, squat, backend.kv["results"], host

    res, job_id, squat, results, host = asyncio.run(go())
    assert res.refusal is None and res.result.status is Status.completed  # the real job ran
    assert any(n == 3 and not wait for n, wait, _ in store.batches)  # all three claimed in one transaction
    trust = load_trust(proctor_home)
    (replay_key,) = [k for k in results if ".replay-" in k]
    assert open_result(results[replay_key], trust, host=host, job_id=job_id, envelope=None).refusal == "REPLAYED"
    (squat_key,) = [k for k in results if ".env-" in k]
    squat_res = open_result(results[squat_key], trust, host=host, job_id=job_id, envelope=envelope_digest(squat.body))
    assert squat_res.refusal == "DUPLICATE_JOB_ID"
    assert store.job(job_id)["state"] == "done"
    assert len(Ledger(proctor_home / "ledger.sqlite3").rows(kind="queue.start", job_id=job_id)) == 1


def test_one_claim_that_fails_leaves_only_its_job_for_redelivery(proctor_home):
    th = home_keys(proctor_home)
    jobs = [noop(th) for _ in range(3)]
    bad_id = json.loads(jobs[1].body)["jobId"]
    store = CountingStore(proctor_home / "queue.sqlite3", fail_job=bad_id)
    _, _, _, backend, listener = make(proctor_home, slots=3, store=store)

    async def go():
        for s in jobs:
            await sender.publish(backend, s)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        res = await results_for(backend, th, proctor_home, [jobs[0], jobs[2]])
        stop.set()
        await task
        return res

    res = asyncio.run(go())
    assert [r.result.status for r in res] == [Status.completed] * 2  # the batch's other jobs ran
    assert store.job(bad_id) is None  # nothing of the failed claim was kept: it is the broker's to redeliver
    assert record_key("hostA", bad_id) not in backend.kv.get("results", {})  # and it was not answered
    assert (3, False, True) in store.batches and (1, True, False) in store.batches  # retried alone, in a thread


def test_a_store_locked_by_another_process_is_waited_for_off_the_loop(proctor_home):
    th, _, store, backend, listener = make(proctor_home)
    other = sqlite3.connect(proctor_home / "queue.sqlite3", isolation_level=None, check_same_thread=False)

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        first = noop(th)
        await sender.publish(backend, first)
        control = await sender.wait(backend, load_trust(proctor_home), first, 10)
        other.execute("BEGIN IMMEDIATE")  # another listener's (or a job runner's) write transaction
        seen = len(store.batches)
        second = noop(th)
        await sender.publish(backend, second)
        while not any(wait and not loop for _, wait, loop in store.batches[seen:]):
            await asyncio.sleep(0.01)  # the claim now waits for the lock in a worker thread...
        ticks = 0
        while ticks < 20:  # ...while the loop goes on (were it blocked, nothing here would run)
            await asyncio.sleep(0.001)
            ticks += 1
        assert await backend.get_result(record_key("hostA", json.loads(second.body)["jobId"])) is None
        other.execute("COMMIT")
        res = await sender.wait(backend, load_trust(proctor_home), second, 10)
        stop.set()
        await task
        return control, res, seen

    control, res, seen = asyncio.run(go())
    assert control.result.status is Status.completed and res.result.status is Status.completed
    assert all(not (wait and loop) for _, wait, loop in store.batches)
    assert (1, False, True) in store.batches[seen:]  # tried on the loop first, found busy
    other.close()


class Slow:
    """Runs until its running record was written (or tried), so the record is due; no clock in the test."""

    def __init__(self, backend):
        self.backend = backend

    async def run(self, job, payload, cancel):
        while not self.backend.tried:
            await asyncio.sleep(0.01)
        return RunAgentResult(status=Status.completed, summary="slow")


class RecordingRunning(MemoryBackend):
    def __init__(self, fail=False):
        super().__init__()
        self.fail, self.tried = fail, []

    async def put_running(self, key, data):
        self.tried.append(key)
        if self.fail:
            raise ConnectionError("kv hiccup")
        await super().put_running(key, data)


def run_one(proctor_home, backend, runner=None):
    """One noop job through a listener on `backend`: its verified result and its record key."""
    th, _, _, _, listener = make(proctor_home, backend=backend, runner=runner)

    async def go():
        job = noop(th)
        await sender.publish(backend, job)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        res = await sender.wait(backend, load_trust(proctor_home), job, 10)
        stop.set()
        await task
        return res, record_key("hostA", json.loads(job.body)["jobId"])

    return asyncio.run(go())


def test_the_running_record_is_written_for_a_job_still_running_and_never_fails_it(proctor_home):
    backend = RecordingRunning()
    res, key = run_one(proctor_home, backend, Slow(backend))
    assert res.result.status is Status.completed and res.result.summary == "slow"
    assert backend.tried == [key] and json.loads(backend.kv["running"][key])["delivery"] == 1
    # A record that cannot be written is not a failed run: the run's result stands.
    backend = RecordingRunning(fail=True)
    res, key = run_one(proctor_home, backend, Slow(backend))
    assert res.result.status is Status.completed and res.result.summary == "slow" and res.delivery == 1
    assert backend.tried == [key] and "running" not in backend.kv
    # A job that ends before its record is due never writes one: its result shows it.
    backend = RecordingRunning()
    res, _ = run_one(proctor_home, backend)
    assert res.result.status is Status.completed and backend.tried == []


def test_a_commit_returns_only_once_its_rows_are_in_the_ledger_and_shares_one_write(proctor_home):
    ledger = CountingLedger(proctor_home / "ledger.sqlite3")
    audit = BatchedAudit(ledger, flush_every_s=3600.0)

    async def go():
        async def one(i):
            audit.append("queue.end", {"i": i}, job_id=f"j{i}")
            await audit.commit()
            return {r.payload["i"] for r in Ledger(proctor_home / "ledger.sqlite3").rows()}

        return await asyncio.gather(*(one(i) for i in range(6)))

    seen = asyncio.run(go())
    assert all(i in rows for i, rows in enumerate(seen))  # each saw its own row when its commit returned
    assert len(ledger.updates) < 6 and not any(ledger.updates)  # fewer writes than commits, none on the loop
    assert sorted(r.payload["i"] for r in Ledger(proctor_home / "ledger.sqlite3").rows()) == list(range(6))


def test_a_sent_record_is_created_in_one_write_and_replaced_whole(tmp_path):
    """A new job id's record is created with O_EXCL; one that exists (the same envelope sent again, or anything
    left at its path) is replaced through a temp file, never written through."""
    from proctor.mechanisms.queue.sent import SentJob, SentStore

    store = SentStore(tmp_path)
    store.put(SentJob("j1", "h", "default", "noop", "a" * 64, "k", 1.0))
    store.put(SentJob("j1", "h", "default", "noop", "b" * 64, "k", 1.0))
    folder = tmp_path / "queue-sent"
    assert store.get("j1").digest == "b" * 64 and (folder / "j1.json").stat().st_mode & 0o777 == 0o600
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (folder / "j2.json").symlink_to(victim)
    store.put(SentJob("j2", "h", "default", "noop", "c" * 64, "k", 1.0))
    assert victim.read_text() == "keep me" and not (folder / "j2.json").is_symlink()
    assert store.get("j2").digest == "c" * 64
    assert sorted(p.name for p in folder.iterdir()) == ["j1.json", "j2.json"]  # no temp file left
