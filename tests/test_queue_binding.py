"""A result answers exactly one envelope (issue 10, items 1 and 2), on a real nats-server with `proctor listen`
subprocesses and the real run_agent (a probe agent): a noop squatting on a queued run_agent job's id is refused
(or displaced, when it got there first) and the real job runs; a job record re-targeted to another host
changes nothing the sender accepts; a cancel flag that is not a signed request from the job's signer is
ignored. Each beside a control where the same path works for a legitimate caller."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from nats.js.errors import NoKeysError

from proctor.contract import Code, Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import keys, sender
from proctor.mechanisms.queue.backend import message_id
from proctor.mechanisms.queue.envelope import EnvelopeError, envelope_digest, job_fields, seal
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.mechanisms.queue.results import SignedResult
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import (
    PROCTOR_CLI,
    Listeners,
    read_probe,
    trusted_home,
    write_agent_config,
    write_probe_agent,
)


@pytest.fixture
def fleet(proctor_home, repo, tmp_path):
    th = trusted_home(proctor_home)
    probe = tmp_path / "probe.jsonl"
    cfg = write_agent_config(tmp_path / "agents.toml", write_probe_agent(tmp_path / "fake-agent", probe))
    listeners = Listeners(cfg)

    def listen(host: str, url: str, *, lanes: str = "default=1,other=1", home: Path | None = None) -> None:
        listeners.start(host, url, ack_wait_s=5, lanes=lanes, stderr=subprocess.DEVNULL,
                        env={**os.environ, "PROCTOR_HOME": str(home or proctor_home)})

    yield th, probe, repo, listen
    listeners.stop(10)


def run_agent_job(th, host, repo, task):
    payload = {"agent": "fake", "task": task, "repo": str(repo), "ticket": "T-9", "timeoutSec": 60}
    (sealed,) = sender.build(targets=[host], kind="run_agent", lane="default", payload=payload, signer=th.sender)
    return sealed


def squat(signer, host, lane, job_id):
    """What the attacker does: a job of a kind its key is trusted for, with someone else's job id."""
    return seal(job_fields(kind="noop", target=host, lane=lane, payload={}, signer_kid=signer.kid, ttl_s=600,
                           job_id=job_id), signer)


