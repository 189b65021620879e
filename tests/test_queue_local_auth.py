"""The bundled local server requires this home's token: another local user (anyone who reaches the loopback
port without it) cannot connect, so cannot read, purge, cancel or answer anything on it."""

from __future__ import annotations

import asyncio
import json
import stat

import nats
import pytest

from proctor.mechanisms.config.model import QueueSettings
from proctor.mechanisms.queue import connection, server
from proctor.mechanisms.queue.jetstream import STREAM, JetStreamBackend


@pytest.fixture
def local(proctor_home):
    url = server.ensure_local(proctor_home)
    yield url
    server.stop_local(proctor_home)


def test_the_bundled_server_refuses_a_client_without_the_token(local, proctor_home):
    token_file = proctor_home / "nats" / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((proctor_home / "nats" / "server.conf").stat().st_mode) == 0o600

    async def go():
        with pytest.raises(Exception) as refused:  # noqa: PT011 - nats-py raises its own auth errors
            nc = await nats.connect(local, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
            await nc.close()
        # The control: this home's options carry the token, and the same server answers.
        opts = connection.options(local, QueueSettings(), proctor_home)
        assert opts["token"] == token_file.read_text().strip()
        backend = await JetStreamBackend.connect(local, **opts)
        info = await backend.nc.jetstream().stream_info(STREAM)
        await backend.close()
        return refused.value, info

    refused, info = asyncio.run(go())
    assert "authorization" in str(refused).lower() or "auth" in type(refused).__name__.lower(), refused
    assert info.config.name == STREAM
    # Reuse: a second call finds the running server and does not start another.
    assert server.ensure_local(proctor_home) == local


def test_a_server_started_without_auth_is_restarted_with_it_and_keeps_its_queue(proctor_home):
    nats_dir = proctor_home / "nats"
    old = server.start(nats_dir / "store")  # as an older proctor started it: no authorization at all
    (nats_dir / "server.json").write_text(json.dumps({"url": old.url, "pid": old.pid, "port": old.port}))

    async def queue_one():
        b = await JetStreamBackend.connect(old.url)
        await b.publish("h1", "default", "job-before-upgrade", b"{}")
        await b.close()

    asyncio.run(queue_one())
    try:
        url = server.ensure_local(proctor_home)
        assert json.loads((nats_dir / "server.json").read_text())["auth"] == "token"

        async def count():
            b = await JetStreamBackend.connect(url, **connection.options(url, QueueSettings(), proctor_home))
            info = await b.nc.jetstream().stream_info(STREAM)
            await b.close()
            return info.state.messages

        assert asyncio.run(count()) == 1  # the job queued before the restart is still there
    finally:
        server.stop_local(proctor_home)
        old.stop()
