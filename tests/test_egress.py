"""The egress proxy on its own: entry parsing, the allow decision, and every bound, driven over its real Unix
socket from the test (the confined end to end runs are in test_egress_confined.py)."""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import LoopbackServer

from proctor.mechanisms.confine.egress import EgressProxy, Limits
from proctor.mechanisms.confine.endpoints import parse_endpoint
from proctor.mechanisms.confine.relay import proxy_env


@pytest.mark.parametrize(("entry", "text"), [
    ("api.openai.com", "api.openai.com:443"),
    ("API.OpenAI.com.:8443", "api.openai.com:8443"),
    ("127.0.0.1:11434", "127.0.0.1:11434"),
    ("[::1]:8080", "[::1]:8080"),
    ("[2001:db8::1]", "[2001:db8::1]:443"),
])
def test_parse_endpoint(entry: str, text: str) -> None:
    assert str(parse_endpoint(entry)) == text


@pytest.mark.parametrize("entry", ["", "https://api.openai.com", "*.openai.com", "a.com/v1", "user@a.com",
                                   "a.com:0", "a.com:70000", "a.com:x", "::1", "[::1", "a..com", "-a.com",
                                   "1.2.3", "a b.com"])
def test_parse_endpoint_refuses(entry: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(entry)


def _proxy(allowed: list[str], resolved: dict[str, list[str]] | None = None, **limits: Any) -> EgressProxy:
    resolver = (lambda name, port: resolved[name]) if resolved is not None else None
    return EgressProxy(allowed, Path("/nonexistent/x.sock"), lambda d: None, limits=Limits(**limits),
                       resolver=resolver)


@pytest.mark.parametrize(("addrs", "allowed"), [
    (["93.184.216.34"], True),
    (["2606:2800:220:1:248:1893:25c8:1946"], True),
    (["10.0.0.5"], False), (["192.168.1.1"], False), (["172.16.0.1"], False), (["127.0.0.1"], False),
    (["169.254.169.254"], False),  # cloud metadata
    (["100.64.0.1"], False), (["0.0.0.0"], False), (["224.0.0.1"], False), (["::1"], False),
    (["fe80::1"], False), (["fd00::1"], False), (["::ffff:127.0.0.1"], False), (["64:ff9b::a00:1"], False),
    (["93.184.216.34", "10.0.0.5"], False),  # one private answer among public ones: refused (rebinding)
    ([], False),
])
def test_declared_name_must_resolve_to_public_addresses(addrs: list[str], allowed: bool) -> None:
    import asyncio
    proxy = _proxy(["model.example"], {"model.example": addrs})
    addresses, reason = asyncio.run(proxy.decide("model.example", 443))
    assert bool(addresses) == allowed, reason
    if allowed:
        assert [ipaddress.ip_address(a) for a in addresses] == [ipaddress.ip_address(a) for a in addrs]


def test_only_the_declared_port_and_name_match() -> None:
    import asyncio
    proxy = _proxy(["model.example", "10.1.2.3:8080"], {"model.example": ["93.184.216.34"]})
    assert asyncio.run(proxy.decide("MODEL.example.", 443))[0] == ["93.184.216.34"]
    assert asyncio.run(proxy.decide("model.example", 80))[0] == []
    assert asyncio.run(proxy.decide("other.example", 443))[0] == []
    assert asyncio.run(proxy.decide("10.1.2.3", 8080))[0] == ["10.1.2.3"]  # an IP literal: operator's choice
    assert asyncio.run(proxy.decide("10.1.2.4", 8080))[0] == []


def test_proxy_env_sets_every_spelling_and_clears_no_proxy() -> None:
    env = proxy_env(3128)
    assert {env[k] for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                             "all_proxy")} == {"http://127.0.0.1:3128"}
    assert env["NO_PROXY"] == env["no_proxy"] == ""
    assert "HTTPS_PROXY" not in proxy_env(None)


# --- over the real socket ----------------------------------------------------------------------------------

class Upstream:
    """A loopback TCP server: echoes with a `pong:` prefix, or keeps reading (sink) and counts bytes."""

    def __init__(self, sink: bool = False) -> None:
        self.received = 0
        self.sink = sink
        server = LoopbackServer(lambda conn: threading.Thread(target=self._one, args=(conn,), daemon=True).start())
        self.srv, self.port = server.srv, server.port

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    self.received += len(data)
                    if not self.sink:
                        conn.sendall(b"pong:" + data)
            except OSError:
                pass


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="pe-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.srv.close()


