"""The host's egress proxy: an agent's network is its adapter's declared `host[:port]` list, nothing else.

Owns parsing egress entries, the allow decision (name or IP literal, port, and what the name resolves to)
and the HTTP proxy the host runs on a Unix socket for the length of one job: CONNECT tunnels, and plain
`http://` requests in absolute form (a local model server such as Ollama, vLLM or LM Studio speaks plain
HTTP on loopback; claude and codex send such a base URL's requests to the proxy that way, gemini tunnels
them with CONNECT). It never spawns the agent; plan.py puts the agent in a network namespace with only
loopback, where the Landlock helper's relay listens on 127.0.0.1 and forwards each TCP connection to this
socket (bound into the sandbox).

The shape follows Anthropic's sandbox-runtime (research/sandbox.md 1): netns + host proxy over a bound
Unix socket + HTTPS_PROXY for the CLI. The rules:
- a CONNECT is allowed only to a declared host:port (port 443 unless declared); so is a plain request
  (`GET http://host:port/path HTTP/1.1`, port 80 unless in the URL), each request on a kept-alive
  connection decided and reported on its own, never a whole connection at once;
- a declared *name* is resolved here, by the host, once, and the tunnel goes to that address: a name that
  resolves to any loopback, private, link-local, CGNAT, multicast or otherwise non-global address is refused
  (DNS rebinding, `localhost`); a declared IP *literal* is the operator's explicit choice and is allowed;
- everything is bounded: concurrent connections, request-head size, head/connect/idle timeouts, bytes per
  tunnel, and decisions per proxy (a flood cannot fill the ledger);
- each decision is reported through `on_decision(dict)` with keys host, port, address, addresses, allowed,
  reason. Calls are serialised: one worker thread of the proxy's own makes them, one at a time (never
  concurrently), in the order decided, so a slow ledger write stalls no open tunnel. A tunnel opens only
  after its callback returned: a callback that raises or takes over `callback_timeout_s` turns an allowed
  CONNECT into a refusal (no tunnel without its ledger row). A plain request's decision also carries
  `scheme` "http", `method` and `path` (never the query: an API key may ride in it); refused, it is
  answered 403 with the reason as text, and the connection closed.

Usage (the host):

    with EgressProxy(spec.egress, sock_path, on_decision=lambda d: ledger.append("egress", d, job_id=j)):
        ...  # run the confined agent with ConfineRequest(egress_socket=sock_path, egress=spec.egress)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PORT = 443
RELAY_PORT = 3128  # the relay's port inside a private network namespace
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Endpoint:
    host: str  # lower-case name without a trailing dot, or an IP literal's canonical text
    port: int
    literal: IPAddress | None  # set when the entry was an IP literal

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _split(text: str) -> tuple[str, str | None]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"egress entry {text!r}: an IPv6 literal is written [addr] or [addr]:port")
        return host, rest[1:] if rest else None
    if text.count(":") > 1:
        raise ValueError(f"egress entry {text!r}: write an IPv6 literal in brackets, [addr]:port")
    host, sep, port = text.partition(":")
    return host, port if sep else None


def parse_endpoint(entry: str, default_port: int = DEFAULT_PORT) -> Endpoint:
    """`host[:port]`, `a.b.c.d[:port]` or `[v6][:port]`; no scheme, path, wildcard or user part."""
    text = entry.strip()
    if not text or any(c in text for c in "/@*?# \t\r\n"):
        raise ValueError(f"egress entry {entry!r} must be host[:port] (no scheme, path, wildcard or spaces)")
    host, port_text = _split(text)
    port = default_port
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"egress entry {entry!r}: port must be 1-65535")
        port = int(port_text)
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return Endpoint(str(literal), port, literal)
    name = host.lower().rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(
            lab and len(lab) <= 63 and not lab.startswith("-") and not lab.endswith("-")
            and all(c.isalnum() or c in "-_" for c in lab) and lab.isascii() for lab in labels):
        raise ValueError(f"egress entry {entry!r}: {host!r} is not a host name")
    if labels[-1].isdigit():
        raise ValueError(f"egress entry {entry!r}: {host!r} is neither an IP address nor a host name")
    return Endpoint(name, port, None)


def parse_egress(entries: Iterable[str]) -> tuple[Endpoint, ...]:
    return tuple(parse_endpoint(e) for e in entries)


def is_public(addr: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private, link-local, CGNAT, reserved, multicast, unspecified.
    An IPv4-mapped or NAT64-embedded IPv6 address is judged by the IPv4 address inside."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return is_public(addr.ipv4_mapped)
        if addr in ipaddress.ip_network("64:ff9b::/96"):
            return is_public(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
        if addr.sixtofour is not None or addr.teredo is not None:
            return False
    return addr.is_global and not addr.is_multicast and not addr.is_unspecified


@dataclass(frozen=True)
class Limits:
    max_connections: int = 64  # concurrent, over the whole proxy; more are answered 503 at once
    max_header_bytes: int = 8192  # a request head (CONNECT or plain), and a chunk-size line of its body
    head_timeout_s: float = 10.0  # to send the request head
    resolve_timeout_s: float = 10.0
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0  # no byte either way (model streams pause, but not for minutes)
    max_tunnel_bytes: int = 1 << 30  # both directions together, per tunnel or plain-HTTP client connection
    max_decisions: int = 10_000  # per proxy; past it every request is refused without a callback
    callback_timeout_s: float = 30.0  # on_decision slower than this: refused (it still runs to its end)


Resolver = Callable[[str, int], Sequence[str]]


class EgressProxy:
    """An HTTP proxy (CONNECT and plain http://) on a Unix socket, allowing only `allowed` endpoints; a
    context manager.

    `start()` returns once the socket listens (mode 0600 inside a 0700 directory the host owns: keep it
    outside every directory the agent may write, e.g. `tempfile.mkdtemp()`); `stop()` closes every tunnel,
    joins the thread and removes the socket. Runs an asyncio loop in one daemon thread.
    """

    def __init__(self, allowed: Sequence[str], socket_path: Path | str,
                 on_decision: Callable[[dict[str, Any]], None], *, limits: Limits = Limits(),
                 resolver: Resolver | None = None) -> None:
        self.allowed = parse_egress(allowed)
        self.socket_path = Path(socket_path)
        self.on_decision = on_decision
        self.limits = limits
        self._resolver = resolver
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = 0
        self._decisions = 0
        self._calls: concurrent.futures.ThreadPoolExecutor | None = None
        self.decisions_dropped = 0  # requests refused past max_decisions, never reported one by one
        self.callback_errors: list[str] = []

    # --- lifecycle -------------------------------------------------------------------------------------

    def __enter__(self) -> EgressProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> EgressProxy:
        if self._thread is not None:
            raise RuntimeError("EgressProxy already started")
        if len(str(self.socket_path).encode()) > 107:
            raise ValueError(f"egress socket path {self.socket_path} is longer than a Unix socket allows")
        self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.socket_path.is_socket():
            self.socket_path.unlink()
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="egress-decisions")
        ready: list[BaseException | None] = []
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
                ready.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
                ready.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"egress-proxy:{self.socket_path.name}", daemon=True)
        self._thread.start()
        started.wait(10)
        if not ready or ready[0] is not None:
            self._thread.join(1)
            self._thread = None
            self._calls.shutdown(wait=False)
            raise RuntimeError(f"egress proxy did not start: {ready[0] if ready else 'timeout'}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if thread.is_alive() and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout_s)
            except Exception:  # noqa: BLE001 - stopping is best effort; the loop stops below regardless
                pass
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        self._thread = None
        if self._calls is not None:
            self._calls.shutdown(wait=False, cancel_futures=True)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass

    async def _listen(self) -> None:
        # No umask games (process-wide, the host has other threads): a fresh socket is at most 0755, and a
        # connect needs write permission, so only the owner can use it even before the chmod.
        self._server = await asyncio.start_unix_server(
            self._client, path=str(self.socket_path), limit=self.limits.max_header_bytes, backlog=64)
        os.chmod(self.socket_path, 0o600)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)

    # --- decisions -------------------------------------------------------------------------------------

    async def _report(self, decision: dict[str, Any]) -> bool:
        """Hand one decision to the host; False when it could not be recorded (then nothing opens)."""
        if self._decisions >= self.limits.max_decisions:
            self.decisions_dropped += 1
            return False
        self._decisions += 1
        if self._decisions == self.limits.max_decisions:
            decision = {**decision, "allowed": False,
                        "reason": f"decision limit {self.limits.max_decisions} reached: every later request "
                                  "is refused unreported"}
        assert self._loop is not None and self._calls is not None
        try:
            await asyncio.wait_for(self._loop.run_in_executor(self._calls, self.on_decision, decision),
                                   self.limits.callback_timeout_s)
        except Exception as exc:  # noqa: BLE001 - fail closed, keep serving
            self.callback_errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return False
        return bool(decision["allowed"])

    def _match(self, host: str, port: int) -> Endpoint | None:
        try:
            literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        name = str(literal) if literal is not None else host.lower().rstrip(".")
        for ep in self.allowed:
            if ep.port == port and ep.host == name:
                return ep
        return None

    async def _resolve(self, name: str, port: int) -> list[str]:
        if self._resolver is not None:
            return list(self._resolver(name, port))
        assert self._loop is not None
        infos = await asyncio.wait_for(
            self._loop.getaddrinfo(name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP),
            self.limits.resolve_timeout_s)
        out: list[str] = []
        for *_, addr in infos:
            if addr[0] not in out:
                out.append(addr[0])
        return out

    async def decide(self, host: str, port: int) -> tuple[list[str], str]:
        """(addresses to try in order, reason); no address means refused. Only these addresses are ever
        connected to: the name is not resolved again (DNS rebinding)."""
        ep = self._match(host, port)
        if ep is None:
            return [], "not a declared egress host:port"
        if ep.literal is not None:
            return [ep.host], "declared IP literal (the operator's explicit choice)"
        try:
            addrs = await self._resolve(ep.host, port)
        except (OSError, asyncio.TimeoutError, UnicodeError) as exc:
            return [], f"cannot resolve {ep.host}: {exc or type(exc).__name__}"
        if not addrs:
            return [], f"{ep.host} resolves to no address"
        bad = [a for a in addrs if not is_public(ipaddress.ip_address(a.split("%")[0]))]
        if bad:
            return [], f"{ep.host} resolves to non-public {', '.join(bad[:4])} (loopback, private or reserved)"
        return addrs[:8], f"declared host, resolved to public {', '.join(addrs[:4])}"

    # --- one client ------------------------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._active += 1
        try:
            if self._active > self.limits.max_connections:
                writer.write(b"HTTP/1.1 503 Too Many Connections\r\nContent-Length: 0\r\n\r\n")
                return
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ValueError):
            pass
        except asyncio.CancelledError:
            # Only _shutdown cancels a client, and it wants it ended, not reported: 3.11's stream callback
            # asks a cancelled task for its exception and prints a traceback (fixed in 3.12).
            pass
        finally:
            self._active -= 1
            self._tasks.discard(task)
            await _close(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lim = self.limits
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), lim.head_timeout_s)
        except (asyncio.LimitOverrunError, ValueError):
            writer.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n\r\n")
            return
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) == 3 and parts[2].startswith("HTTP/1.") and parts[1][:7].lower() == "http://":
            await self._forward(reader, writer, head)
            return
        if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
            what = parts[0][:16] if parts else ""
            await self._report({"host": None, "port": None, "address": None, "addresses": [], "allowed": False,
                                "method": what, "reason": "not a proxy request: only CONNECT and absolute-form "
                                                          "http:// requests are proxied"})
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nAllow: CONNECT\r\nContent-Length: 0\r\n\r\n")
            return
        try:
            host, port_text = _split(parts[1])
            port = int(port_text or "")
            if not 0 < port < 65536 or not host:
                raise ValueError
        except ValueError:
            await self._report({"host": parts[1][:255], "port": None, "address": None, "addresses": [],
                                "allowed": False, "reason": "malformed CONNECT target"})
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            return
        addresses, reason = await self.decide(host, port)
        decision = {"host": host[:255], "port": port, "address": addresses[0] if addresses else None,
                    "addresses": addresses, "allowed": bool(addresses), "reason": reason}
        if not await self._report(decision):
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        upstream = await self._open(addresses, port)
        if upstream is None:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        up_r, up_w = upstream
        try:
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            await writer.drain()
            await self._tunnel(reader, writer, up_r, up_w)
        finally:
            await _close(up_w)

    async def _open(self, addresses: list[str], port: int
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        deadline = time.monotonic() + self.limits.connect_timeout_s
        for address in addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return await asyncio.wait_for(asyncio.open_connection(address, port), left)
            except (OSError, asyncio.TimeoutError):
                continue
        return None

    async def _tunnel(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                      ur: asyncio.StreamReader, uw: asyncio.StreamWriter) -> None:
        lim = self.limits
        state = {"last": time.monotonic(), "bytes": 0}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while True:
                try:
                    data = await asyncio.wait_for(src.read(65536), lim.idle_timeout_s / 4)
                except asyncio.TimeoutError:
                    if time.monotonic() - state["last"] >= lim.idle_timeout_s:
                        raise
                    continue
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                state["bytes"] += len(data)
                state["last"] = time.monotonic()
                if state["bytes"] > lim.max_tunnel_bytes:
                    raise OSError("tunnel byte limit reached")
                dst.write(data)
                await dst.drain()

        pumps = [asyncio.ensure_future(pump(cr, uw)), asyncio.ensure_future(pump(ur, cw))]
        try:
            pending = set(pumps)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    break
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


    # --- plain http:// requests -------------------------------------------------------------------------

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        """Absolute-form requests on one client connection, one after another (keep-alive): each decided and
        reported before a byte of it goes upstream; the upstream connection is kept while the next request
        goes to the same address and port. A streamed answer (chunked, or up to the close) flows as it comes."""
        meter = _Meter(self.limits.max_tunnel_bytes)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                req = _request(head)
                if isinstance(req, str):
                    await self._report({"host": None, "port": None, "address": None, "addresses": [],
                                        "allowed": False, "scheme": "http", "reason": req})
                    writer.write(_refusal(400, "Bad Request", req))
                    return
                addresses, reason = await self.decide(req.host, req.port)
                decision = {"host": req.host[:255], "port": req.port,
                            "address": addresses[0] if addresses else None, "addresses": addresses,
                            "allowed": bool(addresses), "reason": reason, "scheme": "http",
                            "method": req.method[:16], "path": req.path[:200]}
                if not await self._report(decision):
                    why = reason if not addresses else "the decision could not be recorded, so nothing is sent"
                    writer.write(_refusal(403, "Forbidden", f"http://{req.authority[:255]}: {why}"))
                    return
                upstream = await self._reuse_or_open(upstream, addresses, req.port)
                if upstream is None:
                    writer.write(_refusal(502, "Bad Gateway", f"cannot connect to {req.authority[:255]}"))
                    return
                if not await self._exchange(req, reader, writer, upstream, meter):
                    return
                # The next request may come after a tool has run for minutes: the idle bound, not the head's.
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.idle_timeout_s)
        finally:
            if upstream is not None:
                await _close(upstream[1])

    async def _reuse_or_open(self, current: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None,
                             addresses: list[str], port: int
                             ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The open upstream connection when it goes to one of the addresses just decided, else a new one: a
        connection is never reused for an endpoint other than the one this request was allowed."""
        if current is not None:
            peer = current[1].get_extra_info("peername") or ("", 0)
            if peer[0] in addresses and peer[1] == port and not current[0].at_eof():
                return current
            await _close(current[1])
        return await self._open(addresses, port)

    async def _exchange(self, req: _Request, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                        up: tuple[asyncio.StreamReader, asyncio.StreamWriter], meter: _Meter) -> bool:
        """One request and its response; True when the connection can carry the next request. The request
        body is sent while the response is awaited: a server may answer (a 100 Continue, an early 413) first."""
        ur, uw = up
        idle = self.limits.idle_timeout_s
        uw.write(req.upstream_head())
        upload = asyncio.ensure_future(_copy_body(cr, uw, req.framing, req.length, meter, idle))
        try:
            try:
                resp = await self._response_head(ur, cw, req.method, meter)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                    ValueError) as exc:
                cw.write(_refusal(502, "Bad Gateway", f"no usable answer from {req.authority[:255]}: "
                                                      f"{exc or type(exc).__name__}"[:300]))
                return False
            await _copy_body(ur, cw, resp.framing, resp.length, meter, idle)
            if not upload.done():
                return False  # answered before the whole request arrived: the rest cannot be framed
            upload.result()
            return req.keep_alive and resp.keep_alive
        finally:
            if not upload.done():
                upload.cancel()
                await asyncio.gather(upload, return_exceptions=True)

    async def _response_head(self, ur: asyncio.StreamReader, cw: asyncio.StreamWriter, method: str,
                             meter: _Meter) -> _Response:
        """Relay the response head, and any interim (1xx) heads before it, to the client."""
        while True:
            head = await asyncio.wait_for(ur.readuntil(b"\r\n\r\n"), self.limits.idle_timeout_s)
            resp = _response(head, method)
            meter.add(len(head))
            cw.write(head)
            await cw.drain()
            if not resp.interim:
                return resp


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 1)
    except (OSError, asyncio.TimeoutError, RuntimeError):
        pass


