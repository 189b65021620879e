"""The egress proxy's plain-HTTP side on its own: absolute-form `http://` requests (a local model server on
loopback) forwarded to a declared host:port only, each request a decision, keep-alive and chunked streams
carried through; every refusal a 403 (or 400) with its reason and a decision row, and nothing upstream.
Driven over the proxy's real Unix socket with the standard library's HTTP client, as a CLI would."""

from __future__ import annotations

import http.client
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.mechanisms.confine.egress import EgressProxy


class Server:
    """A plain-HTTP upstream: `/echo` answers the request body's size, `/stream` a chunked body whose last
    chunk waits for `release` (so a client that sees the first chunk first proves it is streamed)."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Host header
        self.release = threading.Event()
        self.held_back_in_vain = False  # the stream waited out its hold: the client saw nothing until then
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    data = b""
                    while size := int(self.rfile.readline().strip(), 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def do_POST(self) -> None:
                outer.requests.append(("POST", self.path, self.headers.get("host")))
                data = str(len(self._body())).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                outer.requests.append(("GET", self.path, self.headers.get("host")))
                self.send_response(200)
                self.send_header("transfer-encoding", "chunked")
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for part in (b"data: one\n\n", b"data: two\n\n"):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                    if not outer.release.wait(10):
                        outer.held_back_in_vain = True
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class ViaProxy(http.client.HTTPConnection):
    """An HTTP client whose proxy is the egress socket: requests go out in absolute form."""

    def __init__(self, sock_path: Path) -> None:
        super().__init__("proxy.invalid", timeout=10)
        self.sock_path = sock_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(str(self.sock_path))


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="peh-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def test_a_declared_plain_http_endpoint_keeps_alive_streams_and_records_each_request(sockdir, server):
    decisions: list[dict[str, Any]] = []
    base = f"http://127.0.0.1:{server.port}"
    with EgressProxy([f"127.0.0.1:{server.port}"], sockdir / "e.sock", decisions.append) as proxy:
        conn = ViaProxy(proxy.socket_path)
        conn.request("POST", f"{base}/echo?key=secret-in-query", body=b"x" * 70000,
                     headers={"Proxy-Connection": "keep-alive", "Host": "somewhere.else"})
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"70000")
        # A chunked upload, on the same connection.
        conn.request("POST", f"{base}/echo", body=iter([b"ab", b"cde"]), encode_chunked=True)
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"5")
        # A streamed answer: its first event arrives while the server still holds the rest back.
        conn.request("GET", f"{base}/stream")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("transfer-encoding") == "chunked"
        assert r.readline() == b"data: one\n"
        server.release.set()
        assert r.read() == b"\ndata: two\n\n"
        conn.close()
    assert not server.held_back_in_vain
    assert server.connections == 1  # kept alive end to end: one upstream connection for three requests
    # The server is sent origin-form targets and the URL's own Host, whatever the client's header said.
    assert server.requests == [("POST", "/echo?key=secret-in-query", f"127.0.0.1:{server.port}"),
                               ("POST", "/echo", f"127.0.0.1:{server.port}"),
                               ("GET", "/stream", f"127.0.0.1:{server.port}")]
    assert [(d["allowed"], d["scheme"], d["method"], d["path"], d["host"], d["port"]) for d in decisions] == [
        (True, "http", "POST", "/echo", "127.0.0.1", server.port),
        (True, "http", "POST", "/echo", "127.0.0.1", server.port),
        (True, "http", "GET", "/stream", "127.0.0.1", server.port)]
    assert "secret" not in repr(decisions)  # the query never reaches the ledger


def _refused(sock_path: Path, url: str, **kw: Any) -> tuple[int, str]:
    conn = ViaProxy(sock_path)
    conn.request(kw.pop("method", "GET"), url, **kw)
    r = conn.getresponse()
    out = r.status, r.read().decode()
    assert r.getheader("connection") == "close"
    conn.close()
    return out


def test_an_undeclared_or_non_literal_loopback_endpoint_is_refused_with_its_reason(sockdir, server):
    """The control: the same server, reached by a port or a name nobody declared as a literal."""
    decisions: list[dict[str, Any]] = []
    allowed = [f"127.0.0.1:{server.port}", f"localhost:{server.port}"]
    with EgressProxy(allowed, sockdir / "e.sock", decisions.append) as proxy:
        status, body = _refused(proxy.socket_path, f"http://127.0.0.1:{server.port + 1}/v1/models")
        assert status == 403 and "not a declared egress host:port" in body, body
        # `localhost` is declared, but as a name: it resolves to loopback, which only a literal may reach.
        status, body = _refused(proxy.socket_path, f"http://localhost:{server.port}/v1/models")
        assert status == 403 and "non-public" in body, body
        # No port: http means 80, which nobody declared.
        status, body = _refused(proxy.socket_path, "http://127.0.0.1/v1/models")
        assert status == 403, body
    assert server.requests == [] and server.connections == 0
    assert [(d["allowed"], d["host"], d["port"], d["method"], d["path"]) for d in decisions] == [
        (False, "127.0.0.1", server.port + 1, "GET", "/v1/models"),
        (False, "localhost", server.port, "GET", "/v1/models"),
        (False, "127.0.0.1", 80, "GET", "/v1/models")]


def test_each_request_on_a_kept_alive_connection_is_decided_on_its_own(sockdir, server):
    decisions: list[dict[str, Any]] = []
    with EgressProxy([f"127.0.0.1:{server.port}"], sockdir / "e.sock", decisions.append) as proxy:
        conn = ViaProxy(proxy.socket_path)
        conn.request("POST", f"http://127.0.0.1:{server.port}/echo", body=b"hi")
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"2")
        conn.request("POST", f"http://127.0.0.1:{server.port + 1}/echo", body=b"hi")
        r = conn.getresponse()
        assert r.status == 403 and r.read().startswith(b"proctor egress proxy: ")
        conn.close()
    assert [d["allowed"] for d in decisions] == [True, False]
    assert len(server.requests) == 1


def test_a_refused_request_s_body_can_still_be_sent_after_the_refusal_is_read(sockdir, server):
    """The refusal goes out as soon as the head is decided, before the client sends the body. The client
    reads the refusal to its end (the proxy's side shut) and only then sends the body: the proxy must still
    be taking it (a lingering close), not have closed with it unread, which failed the client's write with
    a broken pipe before it could show the reason. Control: the allowed request on the same path."""
    body = b"x" * (256 << 10)
    for port, status in ((server.port + 1, b"403"), (server.port, b"200")):
        with EgressProxy([f"127.0.0.1:{server.port}"], sockdir / "e.sock", lambda d: None) as proxy:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(30)
            s.connect(str(proxy.socket_path))
            s.sendall(f"POST http://127.0.0.1:{port}/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode())
            if status == b"403":
                answer = b""
                while chunk := s.recv(65536):  # to the end: the proxy has finished answering
                    answer += chunk
                assert answer.split(b" ")[1] == b"403" and b"proctor egress proxy: " in answer, answer
                s.sendall(body)  # BrokenPipeError when the proxy closed with the body unread
            else:
                s.sendall(body)
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
                assert answer.split(b" ")[1] == b"200", answer[:200]
            s.close()
    assert len(server.requests) == 1


@pytest.mark.parametrize(("head", "says"), [
    # Both framings: a server and the proxy could disagree on where the body ends (request smuggling).
    (b"POST http://127.0.0.1:{port}/echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
     "request smuggling"),
    (b"GET http://user@127.0.0.1:{port}/ HTTP/1.1\r\n\r\n", "user part"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX-A: b\r\n folded\r\n\r\n", "malformed header"),
    (b"CONNECT http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n", "CONNECT takes host:port"),
])
def test_a_request_the_proxy_cannot_frame_is_refused(sockdir, server, head, says):
    decisions: list[dict[str, Any]] = []
    with EgressProxy([f"127.0.0.1:{server.port}"], sockdir / "e.sock", decisions.append) as proxy:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(str(proxy.socket_path))
        s.sendall(head.replace(b"{port}", str(server.port).encode()))
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        s.close()
    assert answer.startswith(b"HTTP/1.1 400 ") and says.encode() in answer, answer
    assert [d["allowed"] for d in decisions] == [False] and says in decisions[0]["reason"]
    assert server.requests == []
