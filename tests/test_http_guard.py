"""The HTTP guard (`proctor.surfaces.api.guard`) against hostile clients, on real processes: the API runs in its own
Python process under uvicorn (`guard.server_config` with short deadlines and a small body cap), the clients
are raw sockets and httpx in this one, and the server's memory and descriptors are read with psutil.

Each attack has a control beside it, a legitimate client on the same server that is still answered:
a body too large (declared or streamed chunked) is a 413 and does not grow the server; half-sent requests
(slowloris) do not starve anyone and are cut off with a 408; a connection over the cap is a 503 at accept;
a foreign Host (DNS rebinding) is a 421 and a foreign Origin a 403; JSON numbers no float can hold are a 400.
Every refusal is JSON `{"code", "detail"}`.
"""

from __future__ import annotations

import base64
import asyncio
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from proctor.mechanisms.queue import keys, sender, server
from proctor.mechanisms.queue.testing import trusted_home

HOST = "guardhost"
ALLOWED = "proctor.example"  # the operator's extra name (`--allow-host`)
LIMITS = {"header_timeout_s": 2.0, "body_timeout_s": 2.0, "keep_alive_s": 5, "max_body_bytes": 256 * 1024,
          "max_header_bytes": 8 * 1024}
MIB = 1024 * 1024
CAP = 4  # the capped server's max_connections

# The server process: the real app (MemoryBackend queue, trust from the given home) served by uvicorn with
# the guard's config on a socket it binds itself, so the port it prints is the one it holds (no race).
SERVER = r"""
import json, resource, socket, sys
from pathlib import Path
import uvicorn
from proctor.surfaces.api.app import create_app
from proctor.surfaces.api.guard import HttpLimits, server_config
from proctor.mechanisms.queue.memory import MemoryBackend
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import load_trust

spec = json.loads(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft != resource.RLIM_INFINITY and soft < spec["nofile"]:
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"] if hard == resource.RLIM_INFINITY
                                                else min(spec["nofile"], hard), hard))
limits = HttpLimits(**spec["limits"])
home = Path(spec["home"])

async def backend():
    queue = MemoryBackend()
    await queue.ensure_lane(spec["host"], "default", slots=1, ack_wait_s=30)  # a listener opened it
    return queue

app = create_app(backend, load_trust(home), SentStore(home), bind="127.0.0.1", allow_hosts=spec["allow"],
                 limits=limits, read_token=spec["token"])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
print(json.dumps({"port": port, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                  "cap": limits.connection_cap()}), flush=True)
uvicorn.Server(server_config(app, "127.0.0.1", port, limits)).run(sockets=[sock])
"""