# --- HTTP/1.1 framing for plain requests (RFC 9112): strict where a lax reading lets a request smuggle --

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
# Hop-by-hop: they describe the client's connection to the proxy, not the proxy's to the server. `Upgrade`
# is dropped too: a switched protocol (a WebSocket) would be an opaque stream, past per-request decisions.
_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization", "proxy-authenticate",
                  "te", "upgrade", "host"})


@dataclass(frozen=True)
class _Request:
    method: str
    authority: str  # host[:port] as in the URL: the Host header upstream
    host: str
    port: int
    target: str  # origin-form, path?query, what the server is sent
    version: str
    headers: tuple[tuple[str, str], ...]
    framing: str  # none | length | chunked
    length: int
    keep_alive: bool

    @property
    def path(self) -> str:
        """The target without its query, for the ledger: an API key may ride in the query."""
        return self.target.split("?", 1)[0]

    def upstream_head(self) -> bytes:
        dropped = _HOP | _listed(self.headers)
        lines = [f"{self.method} {self.target} {self.version}", f"Host: {self.authority}"]
        lines += [f"{k}: {v}" for k, v in self.headers if k.lower() not in dropped]
        if not self.keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(frozen=True)
class _Response:
    interim: bool  # a 1xx head before the real one
    framing: str  # none | length | chunked | close
    length: int
    keep_alive: bool