async def wait_until(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await pred() if asyncio.iscoroutinefunction(pred) else pred()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def probe_events(probe, event):
    return [e for e in read_probe(probe) if e["event"] == event]


def ledger_rows(home, kind, job_id):
    return [r.payload for r in Ledger(home / "ledger.sqlite3").rows(kind=kind, job_id=job_id)]


def test_a_squatting_noop_is_refused_and_the_real_job_runs(nats_url, fleet, proctor_home, tmp_path):
    th, probe, repo, listen = fleet
    host = f"sq-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    attacker = keys.load("fleet", proctor_home)  # trusted for noop only
    attacker_sent = SentStore(tmp_path / "attacker-home")
    listen(host, nats_url)

    async def go():
        b = await JetStreamBackend.connect(nats_url)
        trust = load_trust(proctor_home)
        try:
            real = await sender.publish(b, run_agent_job(th, host, repo, "sleep 2"))
            await wait_until(lambda: probe_events(probe, "start"), 60, "the real job to start")
            # The attacker reads the queued job's id from the server's job records...
            job_id = json.loads(await b.get_job(real.job_id))["jobId"]
            bad = squat(attacker, host, "other", job_id)
            await sender.publish(b, bad, sent=attacker_sent)  # (this rewrites the job record, too)
            # ...control: the same signer's own noop, with its own id, on the same lane, is answered normally.
            (own,) = sender.build(targets=[host], kind="noop", lane="other", payload={}, signer=attacker)
            await sender.publish(b, own, sent=attacker_sent)
            refused = await sender.wait(b, trust, bad, 30, sent=attacker_sent)
            control = await sender.wait(b, trust, own, 30, sent=attacker_sent)
            got = await sender.wait(b, trust, real.job_id, 60)  # by id: this home's record of what it sent
            late = squat(attacker, host, "other", job_id)  # and once more after the real job finished
            await sender.publish(b, late, sent=attacker_sent)
            late_refused = await sender.wait(b, trust, late, 30, sent=attacker_sent)
            after = await sender.wait(b, trust, real, 5)
            shown = await sender.status(b, trust, real.job_id)
            return real, bad, refused, control, got, late, late_refused, after, shown
        finally:
            await b.close()

    real, bad, refused, control, got, late, late_refused, after, shown = asyncio.run(go())
    # The squatter: a refusal the host signed, bound to the squatter's own envelope.
    assert isinstance(refused, SignedResult), refused
    assert refused.refusal == "DUPLICATE_JOB_ID" and refused.result.status is Status.failed
    assert refused.envelope == envelope_digest(bad.body)
    assert isinstance(late_refused, SignedResult) and late_refused.refusal == "DUPLICATE_JOB_ID"
    # The control: the same signer's legitimate noop.
    assert isinstance(control, SignedResult) and control.refusal is None
    assert control.result.status is Status.completed and control.result.agent == "noop"
    # The victim: the real result of the real run, never the noop's.
    for res in (got, after):
        assert isinstance(res, SignedResult), res
        assert res.refusal is None and res.result.status is Status.completed and res.result.agent == "fake"
        assert res.envelope == real.digest
    worktree = Path(got.result.worktree_path)
    assert (worktree / "agent-output.txt").read_text() == "done\n"
    assert [e["how"] for e in probe_events(probe, "end")] == ["completed"] and len(probe_events(probe, "start")) == 1
    # The audit: the squats refused (with their digests), one end row, for the real envelope.
    codes = {(r["code"], r["digest"]) for r in ledger_rows(proctor_home, "queue.refused", real.job_id)}
    assert codes == {("DUPLICATE_JOB_ID", envelope_digest(bad.body)), ("DUPLICATE_JOB_ID", envelope_digest(late.body))}
    ends = ledger_rows(proctor_home, "queue.end", real.job_id)
    assert len(ends) == 1 and ends[0]["digest"] == real.digest
    # `proctor job`: bound to what this home sent. The squatter came second, so its record never replaced
    # the real one (records are create-only; the displaced-squatter test shows a mismatch being reported).
    assert shown["state"] == "done" and shown["verified"] is True and shown["result"]["agent"] == "fake"
    assert shown["kind"] == "run_agent" and "recordMismatch" not in shown


def test_a_squatter_that_got_there_first_is_displaced_and_the_real_job_runs(nats_url, fleet, proctor_home,
                                                                               tmp_path):
    th, probe, repo, listen = fleet
    host = f"sf-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    attacker = keys.load("fleet", proctor_home)
    attacker_sent = SentStore(tmp_path / "attacker-home")
    listen(host, nats_url)

    async def go():
        b = await JetStreamBackend.connect(nats_url)
        trust = load_trust(proctor_home)
        try:
            blocker = await sender.publish(b, run_agent_job(th, host, repo, "sleep 3"))
            await wait_until(lambda: probe_events(probe, "start"), 60, "the blocking job to start")
            real = await sender.publish(b, run_agent_job(th, host, repo, "quick"))  # queued behind it
            bad = squat(attacker, host, "other", real.job_id)
            await sender.publish(b, bad, sent=attacker_sent)
            squatter = await sender.wait(b, trust, bad, 30, sent=attacker_sent)  # it ran first: a noop
            got = await sender.wait(b, trust, real, 60)
            squatter_after = await sender.wait(b, trust, bad, 5, sent=attacker_sent)
            first = await sender.wait(b, trust, blocker, 30)
            return real, bad, squatter, got, squatter_after, first
        finally:
            await b.close()

    real, bad, squatter, got, squatter_after, first = asyncio.run(go())
    assert isinstance(first, SignedResult) and first.result.status is Status.completed  # control
    # The squatter got there first and ran: a noop, answered as a noop, bound to its own envelope...
    for res in (squatter, squatter_after):
        assert isinstance(res, SignedResult) and res.result.agent == "noop" and res.envelope == envelope_digest(bad.body)
    # ...and the real job, earlier in the stream, displaced it and ran; its sender never took the noop.
    assert isinstance(got, SignedResult), got
    assert got.result.status is Status.completed and got.result.agent == "fake" and got.envelope == real.digest
    assert Path(got.result.worktree_path).is_dir()
    assert len(probe_events(probe, "start")) == 2  # the blocker and the real job
    displaced = ledger_rows(proctor_home, "queue.displaced", real.job_id)
    assert len(displaced) == 1 and displaced[0]["digest"] == envelope_digest(bad.body)
    assert displaced[0]["by"] == real.digest


def second_host_home(proctor_home: Path, tmp_path: Path) -> Path:
    """Host B in its own home: its own host key, the same job signers. The sender trusts B by [hosts.B]."""
    home_b = tmp_path / "home-b"
    (home_b / "keys").mkdir(parents=True)
    shutil.copy(proctor_home / "signers.toml", home_b / "signers.toml")
    shutil.copy(keys.key_path("fleet", proctor_home), keys.key_path("fleet", home_b))
    (home_b / "config.toml").write_text('confine = "off"\n')
    return home_b


def test_a_retargeted_record_changes_nothing_the_sender_accepts(nats_url, fleet, proctor_home, tmp_path):
    th, probe, repo, listen = fleet
    tag = f"{os.getpid()}-{int(time.time() * 1000) % 100000}"
    host_a, host_b = f"ra-{tag}", f"rb-{tag}"
    home_b = second_host_home(proctor_home, tmp_path)
    b_key = keys.generate(keys.HOST_KEY, home=home_b)
    with (proctor_home / "signers.toml").open("a") as fh:
        fh.write(f'\n[hosts.{host_b}]\npublic_key = "{b_key.public_key}"\n')
    attacker = keys.load("fleet", proctor_home)
    listen(host_b, nats_url, home=home_b)  # A is not listening yet: the job to A stays queued

    async def attack():
        b = await JetStreamBackend.connect(nats_url)
        trust = load_trust(proctor_home)
        try:
            # Control: a job really sent to B is accepted, checked with B's key.
            (to_b,) = sender.build(targets=[host_b], kind="noop", lane="default", payload={}, signer=th.sender)
            control = await sender.wait(b, trust, await sender.publish(b, to_b), 30)
            (to_a,) = sender.build(targets=[host_a], kind="noop", lane="default", payload={}, signer=th.sender)
            job = await sender.publish(b, to_a)
            # The attack: rewrite the record to say B, get B to sign a noop result for the same id, and copy
            # that result over A's key too.
            rec = json.loads(await b.get_job(job.job_id))
            # Raw KV, not put_job (which only creates): anyone on an unauthenticated server can do this.
            await b.kv["proctor_jobs"].put(job.job_id, json.dumps({**rec, "target": host_b}).encode())
            forged = squat(attacker, host_b, "default", job.job_id)
            await b.publish(host_b, "default", message_id(job.job_id, envelope_digest(forged.body)), forged.to_wire())
            b_result = await b.wait_result(f"{host_b}.{job.job_id}", 30)
            assert b_result is not None, "B never answered the noop"
            await b.put_result(f"{host_a}.{job.job_id}", b_result)
            during = await sender.wait(b, trust, job.job_id, 2)
            shown = await sender.status(b, trust, job.job_id)
            return control, job, during, shown
        finally:
            await b.close()

    control, job, during, shown = asyncio.run(attack())
    cli_job = subprocess.run([*PROCTOR_CLI, "job", job.job_id, "--queue", nats_url], capture_output=True, text=True,
                             timeout=60)
    listen(host_a, nats_url)

    async def after():
        b = await JetStreamBackend.connect(nats_url)
        try:
            return await sender.wait(b, load_trust(proctor_home), job.job_id, 30)
        finally:
            await b.close()

    got = asyncio.run(after())
    assert isinstance(control, SignedResult) and control.result.status is Status.completed
    assert control.signer == b_key.kid
    # B's signed noop result, found at B's key and copied to A's: neither is the answer to the job sent to A.
    assert not isinstance(during, SignedResult), during
    assert isinstance(during, EnvelopeError) and during.code in {"FORGED", "MISMATCHED"}
    assert shown["target"] == host_a and shown["state"] != "done" and shown["recordMismatch"] == {"target": host_b}
    assert cli_job.returncode == 0 and json.loads(cli_job.stdout)["target"] == host_a
    assert json.loads(cli_job.stdout).get("verified") is not True
    # Once A runs the job, its own answer, signed with A's key and bound to the envelope, is accepted.
    assert isinstance(got, SignedResult) and got.result.status is Status.completed and got.envelope == job.digest
    assert got.signer == th.host.kid


def test_only_a_signed_cancel_from_the_jobs_signer_stops_it(nats_url, fleet, proctor_home, tmp_path):
    th, probe, repo, listen = fleet
    host = f"cx-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    attacker = keys.load("fleet", proctor_home)
    listen(host, nats_url)

    async def go():
        b = await JetStreamBackend.connect(nats_url)
        trust = load_trust(proctor_home)
        try:
            job = await sender.publish(b, run_agent_job(th, host, repo, "sleep 4"))
            await wait_until(lambda: probe_events(probe, "start"), 60, "the job to start")
            key = f"{host}.{job.job_id}"
            await b.set_cancel(key, "unsigned: anyone on the server can write this")
            await asyncio.sleep(1.0)
            # Signed, but by another signer (trusted for noop, not allowed to cancel others' jobs).
            assert await sender.cancel(b, job.job_id, "not yours", signer=attacker)
            await asyncio.sleep(1.0)
            survived = not probe_events(probe, "end")
            res = await sender.wait(b, trust, job, 30)
            # Control: the job's own signer cancels its next job.
            job2 = await sender.publish(b, run_agent_job(th, host, repo, "sleep 30"))
            await wait_until(lambda: len(probe_events(probe, "start")) == 2, 60, "the second job to start")
            assert await sender.cancel(b, job2.job_id, "changed my mind", signer=th.sender)
            res2 = await sender.wait(b, trust, job2, 30)
            return survived, res, res2
        finally:
            await b.close()

    survived, res, res2 = asyncio.run(go())
    assert survived and res.result.status is Status.completed
    assert res2.result.status is Status.failed and res2.result.code is Code.CANCELLED


def test_a_copy_of_a_queued_job_on_another_lane_does_not_answer_it(nats_url, fleet, proctor_home):
    """The next one of the kind: a field of the message (the lane it came on), not of the envelope, must not
    become the job's outcome. A copy of the queued job's exact bytes on another lane is refused as MISROUTED
    at a key of its own; the real message, still queued, runs."""
    th, probe, repo, listen = fleet
    host = f"mr-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    listen(host, nats_url)

    async def go():
        b = await JetStreamBackend.connect(nats_url)
        trust = load_trust(proctor_home)
        try:
            blocker = await sender.publish(b, run_agent_job(th, host, repo, "sleep 3"))
            await wait_until(lambda: probe_events(probe, "start"), 60, "the blocking job to start")
            sealed = run_agent_job(th, host, repo, "quick")
            real = await sender.publish(b, sealed)  # queued behind the blocker
            await b.publish(host, "other", "copy-" + real.job_id, sealed.to_wire())  # the same bytes, elsewhere

            async def misrouted():
                try:
                    keys = await b.kv["proctor_results"].keys()
                except NoKeysError:  # nats-py raises for an empty bucket: nothing written yet
                    return []
                return [k for k in keys if k.startswith(f"{host}.{real.job_id}.misrouted-")]

            (key,) = await wait_until(misrouted, 30, "the copy's refusal")
            from proctor.mechanisms.queue.results import open_result

            copy = open_result(await b.get_result(key), trust, host=host, job_id=real.job_id, envelope=real.digest)
            got = await sender.wait(b, trust, real, 60)
            first = await sender.wait(b, trust, blocker, 30)
            return copy, got, first
        finally:
            await b.close()

    copy, got, first = asyncio.run(go())
    assert isinstance(first, SignedResult) and first.result.status is Status.completed  # control
    assert isinstance(copy, SignedResult) and copy.refusal == "MISROUTED"
    assert isinstance(got, SignedResult) and got.refusal is None and got.result.status is Status.completed
    assert got.result.agent == "fake" and len(probe_events(probe, "start")) == 2