def raise_nofile(want: int) -> None:
    """This process holds hundreds of client sockets: make sure its soft descriptor limit allows them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == resource.RLIM_INFINITY or soft >= want, f"RLIMIT_NOFILE {soft} < {want} and cannot be raised"


# -- raw HTTP ------------------------------------------------------------------------------------------------


def read_until_closed(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (an RST after its answer counts as a close)."""
    sock.settimeout(timeout_s)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    else:
        raise AssertionError(f"the server did not close the connection within {timeout_s} s; got {bytes(out)[:300]!r}")
    return bytes(out)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def parse(raw: bytes) -> Reply:
    """The first final response in `raw` (no 1xx may come before it: nothing here asks for 100-continue)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response: {raw[:300]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", len(rest)))
    return Reply(status, headers, rest[:length])


def exchange(port: int, request: bytes, timeout_s: float = 10.0) -> Reply:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        return parse(read_until_closed(sock, timeout_s))


READ_TOKEN = "r" * 43  # the served app's install token: /v1 reads need it (or a read signed by the sender)
BEARER = {"Authorization": f"Bearer {READ_TOKEN}"}


def get(port: int, path: str = "/v1/jobs/nope", host: str | None = None, extra: str = "") -> bytes:
    host = f"127.0.0.1:{port}" if host is None else host
    auth = f"Authorization: Bearer {READ_TOKEN}\r\n"
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}{extra}Connection: close\r\n\r\n".encode()


def problem(reply: Reply | httpx.Response, status: int, code: str) -> dict:
    """A refusal: that status, a JSON body of exactly {"code", "detail"}, that code."""
    body = reply.body if isinstance(reply, Reply) else reply.content
    got = reply.status if isinstance(reply, Reply) else reply.status_code
    assert got == status, (got, body[:300])
    ctype = reply.headers.get("content-type", "")
    assert ctype.startswith("application/json"), (ctype, body[:300])
    doc = json.loads(body)
    assert set(doc) == {"code", "detail"} and doc["code"] == code and doc["detail"], doc
    return doc


# -- the server process ------------------------------------------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    home: Path
    cap: int
    nofile: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ps(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    def envelope(self) -> dict:
        (sealed,) = sender.build(targets=[HOST], kind="noop", lane="default", payload={},
                                 signer=keys.load("default", self.home))
        return sealed.to_dict()

    def post(self, payload: dict | bytes, **headers: str) -> bytes:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        head = {"Host": f"127.0.0.1:{self.port}", "Content-Type": "application/json",
                "Content-Length": str(len(body)), "Connection": "close", **headers}
        return b"POST /v1/jobs HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + \
            b"\r\n" + body


def start_server(root: Path, home: Path, limits: dict, allow: tuple[str, ...] = (), nofile: int = 4096) -> Served:
    log = root / f"server-{time.monotonic_ns()}.log"
    spec = {"limits": limits, "home": str(home), "allow": list(allow), "nofile": nofile, "token": READ_TOKEN, "host": HOST}
    env = {**os.environ, "PROCTOR_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=log.open("wb"), env=env, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"the server did not start: {log.read_text()[-2000:]}")
    info = json.loads(line)
    served = Served(proc, info["port"], home, info["cap"], info["nofile"])
    deadline = time.monotonic() + 60  # a bound for a broken start only
    while True:  # ready when a whole request is answered (and the connection closed: the cap counts it no more)
        try:
            if exchange(served.port, get(served.port), 5).status == 404:
                return served
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(served)
            raise AssertionError(f"the server never answered: {log.read_text()[-2000:]}")
        time.sleep(0.05)  # polling a port that is not listening yet


def stop_server(served: Served) -> None:
    served.proc.terminate()
    try:
        served.proc.wait(10)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait(10)
    if served.proc.stdout:
        served.proc.stdout.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("guard-home")
    trusted_home(home)
    return home


@pytest.fixture(scope="module")
def srv(tmp_path_factory, home):
    raise_nofile(2048)
    served = start_server(tmp_path_factory.mktemp("guard-server"), home, LIMITS, allow=(ALLOWED,))
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def capped(tmp_path_factory, home):
    """A second server: at most CAP open connections, a 24 MiB body cap, the default header deadline."""
    served = start_server(tmp_path_factory.mktemp("capped-server"), home,
                          {"max_connections": CAP, "max_body_bytes": 24 * MIB})
    assert served.cap == CAP
    yield served
    stop_server(served)


def assert_accepted(served: Served) -> None:
    """The control: a legitimate, signed envelope is taken (202) by the same server."""
    reply = exchange(served.port, served.post(served.envelope()))
    assert reply.status == 202, reply
    assert reply.json()["target"] == HOST


# -- (a) body size -----------------------------------------------------------------------------------------


def test_a_declared_128_mib_body_is_refused_413_before_it_is_sent(srv):
    assert_accepted(srv)
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {128 * MIB}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(head)  # headers only: the answer must come without a byte of the body
        started = time.monotonic()
        reply = parse(read_until_closed(sock))
        took = time.monotonic() - started
    doc = problem(reply, 413, "BODY_TOO_LARGE")
    assert str(128 * MIB) in doc["detail"] and str(LIMITS["max_body_bytes"]) in doc["detail"]
    print(f"413 for a declared 128 MiB body after {took * 1000:.1f} ms, no body byte sent")
    # the cap is where it says: a body just under it gets past the guard (to the envelope check, 422)
    under = {**srv.envelope(), "pad": "x" * (LIMITS["max_body_bytes"] - 1000)}
    reply = exchange(srv.port, srv.post(under))
    problem(reply, 422, "INVALID_ENVELOPE")
    assert_accepted(srv)


class Streamer:
    """Sends `total` bytes of body after `head` from a thread, while the caller reads the answer; samples the
    server's RSS all along. Stops when the server closes (EPIPE/ECONNRESET) or everything was sent."""

    def __init__(self, served: Served, head: bytes, total: int, chunked: bool) -> None:
        self.served, self.head, self.total, self.chunked = served, head, total, chunked
        self.sent = 0
        self.error: str | None = None
        self.peak = self.growth = 0
        self.done = threading.Event()

    def send(self, sock: socket.socket) -> None:
        piece = b"x" * (64 * 1024)
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if self.chunked else piece
        try:
            sock.sendall(self.head)
            while self.sent < self.total:
                sock.sendall(frame)
                self.sent += len(piece)
            if self.chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError as exc:  # the server answered and closed: what it did not read, it never took
            self.error = type(exc).__name__
        finally:
            self.done.set()

    def sample(self, ps: psutil.Process) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, ps.memory_info().rss)
            self.done.wait(0.005)
        self.peak = max(self.peak, ps.memory_info().rss)

    def run(self) -> Reply:
        ps = self.served.ps
        baseline = ps.memory_info().rss
        with socket.create_connection(("127.0.0.1", self.served.port), timeout=20) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
            threads = [threading.Thread(target=self.send, args=(sock,), daemon=True),
                       threading.Thread(target=self.sample, args=(ps,), daemon=True)]
            for t in threads:
                t.start()
            raw = read_until_closed(sock, 20)
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a sender still in sendall
            except OSError:
                pass  # already reset by the server
            for t in threads:
                t.join(20)
        self.growth = self.peak - baseline
        return parse(raw)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_streamed_128_mib_body_is_refused_413_and_does_not_grow_the_server(srv, chunked):
    assert_accepted(srv)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {128 * MIB}"
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()
    streamer = Streamer(srv, head, 128 * MIB, chunked)
    reply = streamer.run()
    print(f"{'chunked' if chunked else 'content-length'}: {reply.status} after the client sent "
          f"{streamer.sent / MIB:.2f} MiB of 128 MiB ({streamer.error or 'all sent'}); server RSS grew "
          f"{streamer.growth / MIB:.2f} MiB")
    problem(reply, 413, "BODY_TOO_LARGE")
    assert streamer.growth < 64 * MIB
    assert streamer.sent < 64 * MIB, "the server kept reading a body it had refused"
    assert_accepted(srv)


