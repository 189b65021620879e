"""Fixes from the queue review: each test fails without its fix and has a control where the legitimate case
still works. Memory backend unless a real server is the point."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
from click.testing import CliRunner
from conftest import LoopbackServer, wait_until

from proctor.surfaces.cli import main
from proctor.contract import Code, RunAgentResult, Status, parse_request
from proctor.mechanisms.ledger.rows import canonical_json as ledger_canonical_json
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import envelope, keys, sender, server
from proctor.mechanisms.queue.envelope import job_fields, seal
from proctor.services.listen.kinds import AgentJob, NoopRunner, ProcessAgentRunner
from proctor.services.listen.checks import Accepted, Refusal, Refused, check_envelope
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.memory import MemoryBackend, MemoryDelivery
from proctor.mechanisms.queue.results import open_result
from proctor.mechanisms.queue.signers import TrustFileError, load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import TrustedHome, trusted_home

PAYLOAD = {"agent": "fake", "task": "do it", "repo": "/tmp/r", "ticket": "T-1"}


def run_agent_env(signer, **payload):
    f = job_fields(kind="run_agent", target="hostA", lane="default", payload={**PAYLOAD, **payload},
                   signer_kid=signer.kid, ttl_s=600)
    return seal(f, signer).to_wire()


def check(raw, trust, confine):
    return check_envelope(raw, trust=trust, host="hostA", lane="default", kinds=frozenset({"run_agent"}),
                          now=time.time(), skew_s=5.0, confine=confine)


# S1 -----------------------------------------------------------------------------------------------------------

def test_weakening_confine_needs_the_validate_command_privilege(proctor_home):
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    weak = check(run_agent_env(th.sender, confine="off"), trust, "auto")
    assert isinstance(weak, Refused) and weak.code is Refusal.OVER_PRIVILEGED and weak.authentic
    assert "may_set_validate_command" in weak.reason
    below_required = check(run_agent_env(th.sender, confine="auto"), trust, "required")
    assert isinstance(below_required, Refused) and below_required.code is Refusal.OVER_PRIVILEGED
    # Controls: a privileged signer may; anyone may keep or tighten it; "off" on an "off" listener is no change.
    assert isinstance(check(run_agent_env(th.admin, confine="off"), trust, "required"), Accepted)
    assert isinstance(check(run_agent_env(th.sender, confine="required"), trust, "auto"), Accepted)
    assert isinstance(check(run_agent_env(th.sender, confine="auto"), trust, "auto"), Accepted)
    assert isinstance(check(run_agent_env(th.sender, confine="off"), trust, "off"), Accepted)
    assert isinstance(check(run_agent_env(th.sender), trust, "required"), Accepted)


# S5 and malformed trust files ---------------------------------------------------------------------------------

def test_may_set_validate_command_must_be_a_real_bool(proctor_home):
    trusted_home(proctor_home)
    path = proctor_home / "signers.toml"
    good = path.read_text()
    assert "may_set_validate_command = true" in good
    trust = load_trust(proctor_home)  # control: real bools load, the admin has the privilege
    assert sorted(s.may_set_validate_command for s in trust.signers.values()) == [False, False, True]
    path.write_text(good.replace("may_set_validate_command = false", 'may_set_validate_command = "false"', 1))
    with pytest.raises(TrustFileError, match="true or false"):
        load_trust(proctor_home)


@pytest.mark.parametrize("text", ["signers = [1]\n", "[signers]\nx = 1\n", "hosts = 3\n", "[hosts]\nh = 'x'\n"])
def test_malformed_trust_file_is_a_trust_file_error(proctor_home, text):
    (proctor_home / "signers.toml").write_text(text)
    with pytest.raises(TrustFileError):
        load_trust(proctor_home)


class CountingListener:
    """A TCP port that counts the connections made to it (and closes each at once): where a command would
    reach its queue."""

    def __init__(self) -> None:
        self.server = LoopbackServer(lambda conn: conn.close())
        self.srv = self.server.srv
        self.url = f"nats://127.0.0.1:{self.server.port}"

    @property
    def connections(self) -> int:
        return self.server.accepted


def test_corrupt_host_key_is_a_trust_file_error_and_a_clear_exit(proctor_home):
    trusted_home(proctor_home)
    load_trust(proctor_home)  # control
    reached, queue = CountingListener(), CountingListener()
    try:
        # Control: with the keys readable, the command goes to the queue (and fails there: no NATS server).
        res = CliRunner().invoke(main, ["job", "abc", "--queue", reached.url])
        assert res.exit_code == 2 and "cannot reach the queue" in res.output and reached.connections > 0, res.output
        keys.key_path(keys.HOST_KEY, proctor_home).write_text("{not json")
        with pytest.raises(TrustFileError, match="unreadable"):
            load_trust(proctor_home)
        # A clear exit at once: refused before any connection to the queue (the old way, a connect and its
        # retries first, showed as seconds; the count is the evidence, not the clock).
        for args in (["job", "abc"], ["listen", "--host", "hostA"], ["serve"]):
            res = CliRunner().invoke(main, [*args, "--queue", queue.url])
            assert res.exit_code == 2, (args, res.output, res.exception)
            assert "unreadable" in res.output and queue.connections == 0, (args, queue.connections, res.output)
    finally:
        reached.srv.close()
        queue.srv.close()
    (proctor_home / "signers.toml").write_text("signers = [1]\n")
    res = CliRunner().invoke(main, ["job", "abc", "--queue", "nats://127.0.0.1:1"])
    assert res.exit_code == 2 and "[signers]" in res.output


# CLI edges ----------------------------------------------------------------------------------------------------

def test_job_on_an_unreachable_queue_fails_instead_of_hanging(proctor_home):
    trusted_home(proctor_home)
    proc = subprocess.run([sys.executable, "-c", "from proctor.surfaces.cli import main; main()", "job", "abc",
                           "--queue", "nats://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PROCTOR_HOME": str(proctor_home)})
    assert proc.returncode == 2 and "cannot reach the queue" in proc.stderr


@pytest.mark.parametrize("ttl", ["inf", "nan", "0.5", "-3"])
def test_enqueue_rejects_a_non_finite_or_tiny_ttl(proctor_home, tmp_path, ttl):
    trusted_home(proctor_home)
    payload = tmp_path / "p.json"
    payload.write_text(json.dumps(PAYLOAD))
    res = CliRunner().invoke(main, ["enqueue", "--targets", "hostA", "--payload-file", str(payload), "--ttl", ttl,
                                    "--queue", "nats://127.0.0.1:1"])
    assert res.exit_code == 2 and "--ttl" in res.output, res.output


class FailingPublish(MemoryBackend):
    async def publish(self, host, lane, job_id, data):
        raise TimeoutError("nats: timeout")


def test_enqueue_publish_failure_is_a_clear_error_and_the_control_enqueues(proctor_home, tmp_path, monkeypatch):
    trusted_home(proctor_home)
    payload = tmp_path / "p.json"
    payload.write_text(json.dumps(PAYLOAD))
    args = ["enqueue", "--targets", "hostA", "--payload-file", str(payload), "--ttl", "60",
            "--queue", "nats://127.0.0.1:1"]
    import proctor.surfaces.cli.queue as cli_queue

    async def fake_connect(url, **_):
        return backend

    monkeypatch.setattr(cli_queue, "connect", fake_connect)
    backend = MemoryBackend()
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and len(res.output.strip()) == 32  # control: one job id
    backend = FailingPublish()
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "could not enqueue" in res.output and "TimeoutError" in res.output


# Listener: S4, C1, C2, C3, blocking calls ---------------------------------------------------------------------

def listener_for(proctor_home, backend, runner, *, lanes=None, ack_wait=2.0, skew=60.0, store=None, audit=None):
    if (proctor_home / "signers.toml").exists():
        th = TrustedHome(proctor_home, *(keys.load(n, proctor_home) for n in ("default", "admin", "stranger", "host")))
    else:
        th = trusted_home(proctor_home)
    store = store or JobStore(proctor_home / "queue.sqlite3")
    listener = Listener(Settings("hostA", lanes or {"default": 1}, ack_wait_s=ack_wait, clock_skew_s=skew),
                        backend, load_trust(proctor_home), th.host, store,
                        audit or Ledger(proctor_home / "ledger.sqlite3"), {"noop": runner, "run_agent": runner})
    return th, store, listener


def test_an_authentic_refusal_never_overwrites_a_finished_result(proctor_home):
    async def go():
        backend = MemoryBackend()
        th, store, listener = listener_for(proctor_home, backend, NoopRunner(), lanes={"default": 1, "gpu": 1})
        trust = load_trust(proctor_home)
        (sealed,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        job = await sender.publish(backend, sealed)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        first = await sender.wait(backend, trust, job.job_id, 5)
        first_raw = await backend.get_result(f"hostA.{job.job_id}")
        await backend.publish_raw("hostA", "gpu", sealed.to_wire())  # replay on another lane: MISROUTED
        fleet = keys.load("fleet", proctor_home)  # trusted for noop only: KIND_NOT_ALLOWED, same job id
        f = job_fields(kind="run_agent", target="hostA", lane="default", payload={}, signer_kid=fleet.kid,
                       ttl_s=60, job_id=job.job_id)
        await backend.publish_raw("hostA", "default", seal(f, fleet).to_wire())
        # Control: the same kind of refusal for a job with no result yet is answered.
        f2 = job_fields(kind="noop", target="hostA", lane="default", payload={}, signer_kid=th.sender.kid, ttl_s=60)
        await backend.publish_raw("hostA", "gpu", seal(f2, th.sender).to_wire())
        while not (keys_ := [k for k in backend.kv.get("results", {}) if k.startswith(f"hostA.{f2['jobId']}.")]):
            await asyncio.sleep(0.01)
        control = open_result(await backend.get_result(keys_[0]), trust, host="hostA", job_id=f2["jobId"],
                              envelope=envelope.envelope_digest(seal(f2, th.sender).body))
        assert keys_[0].startswith(f"hostA.{f2['jobId']}.misrouted-")  # a fact about the copy, not the job
        await asyncio.sleep(0.3)
        after = await sender.wait(backend, trust, job.job_id, 1)
        after_raw = await backend.get_result(f"hostA.{job.job_id}")
        stop.set()
        await task
        return first, first_raw, after, after_raw, control, store.job(job.job_id)

    first, first_raw, after, after_raw, control, row = asyncio.run(go())
    assert first.refusal is None and first.result.status is Status.completed
    assert after.refusal is None and after_raw == first_raw
    assert row["state"] == "done" and row["result"] == json.loads(first_raw)
    assert control.refusal == "MISROUTED"


class SecondRunWins:
    def __init__(self) -> None:
        self.n = 0

    async def run(self, job, payload, cancel):
        self.n += 1
        if self.n == 1:
            while cancel() is None:
                await asyncio.sleep(0.02)
            return RunAgentResult(status=Status.failed, code=Code.CANCELLED, summary="first")
        return RunAgentResult(status=Status.completed, summary="second attempt ran")


def test_a_started_job_is_not_refused_as_expired_on_redelivery(proctor_home):
    async def go():
        backend = MemoryBackend()
        runner = SecondRunWins()
        th, store, listener = listener_for(proctor_home, backend, runner, skew=0.0)
        trust = load_trust(proctor_home)
        (late,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender, ttl_s=1)
        await sender.publish(backend, late)
        await asyncio.sleep(2.1)  # control: never admitted, past expiry when first seen
        (sealed,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender,
                                 ttl_s=1)
        job = await sender.publish(backend, sealed)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        expired = await sender.wait(backend, trust, json.loads(late.body)["jobId"], 5)
        while not listener.running:
            await asyncio.sleep(0.01)
        backend.partitioned = True  # lease lost -> released; redelivered after its expiry
        await asyncio.sleep(1.5)
        backend.partitioned = False
        res = await sender.wait(backend, trust, job.job_id, 6)
        stop.set()
        await task
        return expired, res, runner.n

    expired, res, runs = asyncio.run(go())
    assert expired.refusal == "EXPIRED"
    assert res.refusal is None and res.result.summary == "second attempt ran" and runs == 2


class RaisesOnce:
    def __init__(self) -> None:
        self.n = 0

    async def run(self, job, payload, cancel):
        self.n += 1
        if self.n == 1:
            raise RuntimeError("runner blew up")
        return RunAgentResult(status=Status.completed, summary=f"run {self.n}")


class FlakyRunning(MemoryBackend):
    fails = 1

    async def put_running(self, key, data):
        if self.fails:
            self.fails -= 1
            raise ConnectionError("kv hiccup")
        await super().put_running(key, data)


def test_an_exception_in_a_run_releases_the_job_for_redelivery(proctor_home):
    async def go(backend, runner):
        th, store, listener = listener_for(proctor_home, backend, runner, ack_wait=30.0)
        (sealed,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        job = await sender.publish(backend, sealed)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        res = await sender.wait(backend, load_trust(proctor_home), job.job_id, 5)  # far below ack_wait
        stop.set()
        await task
        return res, store.job(job.job_id)

    runner = RaisesOnce()
    res, row = asyncio.run(go(MemoryBackend(), runner))
    assert res is not None and res.result.summary == "run 2" and res.delivery == 2 and row["state"] == "done"
    # A failed lookup record is not a failed run: the first delivery's result stands.
    res, row = asyncio.run(go(FlakyRunning(), NoopRunner()))
    assert res is not None and res.result.status is Status.completed and res.delivery == 1


class Forever:
    async def run(self, job, payload, cancel):
        while cancel() is None:
            await asyncio.sleep(0.01)
        self.at = asyncio.get_running_loop().time()
        return RunAgentResult(status=Status.failed, code=Code.CANCELLED, summary="x")


def test_a_hung_heartbeat_does_not_delay_the_lease_loss_kill(proctor_home, monkeypatch):
    hang = {"on": False}
    orig = MemoryDelivery.heartbeat

    async def heartbeat(self, timeout_s):
        if hang["on"]:
            await asyncio.sleep(3600)  # a write that never completes
        return await orig(self, timeout_s)

    monkeypatch.setattr(MemoryDelivery, "heartbeat", heartbeat)
    ack_wait = 2.0

    async def go():
        backend, runner = MemoryBackend(), Forever()
        th, _, listener = listener_for(proctor_home, backend, runner, ack_wait=ack_wait)
        (sealed,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        await sender.publish(backend, sealed)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        while not listener.running:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        hang["on"] = True
        cut = asyncio.get_running_loop().time()
        while not hasattr(runner, "at"):
            await asyncio.sleep(0.01)
        took = (runner.at - cut) / ack_wait
        stop.set()
        await task
        return took

    assert asyncio.run(go()) < 0.6 + 0.05  # lease_margin; without the bound it was 0.75


def test_settings_are_validated():
    Settings("h", {"default": 1}, ack_wait_s=1.0, lease_margin=0.5)  # control
    for bad in ({"ack_wait_s": 0}, {"ack_wait_s": -1}, {"ack_wait_s": float("nan")}, {"ack_wait_s": float("inf")},
                {"lease_margin": 0}, {"lease_margin": 1.0}):
        with pytest.raises(ValueError):
            Settings("h", {"default": 1}, **bad)


class ThreadRecordingStore(JobStore):
    """Notes every use of the store: (what, whether it may wait for a lock, whether on the event loop)."""

    def __init__(self, *a, **kw):
        self.calls: list[tuple[str, bool, bool]] = []
        super().__init__(*a, **kw)

    def _note(self, name, wait):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        self.calls.append((name, wait, on_loop))

    def _tx(self, wait=True):
        self._note("transaction", wait)
        return super()._tx(wait)

    def read(self, op, *, wait=True):
        self._note("read", wait)
        return super().read(op, wait=wait)

    def still_owner(self, *a, **kw):
        self._note("still_owner", True)
        return super().still_owner(*a, **kw)

    def digest_of(self, *a, **kw):
        self._note("digest_of", True)
        return super().digest_of(*a, **kw)

    def job(self, *a, **kw):
        self._note("job", True)
        return super().job(*a, **kw)


class ThreadRecordingAudit:
    def __init__(self) -> None:
        self.on_loop: list[str] = []
        self.kinds: list[str] = []

    def append(self, kind, payload, *, job_id=None):
        self.kinds.append(kind)
        if threading.current_thread() is threading.main_thread():
            self.on_loop.append(kind)
        return len(self.kinds)


def test_the_event_loop_never_waits_for_the_store_or_the_audit(proctor_home):
    """The loop uses the job store only in ways that never wait for a lock (`wait=False`: a busy store goes to a
    worker thread, tests/test_queue_hotpath.py); an audit that writes at once is written from threads."""
    store = ThreadRecordingStore(proctor_home / "queue.sqlite3")
    audit = ThreadRecordingAudit()

    async def go():
        backend = MemoryBackend()
        th, _, listener = listener_for(proctor_home, backend, NoopRunner(), store=store, audit=audit)
        (sealed,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        job = await sender.publish(backend, sealed)
        stop = asyncio.Event()
        task = asyncio.create_task(listener.serve(stop))
        res = await sender.wait(backend, load_trust(proctor_home), job.job_id, 5)
        stop.set()
        await task
        return res

    assert asyncio.run(go()).result.status is Status.completed  # control: the job still runs
    assert [c for c in store.calls if c[1] and c[2]] == []  # nothing on the loop that may wait
    assert ("transaction", False, True) in store.calls  # control: the loop claimed and finished the job itself
    assert "queue.start" in audit.kinds and audit.on_loop == []


# C5 -----------------------------------------------------------------------------------------------------------

def test_a_runner_child_that_ignores_cancel_is_killed_after_the_grace(proctor_home, monkeypatch):
    import proctor.services.listen.kinds as kinds

    real = asyncio.create_subprocess_exec
    script = {"code": ""}

    async def fake_exec(*_args, **kw):
        return await real(sys.executable, "-c", script["code"], **kw)

    monkeypatch.setattr(kinds.asyncio, "create_subprocess_exec", fake_exec)
    request = parse_request(PAYLOAD)
    job = AgentJob("j1", 1, request)
    runner = ProcessAgentRunner(proctor_home / "q.sqlite3", cancel_grace_s=0.5, cancel_poll_s=0.05)

    async def go():
        return await runner.run(job, {}, lambda: "stop")

    # Control: a child that honours the cancel answers with its own result and is not killed.
    script["code"] = ("import sys, json; sys.stdin.readline(); sys.stdin.readline(); "
                      "print(json.dumps({'status': 'failed', 'code': 'CANCELLED', 'summary': 'stopped', "
                      "'agent': 'fake'}))")
    res = asyncio.run(go())
    assert res.code is Code.CANCELLED and res.summary == "stopped"
    # One that ignores it would sleep a minute: SIGKILLed after the grace instead (exited -9), not waited for.
    script["code"] = "import sys, time; sys.stdin.readline(); time.sleep(60)"
    res = asyncio.run(go())
    assert res.code is Code.HOST_ERROR and "exited -9" in res.summary


# server, keys, canonical_json ---------------------------------------------------------------------------------

def test_stop_local_never_kills_a_pid_that_is_not_our_nats_server(proctor_home, tmp_path):
    nats_dir = proctor_home / "nats"
    nats_dir.mkdir(parents=True, exist_ok=True)
    state = nats_dir / "server.json"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state.write_text(json.dumps({"url": "nats://127.0.0.1:1", "pid": stranger.pid, "port": 1}))
        assert server.stop_local(proctor_home) is False
        time.sleep(0.2)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
    handle = server.start(tmp_path / "store")  # control: our own server is stopped
    state.write_text(json.dumps({"url": handle.url, "pid": handle.pid, "port": handle.port}))
    assert server.stop_local(proctor_home) is True

    def gone() -> bool:
        try:
            return psutil.Process(handle.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, 60, "our own nats-server to stop")


def test_key_generate_never_writes_through_a_leftover_tmp(proctor_home, tmp_path):
    keys.generate("plain", home=proctor_home)  # control
    assert (keys.key_path("plain", proctor_home).stat().st_mode & 0o777) == 0o600
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    victim.chmod(0o644)
    path = keys.key_path("k", proctor_home)
    path.with_suffix(".tmp").symlink_to(victim)
    keys.generate("k", home=proctor_home)
    assert victim.read_text() == "keep me"
    assert (path.stat().st_mode & 0o777) == 0o600 and not path.is_symlink()
    leftover = keys.key_path("k2", proctor_home).with_suffix(".tmp")
    leftover.write_text("old")
    leftover.chmod(0o644)
    keys.generate("k2", home=proctor_home)
    assert (keys.key_path("k2", proctor_home).stat().st_mode & 0o777) == 0o600


def test_envelope_uses_the_ledgers_canonical_json():
    value = {"b": [1, "é"], "a": None}
    assert envelope.canonical_json(value) == ledger_canonical_json(value).encode() == b'{"a":null,"b":[1,"\xc3\xa9"]}'
    assert envelope.ledger_canonical_json is ledger_canonical_json