def _client(path: Path, request: bytes, timeout: float = 5) -> tuple[socket.socket, bytes]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(path))
    try:
        s.sendall(request)
    except BrokenPipeError:
        pass  # the proxy answered and closed before reading (a refusal at accept): its answer is still read
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1024)
        if not chunk:
            break
        head += chunk
    return s, head


def _connect(target: str) -> bytes:
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()


def test_tunnel_to_a_declared_literal_and_decisions(sockdir: Path, upstream: Upstream) -> None:
    decisions: list[dict[str, Any]] = []
    with EgressProxy([f"127.0.0.1:{upstream.port}"], sockdir / "e.sock", decisions.append) as proxy:
        assert (proxy.socket_path.stat().st_mode & 0o777) == 0o600
        s, head = _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port}"))
        assert head.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"hello")
        assert s.recv(100) == b"pong:hello"
        s.close()
        _, refused = _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port + 1}"))
        assert refused.startswith(b"HTTP/1.1 403 ")
        # Not a proxy request at all (origin-form): plain http:// requests are test_egress_http.py's.
        _, get = _client(proxy.socket_path, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert get.startswith(b"HTTP/1.1 405 ")
    assert not proxy.socket_path.exists()
    assert [(d["allowed"], d["port"]) for d in decisions] == [(True, upstream.port), (False, upstream.port + 1),
                                                              (False, None)]
    assert decisions[2]["method"] == "GET"


def test_callback_failure_closes_the_door(sockdir: Path, upstream: Upstream) -> None:
    def broken(d: dict[str, Any]) -> None:
        raise RuntimeError("ledger is gone")

    with EgressProxy([f"127.0.0.1:{upstream.port}"], sockdir / "e.sock", broken) as proxy:
        _, head = _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port}"))
    assert head.startswith(b"HTTP/1.1 403 ") and upstream.received == 0
    assert proxy.callback_errors == ["RuntimeError: ledger is gone"]


def test_callbacks_are_serialised_on_one_thread(sockdir: Path, upstream: Upstream) -> None:
    inside, seen, threads = [0], [], set()

    def slow(d: dict[str, Any]) -> None:
        inside[0] += 1
        seen.append(inside[0])
        threads.add(threading.get_ident())
        time.sleep(0.05)
        inside[0] -= 1

    with EgressProxy([f"127.0.0.1:{upstream.port}"], sockdir / "e.sock", slow) as proxy:
        heads: list[bytes] = []
        workers = [threading.Thread(target=lambda: heads.append(
            _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port}"))[1])) for _ in range(6)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(10)
    assert len(heads) == 6 and all(h.startswith(b"HTTP/1.1 200 ") for h in heads)
    assert seen == [1] * 6 and len(threads) == 1


def test_header_size_and_head_timeout_are_bounded(sockdir: Path) -> None:
    with EgressProxy(["127.0.0.1:9"], sockdir / "e.sock", lambda d: None,
                     limits=Limits(max_header_bytes=1024, head_timeout_s=0.3)) as proxy:
        _, big = _client(proxy.socket_path, b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nX: " + b"a" * 4096 + b"\r\n\r\n")
        assert big.startswith(b"HTTP/1.1 431 ")
        # A head never ended: the proxy closes it without a word (b""). Were it held open, the client's own
        # 60 s timeout would raise instead (that bound only ends a broken run; how soon is not asserted).
        _, silent = _client(proxy.socket_path, b"CONNECT 127.0.0.1:9 HTTP/1.1\r\n", timeout=60)
        assert silent == b""


def test_connection_count_is_bounded(sockdir: Path) -> None:
    with EgressProxy(["127.0.0.1:9"], sockdir / "e.sock", lambda d: None,
                     limits=Limits(max_connections=2, head_timeout_s=5)) as proxy:
        held = []
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(proxy.socket_path))
            held.append(s)
        time.sleep(0.2)
        _, third = _client(proxy.socket_path, b"")
        assert third.startswith(b"HTTP/1.1 503 ")
        for s in held:
            s.close()


def test_idle_tunnel_is_closed(sockdir: Path, upstream: Upstream) -> None:
    with EgressProxy([f"127.0.0.1:{upstream.port}"], sockdir / "e.sock", lambda d: None,
                     limits=Limits(idle_timeout_s=1.0)) as proxy:  # > a loaded machine's pause before the ping
        s, head = _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port}"), timeout=60)
        assert head.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"hi")
        assert s.recv(100) == b"pong:hi"  # control: the tunnel carries data while used
        # Then idle: closed by the proxy (b""); the client's 60 s timeout would raise instead.
        assert s.recv(100) == b""