def test_the_rss_measurement_sees_a_body_the_server_does_hold(capped):
    """The bound above means something: with a 24 MiB cap the same stream is held up to the cap, and seen."""
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{capped.port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    streamer = Streamer(capped, head, 128 * MIB, chunked=True)
    problem(streamer.run(), 413, "BODY_TOO_LARGE")
    print(f"24 MiB cap: 413 after {streamer.sent / MIB:.2f} MiB sent; server RSS grew {streamer.growth / MIB:.2f} MiB")
    assert streamer.growth > 12 * MIB
    assert_accepted(capped)


# -- (b) slow clients and too many of them -----------------------------------------------------------------


@dataclass
class Stalled:
    sock: socket.socket
    kind: str
    connected_at: float  # taken before connect(): the server's deadlines all start later than this
    trickle: bytes = b""  # sent a byte at a time, every TRICKLE_S, while the connection is open
    data: bytes = b""
    closed_at: float | None = None


TRICKLE_S = 0.1


def test_slowloris_starves_no_one_and_is_cut_off_at_the_deadlines(srv):
    raise_nofile(2048)
    port = srv.port
    assert_accepted(srv)
    fds_before = srv.ps.num_fds()
    head = f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    kinds = [  # (what is sent at once, then trickled; how many connections)
        ("nothing", b"", b"", 50),
        ("half a request line", b"POST /v1/jo", b"", 125),
        ("half the headers", (head + "Content-Le").encode(), b"", 125),
        ("headers, then a stalled body", (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"v": 1, ', b"", 100),
        ("headers a byte at a time", head.encode(), b"X-Pad: " + b"a" * 200, 10),
        ("body a byte at a time", (head + "Content-Length: 1000\r\n\r\n").encode(), b" " * 200, 10),
    ]
    sel = selectors.DefaultSelector()
    stalled: list[Stalled] = []
    for kind, first, trickle, count in kinds:
        for _ in range(count):
            connected_at = time.monotonic()
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if first:
                sock.sendall(first)
            sock.setblocking(False)
            conn = Stalled(sock, kind, connected_at, trickle)
            sel.register(sock, selectors.EVENT_READ, conn)
            stalled.append(conn)
    opened = time.monotonic()

    # the legitimate client, on connections accepted after all of the stalled ones (the accept queue is FIFO)
    latencies = []
    for _ in range(5):
        started = time.monotonic()
        assert_accepted(srv)
        latencies.append(time.monotonic() - started)
    # Starves no one: the legitimate client was answered while every stalled connection was still held
    # open by the server and none of them had been answered. Its latency is printed, never asserted (issue
    # 24: a test's clock is the machine's load).
    assert not sel.select(0), "a stalled connection was answered before the legitimate client was"
    held = srv.ps.num_fds() - fds_before
    print(f"{len(stalled)} stalled connections opened in {opened - stalled[0].connected_at:.2f} s, {held} held by "
          f"the server (its RLIMIT_NOFILE {srv.nofile}); legitimate client answered in "
          f"{max(latencies) * 1000:.1f} ms at worst (median {sorted(latencies)[2] * 1000:.1f} ms)")
    assert held >= len(stalled)

    # A bound for a broken run only (the server cuts them at its 2 s deadlines); generous for a loaded machine.
    deadline = opened + LIMITS["header_timeout_s"] + LIMITS["body_timeout_s"] + 120
    next_trickle = time.monotonic()
    open_ = len(stalled)
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=TRICKLE_S / 2):
            conn = key.data
            try:
                data = conn.sock.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if data:
                conn.data += data
                continue
            conn.closed_at = time.monotonic()
            sel.unregister(conn.sock)
            conn.sock.close()
            open_ -= 1
        if time.monotonic() >= next_trickle:  # the trickling ones send their next byte: data keeps arriving
            next_trickle += TRICKLE_S
            for conn in stalled:
                if conn.trickle and conn.closed_at is None:
                    try:
                        conn.sock.send(conn.trickle[:1])
                        conn.trickle = conn.trickle[1:]
                    except OSError:
                        pass  # closed by the server; the read side sees it
    sel.close()
    left = [c for c in stalled if c.closed_at is None]
    for conn in left:
        conn.sock.close()
    assert not left, f"{len(left)} stalled connections still open: {sorted({c.kind for c in left})}"

    waits: dict[str, list[float]] = {}
    for conn in stalled:
        problem(parse(conn.data), 408, "REQUEST_TIMEOUT")
        waits.setdefault(conn.kind, []).append(conn.closed_at - conn.connected_at)
    for kind, got in waits.items():
        print(f"  {kind}: {len(got)} cut off with a 408 after {min(got):.2f}-{max(got):.2f} s")
        # A lower bound, which load cannot break: cut at a deadline, not at once.
        assert min(got) >= min(LIMITS["header_timeout_s"], LIMITS["body_timeout_s"])
    assert srv.ps.num_fds() <= fds_before + 2  # every one of them released by the server
    assert_accepted(srv)


def test_a_connection_over_the_cap_is_refused_503_at_accept_and_the_first_ones_are_served(capped):
    port = capped.port
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(CAP)]  # silent, so far
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:  # not a byte sent
            doc = problem(parse(read_until_closed(extra)), 503, "TOO_MANY_CONNECTIONS")
        assert str(CAP) in doc["detail"]
        for sock in held:  # the first CAP still work once they send
            sock.sendall(get(port))
            problem(parse(read_until_closed(sock)), 404, "UNKNOWN_JOB")
    finally:
        for sock in held:
            sock.close()
    # each was closed by the server (Connection: close) before its EOF arrived: the cap has room again
    replies = [exchange(port, get(port)) for _ in range(CAP + 1)]
    assert [r.status for r in replies] == [404] * (CAP + 1)
    assert_accepted(capped)


def read_response(sock: socket.socket, timeout_s: float = 10.0) -> Reply:
    """One response on a connection that stays open: head, then exactly Content-Length bytes."""
    sock.settimeout(timeout_s)
    raw = b""
    while b"\r\n\r\n" not in raw:
        data = sock.recv(65536)
        assert data, f"closed mid-response: {raw!r}"
        raw += data
    reply = parse(raw)
    want = int(reply.headers["content-length"])
    while len(reply.body) < want:
        data = sock.recv(65536)
        assert data, f"closed mid-body: {raw!r}"
        reply.body += data
    return reply


def test_an_idle_kept_alive_connection_is_closed_without_an_unasked_408(srv):
    """After an answer, a connection that sends nothing is closed at the header deadline with no bytes: a
    408 there could be taken by the client as the answer to the next request it sends on it. A connection
    that has begun its next request does get the 408."""
    request = get(srv.port).replace(b"Connection: close\r\n", b"")
    with socket.create_connection(("127.0.0.1", srv.port)) as idle, \
            socket.create_connection(("127.0.0.1", srv.port)) as begun:
        for sock in (idle, begun):
            sock.sendall(request)
            problem(read_response(sock), 404, "UNKNOWN_JOB")
            sock.sendall(request)  # kept alive: a second request on the same connection is answered
            problem(read_response(sock), 404, "UNKNOWN_JOB")
        started = time.monotonic()
        begun.sendall(request[:10])
        # 60 s: a bound for a broken run only (the server closes both at its 2 s header deadline).
        problem(parse(read_until_closed(begun, 60)), 408, "REQUEST_TIMEOUT")
        assert read_until_closed(idle, 60) == b""
        print(f"idle kept-alive connection closed without a byte {time.monotonic() - started:.2f} s after its answer")


def test_malformed_or_oversized_heads_are_a_json_400(srv):
    port = srv.port
    limit = LIMITS["max_header_bytes"]
    pad = "X-Pad: " + "a" * (limit - 200) + "\r\n"
    problem(exchange(port, get(port, extra=pad)), 404, "UNKNOWN_JOB")  # control: just under the limit
    over = "X-Pad: " + "a" * (limit + 100) + "\r\n"
    doc = problem(exchange(port, get(port, extra=over)), 400, "BAD_HTTP")  # a whole head over it, in one write
    assert f"over the limit of {limit} bytes" in doc["detail"]
    for request in (get(port, extra=over)[: limit + 50],  # an incomplete head over the limit
                    b"NOT HTTP AT ALL\r\n\r\n",
                    get(port, extra=f"Host: 127.0.0.1:{port}\r\n"),  # two Host headers
                    get(port, extra="Content-Length: abc\r\n")):
        reply = exchange(port, request)
        problem(reply, 400, "BAD_HTTP")
        assert int(reply.headers["content-length"]) == len(reply.body)
    assert_accepted(srv)


# -- (c) Host and Origin: DNS rebinding, cross-site pages --------------------------------------------------


def test_only_bound_names_on_this_port_are_served_and_foreign_origins_are_403(srv):
    port = srv.port
    posted = exchange(port, srv.post(srv.envelope()))
    assert posted.status == 202
    result = f"/v1/jobs/{posted.json()['jobId']}/result"

    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}", f"{ALLOWED}:{port}"):
        reply = exchange(port, get(port, result, host))
        assert reply.status == 202 and reply.json()["state"] == "queued", (host, reply)  # served: not ready yet
    for host in ("attacker.example", f"attacker.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.1",
                 f"{ALLOWED}:{port + 1}", f"127.0.0.1:{port}.attacker.example", f"attacker.example:{port}@x", ""):
        problem(exchange(port, get(port, result, host)), 421, "MISDIRECTED_HOST")

    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://{ALLOWED}:{port}"):
        reply = exchange(port, get(port, result, extra=f"Origin: {origin}\r\n"))
        assert reply.status == 202, (origin, reply)
    for origin in ("http://attacker.example", f"http://attacker.example:{port}", f"http://127.0.0.1:{port + 1}",
                   f"https://127.0.0.1:{port}", "null", f"file://127.0.0.1:{port}"):
        problem(exchange(port, get(port, result, extra=f"Origin: {origin}\r\n")), 403, "FOREIGN_ORIGIN")

    # a foreign page cannot submit a job either: refused, and nothing was enqueued
    envelope = srv.envelope()
    job_id = json.loads(base64.b64decode(envelope["body"]))["jobId"]
    problem(exchange(port, srv.post(envelope, Origin="http://attacker.example")), 403, "FOREIGN_ORIGIN")
    problem(exchange(port, get(port, f"/v1/jobs/{job_id}")), 404, "UNKNOWN_JOB")

    with httpx.Client(base_url=srv.base, timeout=10) as http:  # an ordinary client, as it sends Host itself
        assert http.post("/v1/jobs", json=envelope).status_code == 202
        assert http.get(f"/v1/jobs/{job_id}", headers=BEARER).json()["state"] == "queued"
        problem(http.get(f"/v1/jobs/{job_id}", headers={"Host": "attacker.example", **BEARER}), 421,
                "MISDIRECTED_HOST")