def _headers(lines: list[str]) -> list[tuple[str, str]] | str:
    out = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            return f"malformed header line {line[:60]!r} (no folding, no space before the colon)"
        if "\n" in value or "\r" in value or "\0" in value:
            return f"header {name[:60]!r} holds a bare CR, LF or NUL"
        out.append((name, value.strip(" \t")))
    return out


def _values(headers: Iterable[tuple[str, str]], name: str) -> list[str]:
    return [v.strip().lower() for k, v in headers if k.lower() == name for v in v.split(",") if v.strip()]


def _listed(headers: Iterable[tuple[str, str]]) -> set[str]:
    """The headers `Connection` names as hop-by-hop; never the framing ones (a request naming them would
    otherwise have its own framing stripped on the way upstream)."""
    return set(_values(headers, "connection")) - {"content-length", "transfer-encoding"}


def _framing(headers: list[tuple[str, str]], *, request: bool) -> tuple[str, int] | str:
    codings = _values(headers, "transfer-encoding")
    lengths = set(_values(headers, "content-length"))
    if codings and lengths:
        return "both Transfer-Encoding and Content-Length: refused (request smuggling)"
    if codings:
        if codings[-1] == "chunked":
            return "chunked", 0
        return "a request body must be chunked last" if request else ("close", 0)
    if len(lengths) > 1 or (lengths and not next(iter(lengths)).isdigit()):
        return "an invalid or repeated Content-Length"
    if lengths:
        return "length", int(next(iter(lengths)))
    return ("none", 0) if request else ("close", 0)


