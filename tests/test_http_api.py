"""The HTTP API on a real nats-server behind real uvicorn: the signed envelope in, job state and the verified
result out; schemathesis fuzzes every operation and must find no 5xx."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest
import schemathesis
from conftest import serve_in_thread
from hypothesis import HealthCheck, given, settings

from proctor.surfaces.api.app import create_app
from proctor.surfaces.api.reads import sign_read
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import keys, sender, server
from proctor.mechanisms.queue.envelope import canonical_json
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import trusted_home

HOST = "httphost"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(base_url, nats_url, home): the app served by uvicorn in a thread, trusting a module-wide home."""
    home = tmp_path_factory.mktemp("http-home")
    trusted_home(home)
    handle = server.start(tmp_path_factory.mktemp("nats") / "store")
    asyncio.run(open_lane(handle.url, HOST))
    app = create_app(lambda: JetStreamBackend.connect(handle.url), load_trust(home), SentStore(home))
    with serve_in_thread(app) as base:
        yield base, handle.url, home
    handle.stop()


async def open_lane(url: str, host: str, lane: str = "default") -> None:
    """The lane a listener of `host` opens when it starts (its durable consumer, as `Listener` makes it): the
    HTTP API takes jobs only for a lane some listener opened."""
    backend = await JetStreamBackend.connect(url)
    try:
        s = Settings(host, {lane: 1}, ack_wait_s=5)
        await backend.ensure_lane(host, lane, slots=1, ack_wait_s=s.ack_wait_s, max_deliver=s.max_deliver)
    finally:
        await backend.close()


def test_fuzzed_requests_never_get_a_5xx(api):
    base = api[0]
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) == 3
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(base_url=base, checks=[schemathesis.checks.not_a_server_error])

        fuzz()


def envelope(home, name="default", **over):
    signer = keys.load(name, home)
    (sealed,) = sender.build(targets=[HOST], kind="noop", lane="default", payload={}, signer=signer)
    if over:
        body = json.loads(sealed.body)
        body.update(over)
        sealed = type(sealed)(sealed.alg, canonical_json(body), signer.sign(b"proctor/job/v1\n" + canonical_json(body)))
    return sealed.to_dict()


def test_post_then_state_then_verified_result(api):
    base, nats_url, home = api

    async def go():
        backend = await JetStreamBackend.connect(nats_url)
        stop = asyncio.Event()
        listener = Listener(Settings(HOST, {"default": 1}, ack_wait_s=5), backend, load_trust(home),
                            keys.load("host", home), JobStore(home / "queue.sqlite3"), Ledger(home / "ledger.sqlite3"),
                            {"noop": NoopRunner()})
        sender_key = keys.load("default", home)

        def signed(path: str) -> dict[str, str]:  # a read signed by the job's own sender
            return sign_read(sender_key, "GET", path)

        async with httpx.AsyncClient(base_url=base, timeout=20) as http:
            posted = await http.post("/v1/jobs", json=envelope(home))
            job_id = posted.json()["jobId"]
            result, status = f"/v1/jobs/{job_id}/result", f"/v1/jobs/{job_id}"
            pending = await http.get(result, headers=signed(result))
            state = await http.get(status, headers=signed(status))
            task = asyncio.create_task(listener.serve(stop))
            done = await http.get(result, params={"wait": 10}, headers=signed(result))
            stop.set()
            await task
            await backend.close()
            return posted, pending, state, done

    posted, pending, state, done = asyncio.run(go())
    assert posted.status_code == 202
    assert pending.status_code == 202 and pending.json()["state"] == "queued"
    assert state.status_code == 200 and state.json()["target"] == HOST
    assert done.status_code == 200 and done.json()["verified"] is True
    assert done.json()["result"]["status"] == "completed"


def test_bad_envelopes_get_clear_4xx(api):
    base, _, home = api
    forged = envelope(home)
    body = json.loads(base64.b64decode(forged["body"]))
    body["target"] = "elsewhere"
    forged["body"] = base64.b64encode(canonical_json(body)).decode()
    with httpx.Client(base_url=base) as http:
        assert http.post("/v1/jobs", json={"v": 1, "alg": "ed25519", "body": "!!", "sig": ""}).status_code == 400
        assert http.post("/v1/jobs", json=forged).status_code == 401
        assert http.post("/v1/jobs", json=envelope(home, "stranger")).status_code == 401
        assert http.post("/v1/jobs", json=envelope(home, kind="shell")).status_code == 403
        bad = http.post("/v1/jobs", json=envelope(home, kind="run_agent", payload={"agent": "x"}))
        assert bad.status_code == 422 and "task" in json.dumps(bad.json())
        assert http.post("/v1/jobs", json=envelope(home, expiresAt=1)).status_code == 422
        assert http.get("/v1/jobs/nope").status_code == 401  # no credential: nothing, not even whether it exists
        assert "/v1/jobs" in http.get("/openapi.json").json()["paths"]


