"""Contract tests against a real nats-server (the bundled binary): refusals with controls, signed results,
never twice at once while heartbeats hold a long job's lease."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
from contextlib import asynccontextmanager

from proctor.contract import Code, RunAgentResult, Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import sender
from proctor.mechanisms.queue.envelope import EnvelopeError, canonical_json, envelope_digest, job_fields, seal
from proctor.mechanisms.queue.jetstream import JetStreamBackend, job_subject
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import trusted_home

PAYLOAD = {"agent": "fake", "task": "do it", "repo": "/tmp/r", "ticket": "T-1"}
_hosts = itertools.count()


class RecordingRunner:
    """The run_agent seam replaced: records what ran, for `seconds`, and says completed."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.started: list[str] = []
        self.live = 0
        self.max_live = 0

    async def run(self, job, payload, cancel):
        self.started.append(job.job_id)
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        try:
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline and cancel() is None:
                await asyncio.sleep(0.05)
        finally:
            self.live -= 1
        return RunAgentResult(status=Status.completed, summary="ran", agent="fake")


@asynccontextmanager
async def listening(url, home, host, runner, *, count=1, ack_wait=2.0):
    th_trust = load_trust(home)
    from proctor.mechanisms.queue import keys

    backends, tasks, stop = [], [], asyncio.Event()
    for _ in range(count):
        backend = await JetStreamBackend.connect(url)
        listener = Listener(Settings(host, {"default": 2}, ack_wait_s=ack_wait), backend,
                            th_trust, keys.load("host", home), JobStore(home / "queue.sqlite3"),
                            Ledger(home / "ledger.sqlite3"), {"noop": NoopRunner(), "run_agent": runner})
        backends.append(backend)
        tasks.append(asyncio.create_task(listener.serve(stop)))
    client = await JetStreamBackend.connect(url)
    try:
        yield client
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for b in [*backends, client]:
            await b.close()


def new_host() -> str:
    return f"host{next(_hosts)}-{int(time.time() * 1000) % 100000}"


def refusals(home, job_id):
    return [r.payload for r in Ledger(home / "ledger.sqlite3").rows(kind="queue.refused", job_id=job_id)]


