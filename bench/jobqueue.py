"""Queue bench: enqueue->start latency (p50, p99) and no-op jobs/s over 1,000 jobs, end to end through envelope
signing and verification, the listener's job store and ledger, and the signed result, beside the raw NATS
JetStream publish+fetch round trip on the same server.

Placements: `local` is this home's bundled server (`server.ensure_local`, as `proctor listen` uses by default,
with its token); `shared` is a second nats-server on another loopback port, reached by URL as a fleet would be;
`cluster` is a 3-node JetStream cluster on loopback (`server.start_cluster`), the job stream and buckets and
the raw bench's stream all replicated three times. The listener is a real `proctor listen` child process, so
the figures include its own event loop and SQLite commits.

    .venv/bin/python bench/jobqueue.py [--jobs 1000] [--latency-jobs 200] [--slots 16] [--senders 4]
                                    [--placements local,shared,cluster]

Prints one JSON document. Targets: p50 <= 2x raw, >= 300 no-op jobs/s. `noop_jobs_per_s` is one sender
publishing one job at a time (as before); `with_4_senders` is the same count of jobs from four senders at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig

from proctor.mechanisms.config.model import QueueSettings
from proctor.mechanisms.queue import connection, sender, server
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.mechanisms.queue.envelope import unseal
from proctor.mechanisms.queue.results import SignedResult, open_result
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import trusted_home

PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(xs, 50) * 1000, 3), "p99_ms": round(pct(xs, 99) * 1000, 3),
            "mean_ms": round(statistics.fmean(xs) * 1000, 3)}


async def raw_round_trip(url: str, n: int, replicas: int, **opts) -> dict[str, float]:
    """Publish one message and fetch it from a durable pull consumer, n times: the engine's own floor."""
    nc = await nats.connect(servers=url.split(","), **opts)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="RAWBENCH", subjects=["rawbench.>"], retention=RetentionPolicy.WORK_QUEUE,
                                     num_replicas=replicas))
    await js.add_consumer("RAWBENCH", ConsumerConfig(durable_name="raw", name="raw", filter_subject="rawbench.x"))
    sub = await js.pull_subscribe_bind("raw", stream="RAWBENCH")
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await js.publish("rawbench.x", b"x" * 300, headers={"Nats-Msg-Id": f"raw-{i}"})
        (msg,) = await sub.fetch(1, timeout=5)
        times.append(time.perf_counter() - t0)
        await msg.ack()
    await js.delete_stream("RAWBENCH")
    await nc.close()
    return summary_ms(times)


async def end_to_end(url: str, home: Path, host: str, signer, n_latency: int, n_jobs: int,
                     n_senders: int = 1) -> dict[str, object]:
    trust = load_trust(home)
    backend = await JetStreamBackend.connect(url, **connection.options(url, QueueSettings(), home))
    watcher = await backend.kv["proctor_results"].watch(f"{host}.>")
    first = await watcher.updates(timeout=5)
    assert first is None, "results bucket should be empty for a fresh host"

    async def next_result() -> bytes:
        while True:
            entry = await watcher.updates(timeout=30)
            if entry is not None and entry.value:
                return entry.value

    def build(k: int):
        return [sender.build(targets=[host], kind="noop", lane="default", payload={}, signer=signer)[0]
                for _ in range(k)]

    # Warm-up: the listener's first fetch, SQLite pages, JIT-free but cache-warm paths.
    for s in build(20):
        await sender.publish(backend, s)
        await next_result()

    starts, round_trips = [], []
    for s in build(n_latency):
        t0 = time.time()
        job = await sender.publish(backend, s)
        raw = await next_result()
        t1 = time.time()
        res = open_result(raw, trust, host=host, job_id=job.job_id, envelope=job.digest)
        assert isinstance(res, SignedResult), res
        starts.append(res.started_at - t0)
        round_trips.append(t1 - t0)

    async def throughput(batch: list, senders: int) -> tuple[float, float, int]:
        """Enqueue `batch` from `senders` coroutines at once (each one publish at a time, as `proctor enqueue`
        does), then take every result: (enqueue seconds, seconds to the last result, results verified)."""
        t0 = time.perf_counter()
        digests = {}

        async def one_sender(part: list) -> None:
            for s in part:
                sent = await sender.publish(backend, s)
                digests[sent.job_id] = sent.digest

        await asyncio.gather(*(one_sender(batch[i::senders]) for i in range(senders)))
        enqueued = time.perf_counter() - t0
        raws = [await next_result() for _ in batch]
        elapsed = time.perf_counter() - t0
        ids = {json.loads(s.body)["jobId"] for s in batch}
        verified = 0
        for raw in raws:
            job_id = json.loads(unseal(raw).body)["jobId"]  # which job it claims; open_result then binds it
            res = open_result(raw, trust, host=host, job_id=job_id, envelope=digests.get(job_id))
            verified += isinstance(res, SignedResult) and job_id in ids and res.result.status.value == "completed"
        return enqueued, elapsed, verified

    enqueued, elapsed, verified = await throughput(build(n_jobs), 1)
    out = {
        "enqueue_to_start": summary_ms(starts),
        "enqueue_to_signed_result": summary_ms(round_trips),
        "jobs": n_jobs,
        "enqueue_per_s": round(n_jobs / enqueued, 1),
        "noop_jobs_per_s": round(n_jobs / elapsed, 1),
        "results_verified": verified,
    }
    if n_senders > 1:
        # One sender waits for each publish's acknowledgement (the stream's, then the job record's) before the
        # next, so its rate is bounded by those round trips, not by the listener: several at once show what
        # the listener and the server sustain.
        enqueued, elapsed, verified = await throughput(build(n_jobs), n_senders)
        out[f"with_{n_senders}_senders"] = {"enqueue_per_s": round(n_jobs / enqueued, 1),
                                            "noop_jobs_per_s": round(n_jobs / elapsed, 1),
                                            "results_verified": verified}
    await watcher.stop()
    await backend.close()
    return out


