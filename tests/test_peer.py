"""A local peer is its uid, and not a job (issue 41): `proctor serve` attributes every loopback connection when
it accepts it, by the kernel's exact-4-tuple `sock_diag` lookup of the client's socket (uid, inode, TCP state,
cgroup), never by its address or port. Real sockets, a real process in a real job cgroup; the second local
user is in tests/test_review_access.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest
from review_site import Server

from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.confine.peer import job_cgroups, refusal, tcp_peer

ME = os.geteuid()


def pair(family: int = socket.AF_INET, host: str = "127.0.0.1", connect_to: str | None = None):
    srv = socket.socket(family)
    if family == socket.AF_INET6:
        srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.bind((host, 0))
    srv.listen()
    client = socket.create_connection((connect_to or host, srv.getsockname()[1]))
    conn, peer = srv.accept()
    return srv, client, conn, peer


def test_a_loopback_client_is_known_by_its_sockets_uid_and_a_closed_one_by_nothing():
    srv, client, conn, peer = pair()
    try:
        found = tcp_peer(peer, conn.getsockname())
        assert found is not None and found.uid == ME and found.inode > 0 and found.state == 1, found
        assert refusal(found, [ME]) is None  # the control: the install's own user passes
        assert "from uid" in (refusal(found, [ME + 4242]) or "")
        client.close()  # a client that already closed reads as uid 0, inode 0: never a pass, even for root
        gone = tcp_peer(peer, conn.getsockname())
        assert gone is not None and gone.inode == 0 and "not live" in (refusal(gone, [ME, 0]) or ""), gone
    finally:
        for s in (client, conn, srv):
            s.close()


def test_an_ipv4_client_of_a_dual_stack_server_is_found():
    srv, client, conn, peer = pair(socket.AF_INET6, "::", "127.0.0.1")
    try:
        assert peer[0] == "::ffff:127.0.0.1"
        found = tcp_peer(peer, conn.getsockname())
        assert found is not None and found.uid == ME and found.inode > 0, found
    finally:
        for s in (client, conn, srv):
            s.close()


CONNECT = "import socket, sys, time\ns = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\nsys.stdin.read()\n"
GET = ("import sys, urllib.request, urllib.error\ntry:\n    r = urllib.request.urlopen(sys.argv[1]); print(r.status)\n"
       "except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode()[:300])\n"
       "except Exception as e:\n    print('error', e)\n")


def in_job(argv: list[str], group: cgroup.JobGroup | None, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, preexec_fn=group.join_child if group else None,
                            pass_fds=group.fds() if group else (), **kw)


@pytest.fixture
def group():
    g = cgroup.JobGroup.create(cgroup.group_name("peertest"))
    if g is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no writable cgroup v2 here: a job's cgroup cannot be made")
        pytest.skip("no writable cgroup v2 here")
    yield g
    g.kill()
    g.remove()


def test_a_connection_made_from_a_jobs_cgroup_is_an_agents(group):
    """An agent runs as the person's own uid: its uid alone would pass. Its socket's cgroup is its job's."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    for g, refused in ((None, False), (group, True)):  # the control first: the same child outside any job
        child = in_job([sys.executable, "-c", CONNECT, str(srv.getsockname()[1])], g, stdin=subprocess.PIPE)
        conn, peer = srv.accept()
        try:
            found = tcp_peer(peer, conn.getsockname())
            assert found is not None and found.uid == ME, found
            assert (found.cgroup in job_cgroups()) is refused, (found, job_cgroups())
            assert (refusal(found, [ME]) is not None) is refused
        finally:
            conn.close()
            child.communicate(b"", timeout=30)
    srv.close()


def test_serve_refuses_a_request_from_inside_a_job_before_reading_it(group):
    server = Server()
    try:
        url = f"{server.base}/review"
        outside = subprocess.run([sys.executable, "-c", GET, url], capture_output=True, text=True, timeout=60)
        inside = in_job([sys.executable, "-c", GET, url], group, stdout=subprocess.PIPE, text=True)
        out, _ = inside.communicate(timeout=60)
        mine = httpx.get(url)
    finally:
        server.stop()
    assert outside.stdout.startswith("401"), outside.stdout  # the control: past the door, at the sign-in page
    assert mine.status_code == 401
    assert out.startswith("403") and "PEER_REFUSED" in out and "inside a proctor job" in out, out