def test_proctor_serve_answers_its_allow_host_names_and_no_others(tmp_path, home):
    nats = server.start(tmp_path / "nats")
    from test_http_api import open_lane

    asyncio.run(open_lane(nats.url, HOST))  # the lane a listener of HOST opened: the API takes jobs for it
    port = server.free_port()
    log = tmp_path / "serve.log"
    proctor = Path(sys.executable).with_name("proctor")
    token = home / "review-token"  # the install's token, which reads any job over /v1
    token.unlink(missing_ok=True)
    token.touch(0o600)
    token.write_text(READ_TOKEN + "\n")
    proc = subprocess.Popen([str(proctor), "serve", "--port", str(port), "--allow-host", ALLOWED,
                             "--queue", nats.url], env={**os.environ, "PROCTOR_HOME": str(home)},
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    served = Served(proc, port, home, 0, 0)
    try:
        deadline = time.monotonic() + 60  # a bound for a broken start only
        while True:
            try:
                if exchange(port, get(port), 5).status == 404:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)  # polling a port that is not listening yet
        problem(exchange(port, get(port, host=f"{ALLOWED}:{port}")), 404, "UNKNOWN_JOB")  # served, by the route
        problem(exchange(port, get(port, host=f"attacker.example:{port}")), 421, "MISDIRECTED_HOST")
        problem(exchange(port, get(port, host=f"other.{ALLOWED}:{port}")), 421, "MISDIRECTED_HOST")
        reply = exchange(port, served.post(served.envelope(), Host=f"{ALLOWED}:{port}"))
        assert reply.status == 202, reply  # onto the real queue
    finally:
        stop_server(served)
        nats.stop()