def _request(head: bytes) -> _Request | str:
    """A plain proxy request head, or why it is refused."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        return f"not an HTTP/1.x request line: {lines[0][:80]!r}"
    method, url, version = parts
    if method == "CONNECT":
        return "CONNECT takes host:port, not a URL"
    if url[:7].lower() != "http://":
        return "not an absolute http:// URL (https goes through CONNECT)"
    rest = url[7:]
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, target = rest[:cut], rest[cut:] or "/"
    if "#" in url or "@" in authority or not authority:
        return "the URL has a fragment, a user part or no host"
    try:
        host, port_text = _split(authority)
    except ValueError as exc:
        return str(exc)
    if not host or (port_text is not None and not (port_text.isdigit() and 0 < int(port_text) < 65536)):
        return f"malformed host or port in {authority[:80]!r}"
    headers = _headers(lines[1:])
    if isinstance(headers, str):
        return headers
    framing = _framing(headers, request=True)
    if isinstance(framing, str):
        return framing
    keep = version == "HTTP/1.1" and "close" not in _values(headers, "connection")
    return _Request(method, authority, host, int(port_text or 80), target if target[0] == "/" else "/" + target,
                    version, tuple(headers), framing[0], framing[1], keep)


def _response(head: bytes, method: str) -> _Response:
    """An upstream response head; ValueError when it cannot be relayed with its framing known."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.0", "HTTP/1.1") or not re.fullmatch(r"[1-5]\d\d", parts[1]):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(parts[1])
    if status == 101:
        raise ValueError("a protocol switch (101) is not proxied")
    headers = _headers(lines[1:])
    if isinstance(headers, str):
        raise ValueError(headers)
    if status < 200:
        return _Response(True, "none", 0, True)
    framing = ("none", 0) if method == "HEAD" or status in (204, 304) else _framing(headers, request=False)
    if isinstance(framing, str):
        raise ValueError(framing)
    keep = parts[0] == "HTTP/1.1" and framing[0] != "close" and "close" not in _values(headers, "connection")
    return _Response(False, framing[0], framing[1], keep)