def listener(url: str, host: str, slots: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([*PROCTOR, "listen", "--host", host, "--lanes", f"default={slots}", "--ack-wait", "30",
                             "--queue", url], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_listening(url: str, host: str, **opts) -> None:
    nc = await nats.connect(servers=url.split(","), **opts)
    js = nc.jetstream()
    for _ in range(200):
        try:
            await js.consumer_info("PROCTOR_JOBS", f"jobs_{host}_default")
            break
        except Exception:  # noqa: BLE001 - not created yet
            await asyncio.sleep(0.05)
    await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--latency-jobs", type=int, default=200)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--senders", type=int, default=4, help="a second throughput run with this many senders at once")
    ap.add_argument("--placements", default="local,shared,cluster", help="comma-separated: local,shared,cluster")
    args = ap.parse_args()
    wanted = set(args.placements.split(","))

    home = Path(tempfile.mkdtemp(prefix="proctor-bench-"))
    os.environ["PROCTOR_HOME"] = str(home)
    th = trusted_home(home)
    env = {**os.environ, "PROCTOR_HOME": str(home)}
    local_url = server.ensure_local(home)
    shared = server.start(home / "shared-nats") if "shared" in wanted else None
    cluster = server.start_cluster(home / "cluster") if "cluster" in wanted else None
    out: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    try:
        placements = [("local", local_url, 1)]
        placements += [("shared", shared.url, 1)] if shared else []
        placements += [("cluster", cluster.url, 3)] if cluster else []
        for name, url, replicas in placements:
            if name not in wanted:
                continue
            host = f"bench-{name}"
            opts = {k: v for k, v in connection.options(url, QueueSettings(), home).items() if k == "token"}
            proc = listener(url, host, args.slots, env)
            try:
                asyncio.run(wait_listening(url, host, **opts))
                raw = asyncio.run(raw_round_trip(url, args.latency_jobs, replicas, **opts))
                e2e = asyncio.run(end_to_end(url, home, host, th.sender, args.latency_jobs, args.jobs, args.senders))
            finally:
                proc.terminate()
                proc.wait(10)
            ratio = e2e["enqueue_to_start"]["p50_ms"] / raw["p50_ms"]  # type: ignore[index]
            out[name] = {"url": url, "raw_publish_fetch": raw, **e2e, "p50_vs_raw": round(ratio, 2),
                         "targets_met": {"p50<=2x_raw": ratio <= 2.0, ">=300_jobs_per_s": e2e["noop_jobs_per_s"] >= 300}}
    finally:
        if shared:
            shared.stop()
        if cluster:
            cluster.stop()
        server.stop_local(home)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