def test_tunnel_bytes_are_bounded(sockdir: Path) -> None:
    sink = Upstream(sink=True)
    with EgressProxy([f"127.0.0.1:{sink.port}"], sockdir / "e.sock", lambda d: None,
                     limits=Limits(max_tunnel_bytes=100_000)) as proxy:
        s, head = _client(proxy.socket_path, _connect(f"127.0.0.1:{sink.port}"))
        assert head.startswith(b"HTTP/1.1 200 ")
        with pytest.raises(OSError):
            for _ in range(1000):
                s.sendall(b"x" * 65536)
    assert sink.received <= 100_000 + 65536
    sink.srv.close()


def test_decisions_are_capped(sockdir: Path) -> None:
    decisions: list[dict[str, Any]] = []
    with EgressProxy(["127.0.0.1:9"], sockdir / "e.sock", decisions.append,
                     limits=Limits(max_decisions=2)) as proxy:
        for _ in range(4):
            _client(proxy.socket_path, _connect("127.0.0.1:8"))
    assert len(decisions) == 2 and "decision limit" in decisions[1]["reason"]
    assert proxy.decisions_dropped == 2


def test_stop_is_prompt_with_open_tunnels(sockdir: Path, upstream: Upstream) -> None:
    proxy = EgressProxy([f"127.0.0.1:{upstream.port}"], sockdir / "e.sock", lambda d: None).start()
    s, head = _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port}"), timeout=60)
    assert head.startswith(b"HTTP/1.1 200 ")
    loop_thread = [t for t in threading.enumerate() if t.name == f"egress-proxy:{proxy.socket_path.name}"]
    assert len(loop_thread) == 1 and loop_thread[0].is_alive()  # control: the proxy's loop, found by name
    # stop() does not wait on the open tunnel: it closes it (the client reads EOF, where a tunnel left open
    # would raise at the client's timeout) and its loop has ended when stop() returns (a stop() that gave up
    # on a loop stuck on the tunnel would leave the thread alive). How long stop() takes is not asserted.
    proxy.stop(timeout_s=60)
    assert not loop_thread[0].is_alive()
    assert s.recv(100) == b""
    assert not proxy.socket_path.exists()


def test_a_slow_callback_stalls_no_open_tunnel_and_a_hung_one_refuses(sockdir: Path, upstream: Upstream) -> None:
    gate = threading.Event()

    def hang_second(d: dict[str, Any]) -> None:
        if d["port"] == upstream.port + 1:
            gate.wait(5)

    with EgressProxy([f"127.0.0.1:{upstream.port}", f"127.0.0.1:{upstream.port + 1}"], sockdir / "e.sock",
                     hang_second, limits=Limits(callback_timeout_s=0.5)) as proxy:
        s, head = _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port}"))
        assert head.startswith(b"HTTP/1.1 200 ")
        stuck = threading.Thread(target=lambda: _client(proxy.socket_path, _connect(f"127.0.0.1:{upstream.port + 1}")))
        stuck.start()
        time.sleep(0.1)
        s.sendall(b"still")
        assert s.recv(100) == b"pong:still"  # the open tunnel flows while the ledger is slow
        stuck.join(5)
        gate.set()
    assert proxy.callback_errors and "Timeout" in proxy.callback_errors[0]


def test_a_job_without_network_loads_no_asyncio():
    """asyncio with ssl is 8 MB of every host process that loads it: the CLI's run path imports neither; the
    proxy a job with network starts does (the control)."""
    code = ("import sys; import proctor.surfaces.cli.run_agent, proctor.services.job.run_agent; "
            "print('asyncio' in sys.modules); import proctor.mechanisms.confine.egress; "
            "print('asyncio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
