"""The fleet's queue on a real 3-node JetStream cluster (the bundled nats-server, routed on loopback, the stream
and every bucket replicated three times): the stream leader killed mid-job, and a node restarted, with a
`proctor listen` subprocess and senders given every node's URL. The running job completes exactly once, its
result reaches the sender, nothing queued is lost and no job runs twice at once."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from proctor.contract import Status
from proctor.mechanisms.queue import sender, server
from proctor.mechanisms.queue.jetstream import BUCKETS, STREAM, JetStreamBackend, consumer_name
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import (
    Listeners,
    overlapping_runs,
    read_probe,
    trusted_home,
    wait_for,
    write_agent_config,
    write_probe_agent,
)
from proctor.mechanisms.queue.testing import runs_started as starts

ACK_WAIT = 30.0  # the lease: a failover (seconds) must not cost the running job its lease (0.6 of this)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path):
    c = server.start_cluster(tmp_path / "cluster")
    yield c
    c.stop()


@pytest.fixture
def fleet(proctor_home, repo, tmp_path, cluster):
    th = trusted_home(proctor_home)
    probe = tmp_path / "probe.jsonl"
    cfg = write_agent_config(tmp_path / "agents.toml", write_probe_agent(tmp_path / "fake-agent", probe))
    listeners = Listeners(cfg)
    yield th, probe, repo, lambda host: listeners.start(host, cluster.url, ack_wait_s=ACK_WAIT)
    listeners.stop(15)


def run(coro):
    return asyncio.run(coro)


async def _connect(url: str) -> JetStreamBackend:
    return await JetStreamBackend.connect(url, connect_timeout_s=10)


def enqueue(url, th, host, tasks, repo) -> list[str]:
    async def go():
        backend = await _connect(url)
        ids = []
        for i, task in enumerate(tasks):
            payload = {"agent": "fake", "task": task, "repo": str(repo), "ticket": f"T-{i}", "timeoutSec": 60}
            (sealed,) = sender.build(targets=[host], kind="run_agent", lane="default", payload=payload,
                                     signer=th.sender)
            ids.append((await sender.publish(backend, sealed)).job_id)
        await backend.close()
        return ids

    return run(go())


def wait_results(url, home, job_ids, timeout_s):
    async def go():
        backend = await _connect(url)
        try:
            trust = load_trust(home)
            return [await sender.wait(backend, trust, j, timeout_s) for j in job_ids]
        finally:
            await backend.close()

    return run(go())


def leaders(url) -> dict[str, str]:
    async def go():
        backend = await _connect(url)
        js = backend.nc.jetstream()
        try:
            out = {"stream": (await js.stream_info(STREAM)).cluster.leader}
            for b in BUCKETS:
                out[b] = (await js.stream_info(f"KV_{b}")).cluster.leader
            return out
        finally:
            await backend.close()

    return run(go())


def deliveries(url, host, lane="default") -> int:
    """How many deliveries the host's lane consumer has made: its consumer sequence counts each one,
    redeliveries included (the stream sequence counts each message once)."""
    async def go():
        backend = await _connect(url)
        try:
            info = await backend.nc.jetstream().consumer_info(STREAM, consumer_name(host, lane))
            return info.delivered.consumer_seq
        finally:
            await backend.close()

    return run(go())


def test_the_stream_and_every_bucket_have_three_replicas(cluster):
    async def go():
        backend = await _connect(cluster.url)
        js = backend.nc.jetstream()
        try:
            infos = [await js.stream_info(STREAM)] + [await js.stream_info(f"KV_{b}") for b in BUCKETS]
        finally:
            await backend.close()
        return infos

    for info in run(go()):
        assert info.config.num_replicas == 3, info.config.name
        assert info.cluster.leader and len(info.cluster.replicas) == 2, info.cluster


def test_a_cluster_of_two_gets_two_copies_not_a_refusal(tmp_path):
    two = server.start_cluster(tmp_path / "two", size=2)
    try:
        async def go():
            backend = await _connect(two.url)
            try:
                return (await backend.nc.jetstream().stream_info(STREAM)).config.num_replicas
            finally:
                await backend.close()

        assert run(go()) == 2  # three copies asked, no room for them: as many as the cluster has
    finally:
        two.stop()


def test_the_stream_leader_killed_mid_job_the_job_completes_once_and_nothing_queued_is_lost(fleet, cluster,
                                                                                          proctor_home):
    th, probe, repo, listen = fleet
    host = f"cl-{os.getpid()}"
    listener = listen(host)
    ids = enqueue(cluster.url, th, host, ["sleep 4", "sleep 0.2", "sleep 0.2"], repo)  # one slot: two queued
    wait_for(lambda: starts(probe), 60, "the first run to start")
    leader = leaders(cluster.url)["stream"]
    cluster.kill(cluster.node_of(leader))
    t0 = time.monotonic()
    results = wait_results(cluster.url, proctor_home, ids, 90)
    took = time.monotonic() - t0
    assert listener.poll() is None, listener.stderr.read().decode()[-2000:] if listener.stderr else ""
    assert all(r is not None and r.result.status is Status.completed for r in results), results
    events = read_probe(probe)
    assert len(starts(probe)) == 3, events  # each job ran once: none twice, none lost
    assert [e["how"] for e in events if e["event"] == "end"] == ["completed"] * 3
    assert not overlapping_runs(events)
    assert all(r.delivery == 1 for r in results), [r.delivery for r in results]
    new = leaders(cluster.url)["stream"]
    assert new != leader
    # The queued jobs did not wait out a lease: an ack lost in the failover held the 1-slot lane for the
    # whole ACK_WAIT, until the broker redelivered the finished job (35.6 s measured before acks were
    # confirmed; about 10 s since). A lease that ran out shows as a redelivery, whatever the machine's
    # load: three jobs, three deliveries (the count, not the clock; issue 24).
    assert deliveries(cluster.url, host) == 3, "a delivery was repeated: the lane waited for a lease to run out"
    print(f"\nstream leader {leader} killed; new leader {new}; 3 results {took:.1f} s after the kill")


def test_a_node_restarted_mid_job_costs_nothing(fleet, cluster, proctor_home):
    th, probe, repo, listen = fleet
    host = f"cr-{os.getpid()}"
    listen(host)
    first = enqueue(cluster.url, th, host, ["sleep 3"], repo)
    wait_for(lambda: starts(probe), 60, "the first run to start")
    victim = cluster.node_of(leaders(cluster.url)["proctor_results"])  # the node that leads the result bucket
    cluster.nodes[victim].stop()
    more = enqueue(cluster.url, th, host, ["sleep 0.2", "sleep 0.2"], repo)  # queued while a node is down
    cluster.restart(victim)
    results = wait_results(cluster.url, proctor_home, first + more, 90)
    assert all(r is not None and r.result.status is Status.completed for r in results), results
    events = read_probe(probe)
    assert len(starts(probe)) == 3 and not overlapping_runs(events)
    # The restarted node caught up: it holds the stream again as a current replica.
    async def current():
        backend = await _connect(cluster.url)
        try:
            info = await backend.nc.jetstream().stream_info(STREAM)
        finally:
            await backend.close()
        return info.cluster

    name = cluster.specs[victim].name
    wait_for(lambda: (lambda c: c.leader == name or any(p.name == name and p.current for p in c.replicas))(
        run(current())), 30, f"{name} to be a current replica again")
