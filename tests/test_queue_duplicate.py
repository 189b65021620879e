"""An envelope re-sent inside the JetStream duplicate window (issue 15, item 2) on a real nats-server: the
server drops it and says so in its PubAck; the sender is told (DUPLICATE, with when the first copy came), the
job runs once and the re-sender still gets its result; a different envelope reusing the job id is refused
before it is queued (DUPLICATE_JOB_ID). Through the Python API, `proctor enqueue|send --envelope-file` and
POST /v1/jobs, each beside the control where a fresh envelope is queued as before."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from conftest import serve_in_thread

from proctor.surfaces.api.app import create_app
from proctor.surfaces.api.reads import sign_read
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import keys, sender
from proctor.mechanisms.queue.backend import message_id
from proctor.mechanisms.queue.envelope import envelope_digest, job_fields, seal
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.results import SignedResult
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import trusted_home

PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]


def noop(th, host: str, **over):
    return seal(job_fields(kind="noop", target=host, lane="default", payload={}, signer_kid=th.sender.kid,
                           ttl_s=600, **over), th.sender)


def job_id_of(sealed) -> str:
    return json.loads(sealed.body)["jobId"]


def starts(home: Path, job_id: str) -> int:
    with Ledger(home / "ledger.sqlite3") as led:
        return len(led.rows(kind="queue.start", job_id=job_id))


async def run_listener(home: Path, backend, host: str, until) -> None:
    listener = Listener(Settings(host, {"default": 1}, ack_wait_s=10), backend, load_trust(home),
                        keys.load("host", home), JobStore(home / "queue.sqlite3"), Ledger(home / "ledger.sqlite3"),
                        {"noop": NoopRunner()})
    stop = asyncio.Event()
    task = asyncio.create_task(listener.serve(stop))
    try:
        await until()
    finally:
        stop.set()
        await task


def test_the_backend_reports_what_the_server_dropped(nats_url, proctor_home):
    th = trusted_home(proctor_home)
    host = f"dup-seam-{os.getpid()}"

    async def go():
        b = await JetStreamBackend.connect(nats_url)
        try:
            sealed = noop(th, host)
            mid = message_id(job_id_of(sealed), envelope_digest(sealed.body))
            first = await b.publish(host, "default", mid, sealed.to_wire())
            again = await b.publish(host, "default", mid, sealed.to_wire())
            other = noop(th, host)
            fresh = await b.publish(host, "default", message_id(job_id_of(other), envelope_digest(other.body)),
                                    other.to_wire())
            info = await b.nc.jetstream().stream_info("PROCTOR_JOBS", subjects_filter=f"proctor.jobs.{host}.>")
            return first, again, fresh, info.state.subjects
        finally:
            await b.close()

    first, again, fresh, subjects = asyncio.run(go())
    assert (first, again, fresh) == (False, True, False)
    assert subjects == {f"proctor.jobs.{host}.default": 2}  # three publishes, two messages
    mem = MemoryBackend()  # the in-memory model says the same
    assert asyncio.run(mem.publish("h", "default", "m1", b"x")) is False
    assert asyncio.run(mem.publish("h", "default", "m1", b"x")) is True


def test_a_resent_envelope_is_reported_duplicate_runs_once_and_is_still_answered(nats_url, proctor_home):
    th = trusted_home(proctor_home)
    host = f"dup-api-{os.getpid()}"
    sealed = noop(th, host)

    async def go():
        b = await JetStreamBackend.connect(nats_url)
        try:
            before = time.time()
            first = await sender.publish(b, sealed)
            again = await sender.publish(b, sealed)
            fresh = await sender.publish(b, noop(th, host))  # control: a new envelope is queued as before
            got: dict = {}

            async def answered():
                got["again"] = await sender.wait(b, load_trust(proctor_home), again, 30)
                got["fresh"] = await sender.wait(b, load_trust(proctor_home), fresh, 30)

            await run_listener(proctor_home, b, host, answered)
            return before, first, again, fresh, got
        finally:
            await b.close()

    before, first, again, fresh, got = asyncio.run(go())
    assert (first.code, first.duplicate, first.notice()) == (sender.QUEUED, False, None)
    assert (fresh.code, fresh.duplicate) == (sender.QUEUED, False)
    assert again.code == sender.DUPLICATE and again.duplicate and again.job_id == first.job_id
    assert again.accepted_at is not None and before <= again.accepted_at <= time.time()
    when = datetime.fromtimestamp(again.accepted_at, UTC).isoformat(timespec="seconds")
    notice = again.notice()
    assert notice.startswith(f"DUPLICATE: job {first.job_id} was already accepted at {when};"), notice
    assert "not queued again" in notice and "wait for or fetch its result" in notice
    # The re-sender's wait is answered: the first copy's result is this very envelope's answer.
    assert isinstance(got["again"], SignedResult) and got["again"].result.status.value == "completed"
    assert isinstance(got["fresh"], SignedResult)
    assert starts(proctor_home, first.job_id) == 1 and starts(proctor_home, fresh.job_id) == 1


def test_a_different_envelope_reusing_a_job_id_is_refused_before_it_is_queued(proctor_home, tmp_path):
    th = trusted_home(proctor_home)
    store = SentStore(proctor_home)
    sealed = noop(th, "hostA")
    assert sender.reused_id(sealed, store) is None  # never sent: nothing to reuse
    asyncio.run(sender.publish(MemoryBackend(), sealed, sent=store))
    assert sender.reused_id(sealed, store) is None  # the same envelope again: a duplicate, not a reuse
    squat = noop(th, "hostA", job_id=job_id_of(sealed))
    refused = sender.reused_id(squat, store)
    assert refused is not None and refused.code == sender.DUPLICATE_JOB_ID
    assert job_id_of(sealed) in refused.message and "another envelope" in refused.message
    assert sender.reused_id(squat, SentStore(tmp_path / "elsewhere")) is None  # another home never sent it


def cli(home: Path, *args: str, timeout: float = 90) -> tuple[int, str, str]:
    p = subprocess.run([*PROCTOR, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PROCTOR_HOME": str(home)})
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p.returncode, p.stdout, p.stderr


def test_enqueue_and_send_say_duplicate_and_send_still_gets_the_result(nats_url, proctor_home, tmp_path):
    th = trusted_home(proctor_home)
    host = f"dup-cli-{os.getpid()}"
    sealed = noop(th, host)
    env_file = tmp_path / "envelope.json"
    env_file.write_bytes(sealed.to_wire())
    job_id = job_id_of(sealed)
    code, out, err = cli(proctor_home, "enqueue", "--envelope-file", str(env_file), "--queue", nats_url)
    assert code == 0 and out.split() == [job_id] and err == "", err  # control: queued, nothing to say
    code, out, err = cli(proctor_home, "enqueue", "--envelope-file", str(env_file), "--queue", nats_url)
    assert code == 3 and out.split() == [job_id]
    assert err.startswith(f"proctor: DUPLICATE: job {job_id} was already accepted at 20") and err.count("\n") == 1
    listener = subprocess.Popen([*PROCTOR, "listen", "--host", host, "--ack-wait", "10", "--queue", nats_url],
                                env={**os.environ, "PROCTOR_HOME": str(proctor_home)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code, out, err = cli(proctor_home, "send", "--envelope-file", str(env_file), "--queue", nats_url,
                             "--wait", "60")
        res = json.loads(out)
        assert code == 0 and res["code"] == "DUPLICATE" and res["notice"].startswith("DUPLICATE: job ")
        assert res["verified"] is True and res["result"]["status"] == "completed", out
        assert err.startswith(f"proctor: DUPLICATE: job {job_id}")
        # Control: a fresh envelope through the same command is queued and answered with no notice.
        fresh = noop(th, host)
        env_file.write_bytes(fresh.to_wire())
        code, out, err = cli(proctor_home, "send", "--envelope-file", str(env_file), "--queue", nats_url,
                             "--wait", "60")
        res = json.loads(out)
        assert code == 0 and "code" not in res and err == "" and res["result"]["status"] == "completed"
    finally:
        listener.terminate()
        listener.wait(10)
    assert starts(proctor_home, job_id) == 1
    # A different envelope reusing the first one's id: refused, one line, nothing queued.
    env_file.write_bytes(noop(th, host, job_id=job_id).to_wire())
    code, out, err = cli(proctor_home, "enqueue", "--envelope-file", str(env_file), "--queue", nats_url)
    assert code == 2 and out == "" and err.startswith(f"proctor: DUPLICATE_JOB_ID: job id {job_id} was already")
    # An envelope file with flags that would change it: one line, exit 2.
    code, _, err = cli(proctor_home, "enqueue", "--envelope-file", str(env_file), "--lane", "x", "--queue", nats_url)
    assert code == 2 and "--lane" in err and err.count("\n") == 1
    code, _, err = cli(proctor_home, "enqueue", "--queue", nats_url)
    assert code == 2 and "--targets and --payload-file are required" in err


@pytest.fixture
def api(nats_url, tmp_path):
    home = tmp_path / "api-home"
    home.mkdir()
    th = trusted_home(home)
    app = create_app(lambda: JetStreamBackend.connect(nats_url), load_trust(home), SentStore(home))
    with serve_in_thread(app) as base:
        yield base, th


def test_post_v1_jobs_answers_a_retried_envelope_with_duplicate(api, nats_url):
    from test_http_api import open_lane

    base, th = api
    host = f"dup-http-{os.getpid()}"
    sealed = noop(th, host)
    asyncio.run(open_lane(nats_url, host))
    with httpx.Client(base_url=base, timeout=20) as http:
        first = http.post("/v1/jobs", json=sealed.to_dict())
        again = http.post("/v1/jobs", json=sealed.to_dict())
        squat = http.post("/v1/jobs", json=noop(th, host, job_id=job_id_of(sealed)).to_dict())
        fresh = http.post("/v1/jobs", json=noop(th, host).to_dict())
        path = f"/v1/jobs/{job_id_of(sealed)}"
        state = http.get(path, headers=sign_read(th.sender, "GET", path))  # a read signed by its sender
    assert first.status_code == 202 and "code" not in first.json()
    assert fresh.status_code == 202 and fresh.json()["jobId"] != first.json()["jobId"]
    body = again.json()
    assert again.status_code == 200 and body["code"] == "DUPLICATE" and body["jobId"] == first.json()["jobId"]
    assert body["detail"].startswith(f"DUPLICATE: job {body['jobId']} was already accepted at ")
    assert isinstance(body["acceptedAt"], float)
    assert squat.status_code == 409 and squat.json()["code"] == "DUPLICATE_JOB_ID"
    # The refused squat did not rebind the id: the API still binds it to the first envelope.
    assert state.status_code == 200 and state.json()["envelope"] == envelope_digest(sealed.body)