class _Meter:
    """Bytes relayed on one client connection, both ways, against the per-tunnel bound."""

    def __init__(self, limit: int) -> None:
        self.limit, self.total = limit, 0

    def add(self, n: int) -> None:
        self.total += n
        if self.total > self.limit:
            raise OSError("tunnel byte limit reached")


async def _read(src: asyncio.StreamReader, n: int, idle_s: float) -> bytes:
    data = await asyncio.wait_for(src.read(n), idle_s)
    if not data:
        raise asyncio.IncompleteReadError(b"", n)
    return data


async def _send(dst: asyncio.StreamWriter, data: bytes, meter: _Meter) -> None:
    meter.add(len(data))
    dst.write(data)
    await dst.drain()


async def _copy_body(src: asyncio.StreamReader, dst: asyncio.StreamWriter, framing: str, length: int,
                     meter: _Meter, idle_s: float) -> None:
    """Relay one message body as framed, chunk by chunk as it arrives (a model's streamed answer)."""
    if framing == "length":
        while length > 0:
            data = await _read(src, min(length, 65536), idle_s)
            length -= len(data)
            await _send(dst, data, meter)
    elif framing == "close":
        while data := await asyncio.wait_for(src.read(65536), idle_s):
            await _send(dst, data, meter)
    elif framing == "chunked":
        await _copy_chunks(src, dst, meter, idle_s)


