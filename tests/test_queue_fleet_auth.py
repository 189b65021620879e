"""A fleet server as proctor.mechanisms.queue.fleet configures it: TLS for every client (a throw-away CA made with
`cryptography`, client certificates required) and one NKEY user per host and per sender. Each refusal sits
beside a control in which the same identity, or the one entitled to it, does the same thing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import nats
import pytest

from proctor.mechanisms.config.model import QueueSettings
from proctor.contract import Code
from proctor.mechanisms.queue import connection, sender
from proctor.mechanisms.queue.backend import record_key
from proctor.mechanisms.queue.fleet import sender_permissions
from proctor.mechanisms.queue.jetstream import STREAM, JetStreamBackend
from proctor.mechanisms.queue.signers import load_trust
from proctor.mechanisms.queue.testing import start_fleet, read_probe, throwaway_ca, trusted_home, write_probe_agent

nkeys = pytest.importorskip("nkeys")
PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fleet(tmp_path):
    fleet = start_fleet(tmp_path, {"alice": None})
    url, settings, ids, ca = fleet.url, fleet.settings, fleet.ids, fleet.ca
    try:
        yield url, ca, ids, settings
    finally:
        fleet.handle.stop()


async def as_user(url, settings, seed, name, **kw):
    opts = {"tls": connection.tls_context(settings), "nkeys_seed": str(seed),
            "inbox_prefix": f"_INBOX_{name}".encode()}
    return await JetStreamBackend.connect(url, manage=False, **opts, **kw)


async def denied(coro) -> bool:
    try:
        await asyncio.wait_for(coro, 1.5)
    except Exception:  # noqa: BLE001 - a refusal is a timeout or an API error: either way it did not happen
        return True
    return False


def test_only_a_tls_client_with_a_certificate_of_the_fleets_ca_connects(fleet, tmp_path):
    url, ca, ids, settings = fleet
    other = throwaway_ca(tmp_path / "other-pki")

    async def attempt(**kw) -> bool:
        try:
            nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False,
                                    nkeys_seed=str(ids["admin"][0]), **kw)
        except Exception:  # noqa: BLE001 - refused: TLS, certificate or auth error
            return False
        await nc.close()
        return True

    async def go():
        plain = await attempt()  # no TLS at all (the URL's tls:// is upgraded only with a context)
        no_cert = await attempt(tls=connection.tls_context(QueueSettings(tls_ca=str(ca.ca))))
        wrong_ca = await attempt(tls=connection.tls_context(QueueSettings(
            tls_ca=str(other.ca), tls_cert=str(ca.client_cert), tls_key=str(ca.client_key))))
        foreign_cert = await attempt(tls=connection.tls_context(QueueSettings(
            tls_ca=str(ca.ca), tls_cert=str(other.client_cert), tls_key=str(other.client_key))))
        ok = await attempt(tls=connection.tls_context(settings))
        return plain, no_cert, wrong_ca, foreign_cert, ok

    plain, no_cert, wrong_ca, foreign_cert, ok = asyncio.run(go())
    assert ok, "the control: the fleet's own certificate and CA connect"
    assert not plain and not no_cert and not wrong_ca and not foreign_cert


def test_a_tls_url_without_a_ca_is_a_clear_error():
    with pytest.raises(connection.QueueConnectionError, match="tls_ca"):
        connection.options("tls://127.0.0.1:4222", QueueSettings(), None)  # type: ignore[arg-type]


def test_a_host_reads_only_its_own_subjects_and_cannot_cancel_or_answer_for_another(fleet, proctor_home):
    url, ca, ids, settings = fleet
    th = trusted_home(proctor_home)
    seen: dict[str, list[bytes]] = {"own": [], "other": []}
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    async def go():
        alice = await as_user(url, settings, ids["alice"][0], "alice")
        a = await as_user(url, settings, ids["hostA"][0], "hostA", error_cb=on_error)
        for host in ("hostA", "hostB"):
            (job,) = sender.build(targets=[host], kind="noop", lane="default", payload={}, signer=th.sender)
            await sender.publish(alice, job)
        await a.ensure_lane("hostA", "default", slots=1, ack_wait_s=30)
        own = await a.fetch("hostA", "default", 1, 3)  # the control: its own lane's job arrives
        out = {
            "own job fetched": len(own) == 1,
            "other lane denied": await denied(a.ensure_lane("hostB", "default", slots=1, ack_wait_s=30)),
            "cancel denied": await denied(a.set_cancel("hostB.some-job", "stop")),
            "other result denied": await denied(a.put_result("hostB.some-job", b"{}")),
        }
        # A raw subscription to another host's job subject is refused by the server (core NATS); the
        # admin's same subscription, the control, sees the next job for hostB.
        admin = await JetStreamBackend.connect(url, tls=connection.tls_context(settings),
                                               nkeys_seed=str(ids["admin"][0]), manage=False)

        async def mine(m):
            seen["own"].append(m.data)

        async def theirs(m):
            seen["other"].append(m.data)

        sub = await a.nc.subscribe("proctor.jobs.hostB.>", cb=theirs)
        watch = await admin.nc.subscribe("proctor.jobs.hostB.>", cb=mine)
        await a.nc.flush()
        await admin.nc.flush()
        await asyncio.sleep(0.3)
        (again,) = sender.build(targets=["hostB"], kind="noop", lane="default", payload={}, signer=th.sender)
        await sender.publish(alice, again)
        await asyncio.sleep(0.5)
        await watch.unsubscribe()
        await admin.close()
        out["own result allowed"] = not await denied(a.put_result("hostA.x", b"{}"))
        await sub.unsubscribe()
        await a.close()
        await alice.close()
        return out

    out = asyncio.run(go())
    assert out.pop("own job fetched") and out.pop("own result allowed")
    assert all(out.values()), out
    assert any("permissions violation for subscription" in e.lower() and "proctor.jobs.hostb" in e.lower()
               for e in errors), errors
    assert seen["other"] == [] and len(seen["own"]) == 1


def test_a_sender_enqueues_and_cancels_but_cannot_answer_or_administer(fleet, proctor_home):
    url, ca, ids, settings = fleet
    th = trusted_home(proctor_home)

    async def go():
        alice = await as_user(url, settings, ids["alice"][0], "alice")
        (job,) = sender.build(targets=["hostA"], kind="noop", lane="default", payload={}, signer=th.sender)
        out = {
            "enqueue allowed": not await denied(sender.publish(alice, job)),
            "cancel flag allowed": not await denied(alice.set_cancel("hostA.j1", "stop")),
            "result denied": await denied(alice.put_result("hostA.j1", b"{}")),
            "running denied": await denied(alice.put_running("hostA.j1", b"{}")),
            "consumer denied": await denied(alice.ensure_lane("hostA", "default", slots=1, ack_wait_s=30)),
            "stream admin denied": await denied(alice.nc.jetstream().delete_stream(STREAM)),
        }
        await alice.close()
        return out

    out = asyncio.run(go())
    assert out.pop("enqueue allowed") and out.pop("cancel flag allowed")
    assert all(out.values()), out
    limited = sender_permissions("bob", ["hostA"])["publish"]["allow"]
    assert "proctor.jobs.hostA.>" in limited and "proctor.jobs.>" not in limited


def test_end_to_end_over_tls_a_host_cannot_cancel_another_hosts_job_and_its_sender_can(fleet, tmp_path, repo,
                                                                                       proctor_home):
    url, ca, ids, settings = fleet
    trusted_home(proctor_home)
    probe = tmp_path / "probe.jsonl"
    agent = write_probe_agent(tmp_path / "fake-agent", probe)
    tls = (f'tls_ca = "{ca.ca}"\ntls_cert = "{ca.client_cert}"\ntls_key = "{ca.client_key}"\n'
           f'servers = ["{url}"]\n')
    host_cfg = tmp_path / "host.toml"
    host_cfg.write_text(f'confine = "off"\n\n[agents.fake]\ncommand = [{json.dumps(str(agent))}, "{{prompt}}"]\n'
                        f'prompt = "argv"\n\n[queue]\n{tls}nkey_seed = "{ids["hostA"][0]}"\nname = "hostA"\n')
    sender_cfg = tmp_path / "sender.toml"
    sender_cfg.write_text(f'[queue]\n{tls}nkey_seed = "{ids["alice"][0]}"\nname = "alice"\n')
    env = {**os.environ, "PROCTOR_CONFIG": str(sender_cfg)}
    listener = subprocess.Popen([*PROCTOR, "listen", "--host", "hostA", "--ack-wait", "30", "--config",
                                 str(host_cfg)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    try:
        payload = tmp_path / "job.json"
        payload.write_text(json.dumps({"agent": "fake", "task": "sleep 30", "repo": str(repo), "ticket": "T-1",
                                       "timeoutSec": 60}))
        p = subprocess.run([*PROCTOR, "enqueue", "--targets", "hostA", "--payload-file", str(payload)],
                           capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        job_id = p.stdout.strip()
        deadline = time.monotonic() + 60
        while not [e for e in read_probe(probe) if e["event"] == "start"]:
            assert time.monotonic() < deadline and listener.poll() is None, listener.stderr.read().decode()[-3000:]
            time.sleep(0.1)

        async def host_b_cancels():
            b = await as_user(url, settings, ids["hostB"][0], "hostB")
            try:
                return await denied(b.set_cancel(record_key("hostA", job_id), "hostB says stop"))
            finally:
                await b.close()

        assert asyncio.run(host_b_cancels())
        time.sleep(1.0)
        assert [e["event"] for e in read_probe(probe)] == ["start"], "another host's cancel reached the job"
        # The control: the job's own sender cancels it, over the same TLS server, with its own user.
        p = subprocess.run([*PROCTOR, "cancel", job_id, "--reason", "alice stops it"], capture_output=True,
                           text=True, env=env, timeout=60)
        assert p.returncode == 0, p.stderr

        async def result():
            alice = await as_user(url, settings, ids["alice"][0], "alice")
            try:
                return await sender.wait(alice, load_trust(proctor_home), job_id, 60)
            finally:
                await alice.close()

        res = asyncio.run(result())
        assert res is not None and res.result.code is Code.CANCELLED, res
        assert "alice stops it" in json.dumps(res.result.model_dump(mode="json")), res.result
    finally:
        listener.terminate()
        listener.wait(15)