class _DownBackend(MemoryBackend):
    async def publish(self, host, lane, job_id, data):
        raise ConnectionError("nats: no servers available")


def test_a_queue_that_cannot_take_the_job_is_a_503_not_a_500(tmp_path):
    from fastapi.testclient import TestClient

    trusted_home(tmp_path)
    trust = load_trust(tmp_path)
    for backend, want in ((MemoryBackend(), 202), (_DownBackend(), 503)):  # control first
        asyncio.run(backend.ensure_lane(HOST, "default", slots=1, ack_wait_s=5))

        async def factory(backend=backend):
            return backend

        with TestClient(create_app(factory, trust), base_url="http://127.0.0.1") as http:
            res = http.post("/v1/jobs", json=envelope(tmp_path))
        assert res.status_code == want, res.text
    assert "did not accept the job" in res.json()["detail"] and res.json()["code"] == "QUEUE_UNAVAILABLE"


def _reads_app(tmp_path, token: str | None = None):
    trusted_home(tmp_path)
    backend = MemoryBackend()
    asyncio.run(backend.ensure_lane(HOST, "default", slots=1, ack_wait_s=5))

    async def factory():
        return backend

    return create_app(factory, load_trust(tmp_path), SentStore(tmp_path), read_token=token)


def test_a_job_is_read_only_by_its_sender_or_with_this_installs_token(tmp_path):
    """The job id is never a capability: no credential 401, another trusted key 403, a stale or forged
    signature 401; the job's own sender's signed read, or the install's token, is the control."""
    from fastapi.testclient import TestClient

    token = "k" * 43
    with TestClient(_reads_app(tmp_path, token), base_url="http://127.0.0.1") as http:
        job_id = http.post("/v1/jobs", json=envelope(tmp_path)).json()["jobId"]
        path = f"/v1/jobs/{job_id}"
        sender_key, admin = keys.load("default", tmp_path), keys.load("admin", tmp_path)
        assert http.get(path).json()["code"] == "UNAUTHENTICATED"
        assert http.get(path, headers={"Authorization": "Bearer " + "x" * 43}).status_code == 401
        other = http.get(path, headers=sign_read(admin, "GET", path))
        assert other.status_code == 403 and other.json()["code"] == "NOT_YOUR_JOB"
        assert http.get(path, headers=sign_read(keys.load("stranger", tmp_path), "GET", path)).status_code == 401
        stale = sign_read(sender_key, "GET", path, now=time.time() - 3600)
        assert http.get(path, headers=stale).status_code == 401
        elsewhere = sign_read(sender_key, "GET", f"/v1/jobs/{job_id}/result")  # signed for another path
        assert http.get(path, headers=elsewhere).status_code == 401
        assert http.get("/v1/jobs/nope", headers=sign_read(sender_key, "GET", "/v1/jobs/nope")).status_code == 403
        # The controls.
        mine = http.get(path, headers=sign_read(sender_key, "GET", path))
        assert mine.status_code == 200 and mine.json()["state"] == "queued"
        assert http.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert http.get("/v1/jobs/nope", headers={"Authorization": f"Bearer {token}"}).status_code == 404


def test_every_path_of_the_origin_is_proctors_no_docs_page_and_nul_is_a_400(tmp_path):
    from fastapi.testclient import TestClient

    with TestClient(_reads_app(tmp_path, "k" * 43), base_url="http://127.0.0.1") as http:
        replies = {p: http.get(p) for p in ("/docs", "/redoc", "/docs/oauth2-redirect", "/nothing", "/openapi.json",
                                            "/v1/jobs/x%00y", "/v1/jobs/x?wait=%00", "/v1/jobs")}
    assert replies["/openapi.json"].status_code == 200 and "swagger" not in replies["/openapi.json"].text.lower()
    for p in ("/docs", "/redoc", "/docs/oauth2-redirect", "/nothing"):
        assert replies[p].status_code == 404, p
    for p in ("/v1/jobs/x%00y", "/v1/jobs/x?wait=%00"):
        assert replies[p].status_code == 400 and replies[p].json()["code"] == "BAD_REQUEST", p
    assert replies["/v1/jobs"].status_code == 405
    for p, r in replies.items():
        assert "default-src 'none'" in r.headers["content-security-policy"], p
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff", p
