"""A server is proctor's before it gets a secret (issue 21, item 7): after the bundled nats-server dies, the
recorded pid and port prove nothing — another local user can listen on the freed port, and a pid is reused.
Here a real second user (made with useradd, removed after) listens on the recorded port and the record is
rewritten to its pid: proctor sends it nothing holding the token, and ends up on a fresh server of its own
on a fresh port, with the queue it had. Control: a plain SIGKILL, no impostor, and proctor is back on its
own server the same way."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from conftest import wait_until

from proctor.mechanisms.config.model import QueueSettings
from proctor.mechanisms.queue import connection, server
from proctor.mechanisms.queue.jetstream import STREAM, JetStreamBackend

# Listens on the port it is given, greets like a NATS server (so a client goes on to send its CONNECT), and
# appends every byte it receives to its log; `ready` is printed once it listens.
IMPOSTOR = r"""
import socket, sys, threading
port, log = int(sys.argv[1]), sys.argv[2]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(16)
print("ready", flush=True)
def serve(c):
    with open(log, "ab") as f:
        f.write(b"<accepted>\n")
    c.sendall(b'INFO {"server_id":"NIMPOSTOR","version":"2.10.0","proto":1,"host":"127.0.0.1","port":%d,'
              b'"max_payload":1048576,"auth_required":true}\r\n' % port)
    c.settimeout(10)
    while True:
        try:
            b = c.recv(65536)
        except OSError:
            break
        if not b:
            break
        with open(log, "ab") as f:
            f.write(b)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def python_for(user: pwd.struct_passwd | None) -> str:
    """An interpreter `user` can run (this one may sit under root's 0700 home)."""
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3", shutil.which("python3") or ""):
        try:
            if candidate and subprocess.run([candidate, "-I", "-S", "-c", "pass"], check=False,
                                            **as_user(user)).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.fail(f"no python {user.pw_name if user else 'this user'} can run")


def as_user(user: pwd.struct_passwd | None) -> dict:
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "cwd": user.pw_dir}


class Impostor:
    """A listener on `port`, as `user` (None: this user), logging what it receives under `dir`."""

    def __init__(self, port: int, dir: Path, user: pwd.struct_passwd | None) -> None:
        self.log = dir / "impostor.log"
        self.proc = subprocess.Popen([python_for(user), "-I", "-S", "-c", IMPOSTOR, str(port), str(self.log)],
                                     stdout=subprocess.PIPE, text=True, **as_user(user))
        assert self.proc.stdout.readline().strip() == "ready"
        self.port = port

    def heard(self) -> bytes:
        return self.log.read_bytes() if self.log.exists() else b""

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def backend_call(url: str, home: Path, op):
    async def go():
        b = await JetStreamBackend.connect(url, connect_timeout_s=5,
                                           **connection.options(url, QueueSettings(), home))
        try:
            return await op(b)
        finally:
            await b.close()

    return asyncio.run(go())


async def queued(b: JetStreamBackend) -> int:
    return (await b.nc.jetstream().stream_info(STREAM)).state.messages


def crash(home: Path) -> dict:
    """The bundled server, with one job queued on it, killed as a crash kills it. Its record is returned."""
    url = server.ensure_local(home)
    backend_call(url, home, lambda b: b.publish("h1", "default", "job-before-the-crash", b"{}"))
    doc = json.loads((home / "nats" / "server.json").read_text())
    assert server.recognise(doc, home / "nats") is None  # our own, live server is recognised
    os.kill(doc["pid"], signal.SIGKILL)
    try:
        os.waitpid(doc["pid"], 0)  # it is this process's child: reap it, so the pid is really gone
    except ChildProcessError:
        pass
    return doc


def back_on_our_own(home: Path, old: dict, avoid_port: int | None) -> str:
    url = connection.servers(None, QueueSettings(), home)  # what every command does: ensure_local
    doc = json.loads((home / "nats" / "server.json").read_text())
    assert doc["url"] == url and doc["pid"] != old["pid"] and server.recognise(doc, home / "nats") is None
    if avoid_port is not None:
        assert doc["port"] != avoid_port
    assert "token" in connection.options(url, QueueSettings(), home)
    assert backend_call(url, home, queued) == 1  # the queue survived the crash, on a server that works
    return url


@pytest.fixture
def home(proctor_home):
    yield proctor_home
    server.stop_local(proctor_home)


def stale_client_connects(url: str, home: Path) -> None:
    """A client of the old record (a command started with its URL): connects with the options proctor gives
    for that URL. The impostor is no NATS server, so this fails; what matters is what it was sent."""
    async def go():
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                                **connection.options(url, QueueSettings(), home))
        await nc.close()

    with pytest.raises(Exception):  # noqa: PT011 - nats-py's own errors for a server that never says PONG
        asyncio.run(go())


# useradd/userdel lock /etc/passwd and fail at once on a held lock: one worker for them under xdist.
@pytest.mark.xdist_group("useradd")
def test_another_users_listener_on_the_recorded_pid_and_port_never_gets_the_token(home, other_user):
    old = crash(home)
    token = (home / "nats" / "token").read_text().strip()
    impostor = Impostor(old["port"], Path(other_user.pw_dir), other_user)
    try:
        # Pids are reused: the record now names the other user's process, which holds the recorded port.
        (home / "nats" / "server.json").write_text(json.dumps({**old, "pid": impostor.proc.pid}))
        why = server.recognise({**old, "pid": impostor.proc.pid}, home / "nats")
        assert why and f"uid {other_user.pw_uid}" in why, why
        assert "token" not in connection.options(old["url"], QueueSettings(), home)
        stale_client_connects(old["url"], home)
        back_on_our_own(home, old, avoid_port=old["port"])
        # It logs what it heard as it reads: wait for the CONNECT itself (bounded), then look at all of it.
        heard = wait_until(lambda: b"CONNECT" in impostor.heard() and impostor.heard(), 60, "the impostor's log")
    finally:
        impostor.stop()
    assert b"CONNECT" in heard, heard[:500]  # it was reached, and what it heard...
    assert token.encode() not in heard and b"auth_token" not in heard, heard[:500]  # ...held no token
    assert impostor.proc.returncode == -signal.SIGKILL  # we never signalled it: the test's own kill ended it


def test_a_listener_of_this_user_that_is_not_the_bundled_server_is_not_reused(home, tmp_path):
    """Same uid, wrong executable: pid reuse by any process of ours; it is neither reused nor signalled."""
    old = crash(home)
    impostor = Impostor(old["port"], tmp_path, None)
    try:
        (home / "nats" / "server.json").write_text(json.dumps({**old, "pid": impostor.proc.pid}))
        why = server.recognise({**old, "pid": impostor.proc.pid}, home / "nats")
        assert why and "not the bundled" in why, why
        back_on_our_own(home, old, avoid_port=old["port"])
        assert impostor.proc.poll() is None
        assert server.stop_local(home) is True and impostor.proc.poll() is None
    finally:
        impostor.stop()
    assert b"CONNECT" not in impostor.heard()


def test_control_after_a_plain_sigkill_proctor_is_back_on_its_own_server(home):
    old = crash(home)
    url = back_on_our_own(home, old, avoid_port=None)
    assert server.ensure_local(home) == url  # and reuses it while it runs