async def _copy_chunks(src: asyncio.StreamReader, dst: asyncio.StreamWriter, meter: _Meter, idle_s: float) -> None:
    while True:
        line = await asyncio.wait_for(src.readuntil(b"\r\n"), idle_s)
        size_text = line[:-2].split(b";", 1)[0].strip(b" \t")
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise ValueError(f"malformed chunk size line {line[:40]!r}")
        await _send(dst, line, meter)
        size = int(size_text, 16)
        if size == 0:
            break
        left = size
        while left > 0:
            data = await _read(src, min(left, 65536), idle_s)
            left -= len(data)
            await _send(dst, data, meter)
        if await asyncio.wait_for(src.readexactly(2), idle_s) != b"\r\n":
            raise ValueError("a chunk does not end in CRLF")
        await _send(dst, b"\r\n", meter)
    while True:  # trailer fields, then the empty line that ends the message
        line = await asyncio.wait_for(src.readuntil(b"\r\n"), idle_s)
        await _send(dst, line, meter)
        if line == b"\r\n":
            return


def _refusal(status: int, phrase: str, reason: str) -> bytes:
    """A refusal the agent's CLI can show: the reason as text, and the connection closed after it."""
    body = f"proctor egress proxy: {reason}\n".encode("utf-8", "replace")
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def proxy_env(port: int | None) -> dict[str, str]:
    """What points a CLI at the relay: every spelling of the proxy variables, and no bypass list. With port
    None (the relay takes any free port) the Landlock helper sets the proxy variables itself before exec."""
    env = {"NO_PROXY": "", "no_proxy": "", "NODE_USE_ENV_PROXY": "1"}
    if port is not None:
        env.update({k: f"http://127.0.0.1:{port}" for k in PROXY_VARS})
    return env
