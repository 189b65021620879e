"""The sender's own record of what it sent (`queue-sent/`) is what results are bound to, never the server's
job record: unit tests on the in-memory backend."""

from __future__ import annotations

import asyncio
import json
import os
import time

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import sender
from proctor.mechanisms.queue import sent as sent_mod
from proctor.mechanisms.queue.envelope import EnvelopeError
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.sent import KEEP_S, SentJob, SentStore
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import trusted_home


def listener_for(home, backend, th):
    return Listener(Settings("hostA", {"default": 1}, ack_wait_s=5.0), backend, load_trust(home), th.host,
                    JobStore(home / "queue.sqlite3"), Ledger(home / "ledger.sqlite3"), {"noop": NoopRunner()})


def test_a_job_known_only_from_the_servers_record_is_never_verified(proctor_home, tmp_path):
    th = trusted_home(proctor_home)
    elsewhere = SentStore(tmp_path / "other-home")

    async def go():
        backend = MemoryBackend()
        listener = listener_for(proctor_home, backend, th)
        trust = load_trust(proctor_home)
        (mine,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        (theirs,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        a = await sender.publish(backend, mine)
        b = await sender.publish(backend, theirs, sent=elsewhere)  # sent from another home
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        ok = await sender.wait(backend, trust, a.job_id, 5)  # control: by id, from this home's record
        unknown = await sender.wait(backend, trust, b.job_id, 1)
        answered = await sender.wait(backend, trust, b, 5)  # the envelope in hand binds it
        shown = await sender.status(backend, trust, b.job_id)
        stop.set()
        await task
        return ok, unknown, answered, shown

    ok, unknown, answered, shown = asyncio.run(go())
    assert ok.result.status.value == "completed" and ok.refusal is None
    assert isinstance(unknown, EnvelopeError) and unknown.code == "UNKNOWN_JOB"
    assert answered.result.status.value == "completed"
    assert shown["verified"] is False and "UNBOUND" in shown["error"] and "result" not in shown


def test_sent_records_are_private_and_pruned_by_age(tmp_path):
    store = SentStore(tmp_path)
    store.put(SentJob("old1", "h", "default", "noop", "d" * 64, "k", time.time()))
    path = tmp_path / "queue-sent" / "old1.json"
    assert (path.stat().st_mode & 0o777) == 0o600 and json.loads(path.read_text())["digest"] == "d" * 64
    os.utime(path, (time.time() - KEEP_S - 60,) * 2)
    sent_mod._last_prune.clear()  # as a new process finds it: its first write sweeps
    fresh = SentStore(tmp_path)
    fresh.put(SentJob("new1", "h", "default", "noop", "e" * 64, "k", time.time()))
    assert fresh.get("old1") is None and fresh.get("new1") is not None  # control: the fresh one stays
    # Within the hour no write sweeps again (a sweep stats every record: it was run on every publish).
    fresh.put(SentJob("old2", "h", "default", "noop", "f" * 64, "k", time.time()))
    os.utime(tmp_path / "queue-sent" / "old2.json", (time.time() - KEEP_S - 60,) * 2)
    SentStore(tmp_path).put(SentJob("new2", "h", "default", "noop", "a" * 64, "k", time.time()))
    assert SentStore(tmp_path).get("old2") is not None
    assert fresh.get("../new1") is None


def test_the_sent_store_keeps_at_most_its_count_the_newest(tmp_path, monkeypatch):
    """issue 41: every envelope sent left a record for 14 days, whatever their number. Past KEEP_MOST the
    oldest go first; the newest stay (control)."""
    monkeypatch.setattr(sent_mod, "KEEP_MOST", 3)
    store = SentStore(tmp_path)
    for i in range(5):
        store.put(SentJob(f"job{i}", "h", "default", "noop", "d" * 64, "k", time.time()))
        os.utime(tmp_path / "queue-sent" / f"job{i}.json", (time.time() - 100 + i,) * 2)
    assert store.prune(time.time()) == 2
    assert [store.get(f"job{i}") is not None for i in range(5)] == [False, False, True, True, True]