# -- (d) JSON numbers no float can hold --------------------------------------------------------------------


def test_out_of_range_and_non_finite_json_is_a_400_never_a_500(srv):
    fields = '"alg": "ed25519", "body": "", "sig": ""'
    bodies = {
        "1e999": f'{{"v": 1e999, {fields}}}',
        "-1e999": f'{{"v": -1e999, {fields}}}',
        "1E400 nested": f'{{"v": 1, {fields}, "x": [{{"y": 1E400}}]}}',
        "NaN": f'{{"v": NaN, {fields}}}',
        "Infinity": f'{{"v": Infinity, {fields}}}',
        "-Infinity": f'{{"v": -Infinity, {fields}}}',
        "5000-digit int": f'{{"v": {"9" * 5000}, {fields}}}',
        "deep nesting": "[" * 100_000 + "]" * 100_000,
        "lone surrogate": '{"v": 1, "alg": "\\ud800", "body": "", "sig": ""}',
        "not UTF-8": b'{"v": 1, "alg": "\xff\xfe", "body": "", "sig": ""}',
    }
    for name, body in bodies.items():
        raw = body if isinstance(body, bytes) else body.encode()
        assert len(raw) <= LIMITS["max_body_bytes"], name
        reply = exchange(srv.port, srv.post(raw))
        assert reply.status == 400, (name, reply)
        doc = problem(reply, 400, reply.json()["code"])
        assert doc["code"] in ("BAD_JSON", "MALFORMED"), (name, doc)
    doc = problem(exchange(srv.port, srv.post(bodies["1e999"].encode())), 400, "BAD_JSON")
    assert "1e999" in doc["detail"] and "finite" in doc["detail"]
    assert_accepted(srv)
