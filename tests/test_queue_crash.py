"""Crash and partition tests: real nats-server, `proctor listen` subprocesses, the real run_agent with a probe
agent. A `kill -9`ed listener's job is completed once by a second listener with no overlapping runs; a
partitioned listener kills its own job before the lease expires. Also the CLI verbs end to end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from proctor.contract import Code, Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import sender
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import (
    PROCTOR_CLI,
    Listeners,
    overlapping_runs,
    read_probe,
    trusted_home,
    wait_for,
    write_agent_config,
    write_probe_agent,
)
from proctor.mechanisms.queue.testing import runs_started as starts

ACK_WAIT = 3.0


@pytest.fixture
def setup(proctor_home, repo, tmp_path):
    th = trusted_home(proctor_home)
    probe = tmp_path / "probe.jsonl"
    cfg = write_agent_config(tmp_path / "agents.toml", write_probe_agent(tmp_path / "fake-agent", probe))
    listeners = Listeners(cfg)
    yield th, probe, repo, lambda host, url: listeners.start(host, url, ack_wait_s=ACK_WAIT)
    listeners.stop(10)


def enqueue(url, th, host, task, repo):
    payload = {"agent": "fake", "task": task, "repo": str(repo), "ticket": "T-1", "timeoutSec": 60}

    async def go():
        backend = await JetStreamBackend.connect(url)
        (sealed,) = sender.build(targets=[host], kind="run_agent", lane="default", payload=payload, signer=th.sender)
        job = await sender.publish(backend, sealed)
        await backend.close()
        return job.job_id

    return asyncio.run(go())


def wait_result(url, home, job_id, timeout_s):
    async def go():
        backend = await JetStreamBackend.connect(url)
        try:
            return await sender.wait(backend, load_trust(home), job_id, timeout_s)
        finally:
            await backend.close()

    return asyncio.run(go())




def test_kill_9_mid_job_second_listener_completes_it_exactly_once(nats_url, setup, proctor_home):
    th, probe, repo, listen = setup
    host = f"crash-{os.getpid()}"
    first = listen(host, nats_url)
    job_id = enqueue(nats_url, th, host, "sleep 5", repo)
    wait_for(lambda: starts(probe), 60, "the first run to start")
    first.send_signal(signal.SIGKILL)
    first.wait()
    listen(host, nats_url)
    res = wait_result(nats_url, proctor_home, job_id, 60)
    events = read_probe(probe)
    runs = [e for e in events if e["event"] == "start"]
    assert res is not None and res.result.status is Status.completed, res
    assert res.delivery == 2
    assert len(runs) == 2
    assert [e["how"] for e in events if e["event"] == "end"] == ["sigterm", "completed"]  # done exactly once
    assert not overlapping_runs(events)
    abandoned = runs[0]["cwd"]
    assert any(abandoned in risk and "abandoned" in risk for risk in res.result.known_risks), res.result.known_risks
    assert res.result.needs_human_review
    ends = Ledger(proctor_home / "ledger.sqlite3").rows(kind="queue.end", job_id=job_id)
    assert len(ends) == 1


class Proxy:
    """A loopback TCP relay that can be cut: while `blocked`, bytes are held, as on a partitioned link."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.blocked = threading.Event()
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.blocked.is_set() and not self.closed.is_set():
                    time.sleep(0.02)
                if self.closed.is_set():
                    return
                dst.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.closed.set()
        for s in [self.sock, *self.conns]:
            s.close()


def test_partitioned_listener_kills_its_own_job_before_the_lease_expires(nats_url, setup, proctor_home):
    th, probe, repo, listen = setup
    host = f"part-{os.getpid()}"
    proxy = Proxy(int(nats_url.rsplit(":", 1)[1]))
    try:
        listen(host, f"nats://127.0.0.1:{proxy.port}")
        job_id = enqueue(nats_url, th, host, "sleep 4", repo)
        wait_for(lambda: starts(probe), 60, "the first run to start")
        time.sleep(0.5)
        cut = time.time()
        proxy.blocked.set()
        first_end = wait_for(lambda: [e for e in read_probe(probe) if e["event"] == "end"], 10, "the self-kill")[0]
        # The last confirmed heartbeat was at most ack_wait/4 before the cut; the broker redelivers ack_wait
        # after it, so the kill must land before cut + ack_wait.
        assert first_end["how"] == "sigterm" and first_end["t"] - cut < ACK_WAIT, first_end["t"] - cut
        listen(host, nats_url)
        res = wait_result(nats_url, proctor_home, job_id, 60)
    finally:
        proxy.close()
    events = read_probe(probe)
    assert res.result.status is Status.completed and res.delivery >= 2
    assert not overlapping_runs(events)
    assert [e["how"] for e in events if e["event"] == "end"] == ["sigterm", "completed"]
    released = Ledger(proctor_home / "ledger.sqlite3").rows(kind="queue.released", job_id=job_id)
    assert released and "lease lost" in released[0].payload["reason"]
    assert any("lease lost" in r for r in res.result.known_risks), res.result.known_risks


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PROCTOR_CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_cli_enqueue_send_job_cancel(nats_url, setup, tmp_path):
    th, probe, repo, listen = setup
    host = f"cli-{os.getpid()}"
    listen(host, nats_url)
    noop = tmp_path / "noop.json"
    noop.write_text("{}")
    sent = cli("send", "--targets", host, "--kind", "noop", "--payload-file", str(noop), "--queue", nats_url)
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout)["result"]["status"] == "completed"

    long_job = tmp_path / "long.json"
    long_job.write_text(json.dumps({"agent": "fake", "task": "sleep 30", "repo": str(repo), "ticket": "T-2"}))
    out = cli("enqueue", "--targets", host, "--payload-file", str(long_job), "--queue", nats_url)
    assert out.returncode == 0, out.stderr
    (job_id,) = out.stdout.split()
    wait_for(lambda: starts(probe), 60, "the long job to start")
    shown = json.loads(cli("job", job_id, "--queue", nats_url).stdout)
    assert shown["state"] == "running" and shown["target"] == host
    assert cli("cancel", job_id, "--queue", nats_url).returncode == 0
    res = wait_for(lambda: json.loads(cli("job", job_id, "--queue", nats_url).stdout).get("result"), 30,
                   "the cancelled result")
    assert res["status"] == Status.failed.value and res["code"] == Code.CANCELLED.value
    assert [e["how"] for e in read_probe(probe) if e["event"] == "end"] == ["sigterm"]
    assert cli("job", "no-such-job", "--queue", nats_url).returncode == 2
    assert Path(res["worktreePath"]).is_dir()  # left for review
