"""What stands between a socket and the API's routes: who may be asked (Host, Origin), how much may be sent
(body cap), how slowly (header and body deadlines), and how many at once (a connection cap).

Owns refusals made before any route runs, each a JSON body `{"code", "detail"}` with a stable code:
`MISDIRECTED_HOST` 421 (a Host header that is not one of the bound names: DNS rebinding), `FOREIGN_ORIGIN` 403
(a browser page of another origin; no CORS is ever granted), `BODY_TOO_LARGE` 413 (on Content-Length before
a byte is read, and while a chunked body streams), `REQUEST_TIMEOUT` 408 (headers or body not complete in
time; a kept-alive connection idle that long is just closed), `TOO_MANY_CONNECTIONS` 503 (at accept),
`BAD_HTTP` 400 (what h11 cannot parse, a request line and headers over `max_header_bytes` included),
`BAD_REQUEST` 400 (a NUL in the path or the query, encoded or not: measured, `?repo=%00` was a 500 with a
traceback). It never looks at an envelope: the route and the queue code do, on a body already bounded here.

`SecurityHeaders` puts the review page's headers (a CSP allowing only this origin's own script and style, no
framing, no referrer to another origin, no caching) on every response of the origin, the API's JSON and
every refusal included: no page of this origin is a way around them.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from proctor.mechanisms.confine.peer import is_loopback, refusal, tcp_peer
from proctor.mechanisms.queue.envelope import MAX_ENVELOPE_BYTES
from proctor.surfaces.web.access import SECURITY_HEADERS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_SECURITY_RAW = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_BINDS = ("", "0.0.0.0", "::", "[::]")
FD_RESERVE = 64  # descriptors kept for the queue client, the ledger and logs when the cap follows RLIMIT_NOFILE


@dataclass(frozen=True)
class HttpLimits:
    """Defaults keep one host's API alive against one hostile client; every field can be raised by code."""

    max_body_bytes: int = MAX_ENVELOPE_BYTES  # what the queue would take at all (an envelope's own cap)
    header_timeout_s: float = 10.0  # from accept (or the previous response) to the end of the headers
    body_timeout_s: float = 20.0  # from the end of the headers to the end of the body
    keep_alive_s: int = 5  # an idle kept-alive connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line plus headers
    max_connections: int = 8192  # open connections; also bounded by RLIMIT_NOFILE less a reserve
    jobs_per_signer_per_minute: int = 120  # POST /v1/jobs a signer may make (surfaces.api.quota)

    def connection_cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - FD_RESERVE))


def error_body(code: str, detail: Any) -> bytes:
    return json.dumps({"code": code, "detail": detail}, allow_nan=False).encode()