def test_each_bad_job_is_refused_recorded_and_answered_and_each_control_runs(nats_url, proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    host = new_host()
    runner = RecordingRunner()

    def signed(signer, **over):
        f = job_fields(kind="run_agent", target=host, lane="default", payload=PAYLOAD, signer_kid=signer.kid,
                       ttl_s=600)
        f.update(over)
        return f, seal(f, signer)

    async def go():
        async with listening(nats_url, proctor_home, host, runner) as client:
            async def submit(fields, sealed, subject_host=host):
                await client.put_job(fields["jobId"], json.dumps({"target": subject_host, "lane": "default",
                                                                  "kind": fields["kind"]}).encode())
                await client.publish(subject_host, "default", fields["jobId"], sealed.to_wire())
                if fields["target"] != subject_host:
                    # Mistargeted: the sender's own envelope names another host, so no answer from this one
                    # is ever accepted as its result; read the refusal this host signed, bound to the envelope.
                    from proctor.mechanisms.queue.results import open_result

                    raw = await client.wait_result(f"{subject_host}.{fields['jobId']}", 10)
                    return open_result(raw, trust, host=subject_host, job_id=fields["jobId"],
                                       envelope=envelope_digest(sealed.body))
                return await sender.wait(client, trust, sealed, 10)

            out = {}
            out["control"] = await submit(*signed(th.sender))
            f, s = signed(th.sender)
            doc = json.loads(s.to_wire())
            body = json.loads(base64.b64decode(doc["body"]))
            body["payload"]["task"] = "rm -rf the other thing"
            doc["body"] = base64.b64encode(canonical_json(body)).decode()
            forged = type(s)(s.alg, base64.b64decode(doc["body"]), s.sig)
            out["forged"] = await submit(f, forged)
            out["untrusted"] = await submit(*signed(th.stranger))
            out["expired"] = await submit(*signed(th.sender, issuedAt=int(time.time()) - 7200,
                                                  expiresAt=int(time.time()) - 3600))
            out["mistargeted"] = await submit(*signed(th.sender, target="someone-else"))
            out["overprivileged"] = await submit(*signed(th.sender, payload={**PAYLOAD, "validateCommand": "id"}))
            out["privileged_control"] = await submit(*signed(th.admin, payload={**PAYLOAD, "validateCommand": "id"}))

            # Replay: the control's exact bytes again, as a new message (no Nats-Msg-Id, so no server dedupe).
            f, s = signed(th.sender)
            out["replay_control"] = await submit(f, s)
            await client.nc.jetstream().publish(job_subject(host, "default"), s.to_wire())
            replay_key = None
            for _ in range(200):
                keys_ = [k for k in await client.kv["proctor_results"].keys()
                         if k.startswith(f"{host}.{f['jobId']}.replay-")]
                if keys_:
                    replay_key = keys_[0]
                    break
                await asyncio.sleep(0.05)
            assert replay_key is not None, "the replay was never answered"
            from proctor.mechanisms.queue.results import open_result

            out["replayed"] = open_result(await client.get_result(replay_key), trust, host=host, job_id=f["jobId"],
                                          envelope=envelope_digest(s.body))
            out["after_replay"] = await sender.wait(client, trust, s, 1)
            # The same bytes re-sent with the same Nats-Msg-Id are dropped by the server's dedupe window.
            await client.publish(host, "default", f["jobId"], s.to_wire())
            await asyncio.sleep(0.5)
            return out, f["jobId"]

    out, replay_id = asyncio.run(go())
    for name in ("control", "privileged_control", "replay_control", "after_replay"):
        assert not isinstance(out[name], EnvelopeError), (name, out[name])
        assert out[name].result.status is Status.completed and out[name].refusal is None, name
    expected = {"forged": "FORGED", "untrusted": "UNTRUSTED_SIGNER", "expired": "EXPIRED",
                "mistargeted": "MISTARGETED", "overprivileged": "OVER_PRIVILEGED", "replayed": "REPLAYED"}
    for name, code in expected.items():
        res = out[name]
        assert not isinstance(res, EnvelopeError), (name, res)
        assert res.refusal == code, (name, res.refusal)
        assert res.result.status is Status.failed and code in res.result.summary, name
        assert refusals(proctor_home, res.job_id)[0]["code"] == code, name
    assert len(runner.started) == 3  # the three controls, nothing refused ran
    assert len(refusals(proctor_home, replay_id)) == 1  # the deduped re-send never reached the listener


def test_results_are_signed_by_the_host_and_a_tampered_one_is_rejected(nats_url, proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    host = new_host()

    async def go():
        async with listening(nats_url, proctor_home, host, RecordingRunner()) as client:
            (sealed,) = sender.build(targets=[host], kind="noop", lane="default", payload={}, signer=th.sender)
            job = await sender.publish(client, sealed)
            good = await sender.wait(client, trust, job.job_id, 10)
            raw = json.loads(await client.get_result(f"{host}.{job.job_id}"))
            body = json.loads(base64.b64decode(raw["body"]))
            body["result"]["summary"] = "all good, trust me"
            raw["body"] = base64.b64encode(canonical_json(body)).decode()
            for key in (f"{host}.{job.job_id}", f"{host}.{job.job_id}.env-{job.digest[:32]}"):
                await client.put_result(key, json.dumps(raw).encode())
            bad = await sender.wait(client, trust, job.job_id, 1)
            status = await sender.status(client, trust, job.job_id)
            return good, bad, status

    good, bad, status = asyncio.run(go())
    assert good.result.status is Status.completed and good.signer == th.host.kid
    assert isinstance(bad, EnvelopeError) and bad.code == "FORGED"
    assert status["verified"] is False and "FORGED" in status["error"]


def test_a_long_job_with_two_listeners_runs_once(nats_url, proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    host = new_host()
    runner = RecordingRunner(seconds=5.0)  # 2.5x ack_wait: only heartbeats keep it from redelivery

    async def go():
        async with listening(nats_url, proctor_home, host, runner, count=2, ack_wait=2.0) as client:
            (sealed,) = sender.build(targets=[host], kind="run_agent", lane="default", payload=PAYLOAD,
                                     signer=th.sender)
            job = await sender.publish(client, sealed)
            return await sender.wait(client, trust, job.job_id, 20)

    res = asyncio.run(go())
    assert res.result.status is Status.completed and res.delivery == 1
    assert len(runner.started) == 1 and runner.max_live == 1


def test_cancel_before_start_answers_cancelled(nats_url, proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    host = new_host()
    runner = RecordingRunner()

    async def go():
        client = await JetStreamBackend.connect(nats_url)
        (sealed,) = sender.build(targets=[host], kind="run_agent", lane="default", payload=PAYLOAD, signer=th.sender)
        job = await sender.publish(client, sealed)
        assert await sender.cancel(client, job.job_id, "not needed", signer=th.sender)
        await client.close()
        async with listening(nats_url, proctor_home, host, runner) as client:
            return await sender.wait(client, trust, job.job_id, 10)

    res = asyncio.run(go())
    assert res.result.status is Status.failed and res.result.code is Code.CANCELLED and not runner.started
