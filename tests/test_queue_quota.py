"""A quota for the queue (issue 41): 150 envelopes of ~1 MB for a host that does not exist grew the stream
from 1 to 146 MB, kept for ever, with a sent record each. Now the HTTP API takes a job only for a lane some
listener opened, an envelope lives at most seven days, and the stream (a real NATS server) keeps no message
past that, holds at most its bytes and a lane's waiting jobs at most its count, refusing new ones past them.
Each beside its control."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from proctor.mechanisms.queue import jetstream, keys, sender
from proctor.mechanisms.queue.envelope import MAX_TTL_S, canonical_json
from proctor.mechanisms.queue.jetstream import STREAM, JetStreamBackend
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import trusted_home
from proctor.services.listen.checks import Accepted, Refusal, check_envelope
from proctor.surfaces.api.app import create_app

HOST = "quotahost"


def sealed(home: Path, host: str = HOST, ttl_s: float = 3600, **over):
    signer = keys.load("default", home)
    (one,) = sender.build(targets=[host], kind="noop", lane="default", payload={}, signer=signer, ttl_s=ttl_s)
    if over:
        body = {**json.loads(one.body), **over}
        one = type(one)(one.alg, canonical_json(body), signer.sign(b"proctor/job/v1\n" + canonical_json(body)))
    return one


def test_the_http_api_takes_no_job_for_a_lane_no_listener_opened(tmp_path):
    trusted_home(tmp_path)
    queue, store = MemoryBackend(), SentStore(tmp_path)

    async def factory():
        return queue

    with TestClient(create_app(factory, load_trust(tmp_path), store), base_url="http://127.0.0.1") as http:
        ghost = sealed(tmp_path, "ghost-host")
        refused = http.post("/v1/jobs", json=ghost.to_dict())
        asyncio.run(queue.ensure_lane(HOST, "default", slots=1, ack_wait_s=5))  # a listener of HOST starts
        taken = http.post("/v1/jobs", json=sealed(tmp_path).to_dict())
    assert refused.status_code == 404 and refused.json()["code"] == "UNKNOWN_TARGET", refused.text
    assert taken.status_code == 202, taken.text  # the control
    # Nothing of the ghost job was kept: no message, no sent record.
    assert list(queue.lanes) == [(HOST, "default")] and len(queue.lanes[(HOST, "default")]) == 1
    assert store.get(json.loads(ghost.body)["jobId"]) is None


def test_an_envelope_lives_at_most_seven_days(tmp_path):
    trusted_home(tmp_path)
    with pytest.raises(ValueError, match="at most 168 hours"):
        sealed(tmp_path, ttl_s=MAX_TTL_S + 1)
    now = int(time.time())
    long_lived = sealed(tmp_path, issuedAt=now, expiresAt=now + MAX_TTL_S + 60)
    week = sealed(tmp_path, issuedAt=now, expiresAt=now + MAX_TTL_S)  # the control: exactly the limit
    got = [check_envelope(s.to_wire(), trust=load_trust(tmp_path), host=HOST, lane="default",
                          kinds=frozenset({"noop"}), now=time.time(), skew_s=60) for s in (long_lived, week)]
    assert not isinstance(got[0], Accepted) and got[0].code is Refusal.MALFORMED and "past the limit" in got[0].reason
    assert isinstance(got[1], Accepted)
    queue = MemoryBackend()
    asyncio.run(queue.ensure_lane(HOST, "default", slots=1, ack_wait_s=5))

    async def factory():
        return queue

    with TestClient(create_app(factory, load_trust(tmp_path)), base_url="http://127.0.0.1") as http:
        over = http.post("/v1/jobs", json=long_lived.to_dict())
    assert over.status_code == 422 and "at most" in over.text, over.text


def test_the_stream_keeps_its_quota_and_a_full_lane_refuses_new_jobs(tmp_path, nats_url, monkeypatch):
    """The real server: the stream is made (or, made before, updated) with its limits; past a lane's cap a
    publish is refused QUEUE_FULL while another lane still takes jobs."""
    monkeypatch.setattr(jetstream, "STREAM_LIMITS", {**jetstream.STREAM_LIMITS, "max_msgs_per_subject": 2})
    trusted_home(tmp_path)

    async def go():
        import nats
        from nats.js.api import RetentionPolicy, StreamConfig

        old = await nats.connect(nats_url)  # a stream made before the quota, as an older proctor made it
        await old.jetstream().add_stream(StreamConfig(name=STREAM, subjects=[f"{jetstream.SUBJECT_PREFIX}.>"],
                                                      retention=RetentionPolicy.WORK_QUEUE, duplicate_window=120.0))
        await old.close()
        queue = await JetStreamBackend.connect(nats_url)
        try:
            info = (await queue.nc.jetstream().stream_info(STREAM)).config
            for lane_host in (HOST, "otherhost"):
                await queue.ensure_lane(lane_host, "default", slots=1, ack_wait_s=5)
            outcomes = []
            for host in (HOST, HOST, HOST, "otherhost"):
                try:
                    await sender.publish(queue, sealed(tmp_path, host), sent=SentStore(tmp_path))
                    outcomes.append("queued")
                except sender.QueueFull as exc:
                    outcomes.append(f"full: {exc}")
            return info, outcomes
        finally:
            await queue.close()

    info, outcomes = asyncio.run(go())
    assert info.max_age == MAX_TTL_S + 3600 and info.max_bytes == 1 << 30 and str(getattr(info.discard, "value", info.discard)) == "new", info
    assert info.max_msgs_per_subject == 2 and info.discard_new_per_subject is True
    assert outcomes[:2] == ["queued", "queued"] and outcomes[3] == "queued", outcomes
    assert outcomes[2].startswith("full: the queue is full for quotahost/default: maximum messages per subject"), outcomes


def _post_in_turn(apps, envelopes):
    """POST each envelope to the apps in turn (the first to apps[0], the next to apps[1], ...)."""
    clients = [TestClient(app, base_url="http://127.0.0.1") for app in apps]
    for c in clients:
        c.__enter__()
    try:
        return [clients[i % len(clients)].post("/v1/jobs", json=e.to_dict()) for i, e in enumerate(envelopes)]
    finally:
        for c in clients:
            c.__exit__(None, None, None)


def test_one_signer_gets_its_share_and_the_others_keep_theirs(tmp_path):
    """A busy (or stolen) key cannot take every sender's room: past its share in a minute a signer's POST is
    429 SIGNER_QUOTA with Retry-After, while another trusted signer's job is still taken; in the next
    minute the signer has its share again."""
    from proctor.surfaces.api.quota import Quota

    trusted_home(tmp_path)
    queue = MemoryBackend()
    asyncio.run(queue.ensure_lane(HOST, "default", slots=1, ack_wait_s=5))

    async def factory():
        return queue

    now = [6_000_030.0]  # half a minute into a window, on a clock the test moves
    app = create_app(factory, load_trust(tmp_path), SentStore(tmp_path), quota=Quota(3, clock=lambda: now[0]))
    admin_key = keys.load("admin", tmp_path)
    (theirs,) = sender.build(targets=[HOST], kind="noop", lane="default", payload={}, signer=admin_key)
    with TestClient(app, base_url="http://127.0.0.1") as http:
        mine = [http.post("/v1/jobs", json=sealed(tmp_path).to_dict()) for _ in range(4)]
        other = http.post("/v1/jobs", json=theirs.to_dict())
        now[0] += 30
        later = http.post("/v1/jobs", json=sealed(tmp_path).to_dict())
    assert [r.status_code for r in mine] == [202, 202, 202, 429], [r.text for r in mine]
    assert mine[3].json()["code"] == "SIGNER_QUOTA" and mine[3].headers["retry-after"] == "30"
    assert other.status_code == 202, other.text  # the control: another signer's share is its own
    assert later.status_code == 202, later.text  # the next window
    assert len(queue.lanes[(HOST, "default")]) == 5


def test_a_signers_share_is_the_fleets_not_one_per_api_server(tmp_path, nats_url):
    """Two API servers on one real NATS server draw on the same share: the signer's fourth job is refused by
    whichever server gets it, and a server that has never seen the signer refuses it too. Control: a second
    signer's job through the same servers is taken."""
    from proctor.surfaces.api.quota import Quota

    trusted_home(tmp_path)
    now = 7_000_000.0 + (time.time_ns() % 1000) * 60  # a window of this test's own on the shared server

    async def factory():
        queue = await JetStreamBackend.connect(nats_url)
        await queue.ensure_lane(HOST, "default", slots=1, ack_wait_s=5)
        return queue

    apps = [create_app(factory, load_trust(tmp_path), SentStore(tmp_path / f"sent{i}"),
                       quota=Quota(3, clock=lambda: now)) for i in range(3)]
    admin_key = keys.load("admin", tmp_path)
    (theirs,) = sender.build(targets=[HOST], kind="noop", lane="default", payload={}, signer=admin_key)
    got = _post_in_turn(apps[:2], [sealed(tmp_path) for _ in range(4)])
    fresh = _post_in_turn(apps[2:], [sealed(tmp_path), theirs])
    assert [r.status_code for r in got] == [202, 202, 202, 429], [r.text for r in got]
    assert got[3].json()["code"] == "SIGNER_QUOTA"
    assert fresh[0].status_code == 429 and fresh[0].json()["code"] == "SIGNER_QUOTA", fresh[0].text
    assert fresh[1].status_code == 202, fresh[1].text  # the control