def raw_response(status: int, reason: str, code: str, detail: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for refusals made outside any request cycle."""
    body = error_body(code, detail)
    security = "".join(f"{k.lower()}: {v}\r\n" for k, v in SECURITY_HEADERS.items())
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{security}connection: close\r\n\r\n")
    return head.encode() + body


# -- Host and Origin ---------------------------------------------------------------------------------------


def bracket(name: str) -> str:
    name = name.strip().lower()
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


def allowed_names(bind: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """Loopback names, the bind address (unless it is a wildcard) and the operator's own names, lower case;
    IPv6 literals bracketed as they appear in a Host header. A port is never part of a name: the port a
    request must name is the one the connection arrived on."""
    names = set(LOOPBACK_NAMES)
    if bind.strip().lower() not in WILDCARD_BINDS:
        names.add(bracket(bind))
    names.update(bracket(n) for n in extra if n.strip())
    return frozenset(names)


def split_host(value: str) -> tuple[str, int | None] | None:
    """`name[:port]` -> (lower-case name, port or None); None when it is not that shape."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, sep, port_text = value.partition(":")
        rest = sep + port_text
    if not name:
        return None
    if not rest:
        return name, None
    if not rest.startswith(":") or not rest[1:].isdigit() or len(rest) > 6:
        return None
    return name, int(rest[1:])


def host_allowed(value: str, names: frozenset[str], server_port: int | None, default_port: int = 80) -> bool:
    parsed = split_host(value)
    if parsed is None:
        return False
    name, port = parsed
    return name in names and (port if port is not None else default_port) == server_port


def origin_allowed(value: str, names: frozenset[str], server_port: int | None, server_scheme: str = "http") -> bool:
    """Same origin only: the scheme the request came in on, an allowed name, the port it came in on."""
    scheme, sep, rest = value.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or scheme != server_scheme or "/" in rest:
        return False  # "null" (a sandboxed page, a file://), another scheme and anything odd are foreign
    return host_allowed(rest, names, server_port, 443 if scheme == "https" else 80)


# -- the ASGI middleware: Host, Origin, a bounded body read before the app sees it -------------------------


class RequestGuard:
    """Pure ASGI middleware (outermost inside FastAPI's error handling). Reads the whole body itself, within
    `max_body_bytes` and `body_timeout_s`, and hands the app a replay of it: nothing downstream can be made
    to buffer more, or wait longer."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, names: frozenset[str], limits: HttpLimits) -> None:
        self.app = app
        self.names = names
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
        server = scope.get("server")
        port = server[1] if server else None
        hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
        if len(hosts) != 1 or not host_allowed(hosts[0], self.names, port):
            shown = hosts[0][:100] if hosts else None
            await refuse(send, 421, "MISDIRECTED_HOST",
                         f"Host {shown!r} is not a name this server is bound to; allowed: "
                         f"{', '.join(sorted(self.names))} on port {port}")
            return
        for name, value in headers:
            if name == b"origin" and not origin_allowed(value.decode("latin-1"), self.names, port,
                                                        scope.get("scheme", "http")):
                await refuse(send, 403, "FOREIGN_ORIGIN",
                             f"requests from origin {value.decode('latin-1')[:100]!r} are refused (no CORS)")
                return
        target = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
        query = scope.get("query_string") or b""
        if b"\x00" in target or b"\x00" in query or b"%00" in target.lower() or b"%00" in query.lower():
            await refuse(send, 400, "BAD_REQUEST", "the request's path or query holds a NUL character")
            return
        lengths = [v for k, v in headers if k == b"content-length"]
        if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > self.limits.max_body_bytes:
            await refuse(send, 413, "BODY_TOO_LARGE",
                         f"body of {int(lengths[0])} bytes is over the limit of {self.limits.max_body_bytes}")
            return
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await refuse(send, 408, "REQUEST_TIMEOUT",
                             f"the request body did not arrive within {self.limits.body_timeout_s:g} s")
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                await refuse(send, 413, "BODY_TOO_LARGE",
                             f"body is over the limit of {self.limits.max_body_bytes} bytes")
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect, which long polls listen for

        await self.app(scope, replay, send)


class SecurityHeaders:
    """Pure ASGI middleware: every response gets SECURITY_HEADERS unless a route set its own value."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *((k, v) for k, v in _SECURITY_RAW if k not in have)]
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def refuse(send: Send, status: int, code: str, detail: str) -> None:
    """A JSON refusal that also closes the connection: what was left unread of the request is never read."""
    body = error_body(code, detail)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# -- the HTTP/1.1 protocol: a header deadline, a connection cap, JSON for what h11 refuses ------------------


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus what it lacks: a deadline for the request line and headers (uvicorn's
    keep-alive timer is cancelled by the first byte, so a half-sent request would hold its connection
    forever), a cap on open connections checked at accept, a head size limit that holds even when the whole
    head arrives in one read (h11 checks only a head still incomplete), and JSON bodies for its own refusals.

    A connection that has had an answer and sent nothing since is closed without a word when the header
    deadline passes (as a keep-alive timeout would): an unsolicited 408 there could be read by the client as
    the answer to the request it was about to send on that connection."""

    limits: HttpLimits = HttpLimits()
    cap: int = HttpLimits().max_connections
    # The uids a loopback client's socket may belong to (`peer.refusal`); None: not checked (a test's server).
    peers: tuple[int, ...] | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _answered = False  # a response on this connection is complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.cap:
            transport.write(raw_response(503, "Service Unavailable", "TOO_MANY_CONNECTIONS",
                                         f"the server holds its limit of {self.cap} connections; retry later"))
            transport.close()
            return
        why = self._peer_refused(transport)
        if why is not None:
            transport.write(raw_response(403, "Forbidden", "PEER_REFUSED", why))
            transport.close()
            return
        self._arm_header_timer()

    def _peer_refused(self, transport: asyncio.Transport) -> str | None:
        """Why a loopback client may not talk to this server at all, or None: attributed when it is accepted,
        by its socket's uid and cgroup (proctor.mechanisms.confine.peer), never by its address or port."""
        if self.peers is None:
            return None
        peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        if not peer or not local or not is_loopback(str(peer[0])):
            return None  # a remote client: the kernel here cannot say who it is; the token alone decides
        return refusal(tcp_peer(peer, local), self.peers)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._cancel_header_timer()
            self._refuse_bad_http(f"the request line and headers are over the limit of "
                                  f"{self.limits.max_header_bytes} bytes")
            return
        super().data_received(data)
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the request's head is in: its body has the app's own deadline

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the request head being received (what h11 holds unparsed, plus `data`) is over the limit."""
        limit = self.limits.max_header_bytes
        pending = self.conn.trailing_data[0]
        if len(pending) + len(data) <= limit:
            return False
        end = (pending + data).find(b"\r\n\r\n", 0, limit + 1)
        return end < 0 or end + 4 > limit

    def on_response_complete(self) -> None:
        self._answered = True
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse_bad_http(f"{msg} (request line and headers are limited to {self.limits.max_header_bytes} bytes)")

    def _refuse_bad_http(self, detail: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(raw_response(400, "Bad Request", "BAD_HTTP", detail))
            self.transport.close()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._answered and not self.conn.trailing_data[0]:
            self.transport.close()  # an idle kept-alive connection: closed, not answered (see the class doc)
            return
        self.transport.write(raw_response(408, "Request Timeout", "REQUEST_TIMEOUT",
                                          f"the request headers did not arrive within "
                                          f"{self.limits.header_timeout_s:g} s"))
        self.transport.close()


def protocol_for(limits: HttpLimits, peers: Iterable[int] | None = None) -> type[GuardedH11Protocol]:
    return type("GuardedH11", (GuardedH11Protocol,), {"limits": limits, "cap": limits.connection_cap(),
                                                      "peers": tuple(peers) if peers is not None else None})


def server_config(app: Any, host: str, port: int, limits: HttpLimits | None = None,
                  peers: Iterable[int] | None = None, **over: Any) -> uvicorn.Config:
    """The uvicorn config `proctor serve` and the tests run: h11 with the guard, no WebSocket upgrades.
    `peers`: the uids a loopback client's socket may belong to (None: not checked)."""
    limits = limits or HttpLimits()
    options: dict[str, Any] = {
        "host": host, "port": port, "log_level": "warning", "http": protocol_for(limits, peers), "ws": "none",
        "timeout_keep_alive": limits.keep_alive_s, "h11_max_incomplete_event_size": limits.max_header_bytes,
        "server_header": False, "backlog": 2048,
        # No proxy header is believed: from loopback, uvicorn's default took X-Forwarded-For as the client.
        "proxy_headers": False,
    }
    options.update(over)
    return uvicorn.Config(app, **options)
