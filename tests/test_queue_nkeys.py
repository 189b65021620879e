"""Per-host NKEY credentials on a real nats-server: a host's user reaches only that host's subjects."""

from __future__ import annotations

import asyncio
import json

import pytest

from proctor.contract import Status
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import sender, server
from proctor.mechanisms.queue.jetstream import BUCKETS, STREAM, JetStreamBackend, host_permissions
from proctor.services.listen.kinds import NoopRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.queue.testing import nkey_user, trusted_home

nkeys = pytest.importorskip("nkeys", reason="nats-py needs the `nkeys` package for NKEY auth")


@pytest.fixture
def fleet(tmp_path):
    admin_seed, admin_pub = nkey_user(tmp_path, "admin")
    a_seed, a_pub = nkey_user(tmp_path, "hostA")
    b_seed, b_pub = nkey_user(tmp_path, "hostB")
    config = tmp_path / "fleet.conf"
    config.write_text(json.dumps({"authorization": {"users": [
        {"nkey": admin_pub},
        {"nkey": a_pub, "permissions": host_permissions("hostA", ["default"])},
        {"nkey": b_pub, "permissions": host_permissions("hostB", ["default"])},
    ]}}))
    handle = server.start(tmp_path / "store", config_file=config)
    yield handle.url, admin_seed, a_seed
    handle.stop()


def test_host_credentials_reach_only_that_hosts_subjects(fleet, proctor_home):
    url, admin_seed, a_seed = fleet
    th = trusted_home(proctor_home)
    trust = load_trust(proctor_home)
    violations: list[str] = []

    async def on_error(exc: Exception) -> None:
        violations.append(str(exc))

    async def denied(coro) -> bool:
        try:
            await asyncio.wait_for(coro, 1.0)
        except Exception:  # noqa: BLE001 - a refusal surfaces as a timeout or an API error, either is a denial
            return True
        return False

    async def go():
        admin = await JetStreamBackend.connect(url, nkeys_seed=str(admin_seed))
        for host in ("hostA", "hostB"):
            await admin.ensure_lane(host, "default", slots=1, ack_wait_s=5)
        a = await JetStreamBackend.connect(url, manage=False, nkeys_seed=str(a_seed), inbox_prefix=b"_INBOX_hostA",
                                           error_cb=on_error)
        stop = asyncio.Event()
        listener = Listener(Settings("hostA", {"default": 1}, ack_wait_s=5), a, trust, th.host,
                            JobStore(proctor_home / "queue.sqlite3"), Ledger(proctor_home / "ledger.sqlite3"),
                            {"noop": NoopRunner()})
        task = asyncio.create_task(listener.serve(stop))
        (mine,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        job = await sender.publish(admin, mine)
        allowed = await sender.wait(admin, trust, job.job_id, 10)
        out = {
            "allowed": allowed,
            "fetch other host": await denied(a.ensure_lane("hostB", "default", slots=1, ack_wait_s=5)),
            "write other result": await denied(a.put_result("hostB.x", b"{}")),
            "write own result": await denied(a.put_result("hostA.x", b"{}")),
            "publish a job": await denied(a.publish("hostB", "default", "j-evil", b"{}")),
            "set a cancel flag": await denied(a.set_cancel("hostB.x", "no")),
            "stream admin": await denied(a.nc.jetstream().delete_stream(STREAM)),
        }
        stop.set()
        await task
        info = await admin.nc.jetstream().stream_info(STREAM)
        out["stream intact"] = info.config.name == STREAM and all(
            [await admin.nc.jetstream().stream_info(f"KV_{b}") for b in BUCKETS])
        await a.close()
        await admin.close()
        return out

    out = asyncio.run(go())
    assert out.pop("allowed").result.status is Status.completed  # the control: its own job, end to end
    assert out.pop("write own result") is False
    assert out.pop("stream intact") is True
    assert all(out.values()), out
    said = " ".join(violations).lower()
    for subject in ("$js.api.consumer.create.proctor_jobs.jobs_hostb_default", "$kv.proctor_results.hostb.x",
                    "proctor.jobs.hostb.default", "$kv.proctor_cancel.hostb.x", "$js.api.stream.delete"):
        assert f'permissions violation for publish to "{subject}' in said, (subject, violations)
