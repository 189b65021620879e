"""The host's egress proxy: an agent's network is its adapter's declared `host[:port]` list, nothing else.

Owns the HTTP proxy the host runs on a Unix socket for the length of one job: CONNECT tunnels, and plain
`http://` requests in absolute form (a local model server such as Ollama, vLLM or LM Studio speaks plain
HTTP on loopback; claude and codex send such a base URL's requests to the proxy that way, gemini tunnels
them with CONNECT). It never spawns the agent; plan.py puts the agent in a network namespace with only
loopback, where the Landlock helper's relay listens on 127.0.0.1 and forwards each TCP connection to this
socket (bound into the sandbox). Parsing egress entries and the allow decision (name or IP literal, port,
and what the name resolves to) are proctor.mechanisms.confine.endpoints'; the HTTP/1.1 framing and the
tunnel's byte pumps proctor.mechanisms.confine.http1's; the relay's port and the proxy variables that point
a CLI at it proctor.mechanisms.confine.relay's.

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
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.mechanisms.confine import endpoints
from proctor.mechanisms.confine.endpoints import parse_egress, split_host_port
from proctor.mechanisms.confine.http1 import (Meter, Request, Response, copy_body, parse_request, parse_response,
                                             refusal, tunnel)

# Still imported from here by proctor.mechanisms.adapters.spec until it imports it from endpoints.

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
        return await endpoints.decide(self.allowed, host, port, self._resolve)

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
            # Still one of the proxy's tasks while it lingers: shutdown cancels it and waits for its close.
            await _linger(reader, writer)
            await _close(writer)
            self._tasks.discard(task)

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
            host, port_text = split_host_port(parts[1])
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
            await tunnel(reader, writer, up_r, up_w, lim.idle_timeout_s, lim.max_tunnel_bytes)
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

    # --- plain http:// requests -------------------------------------------------------------------------

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        """Absolute-form requests on one client connection, one after another (keep-alive): each decided and
        reported before a byte of it goes upstream; the upstream connection is kept while the next request
        goes to the same address and port. A streamed answer (chunked, or up to the close) flows as it comes."""
        meter = Meter(self.limits.max_tunnel_bytes)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                req = parse_request(head)
                if isinstance(req, str):
                    await self._report({"host": None, "port": None, "address": None, "addresses": [],
                                        "allowed": False, "scheme": "http", "reason": req})
                    writer.write(refusal(400, "Bad Request", req))
                    return
                addresses, reason = await self.decide(req.host, req.port)
                decision = {"host": req.host[:255], "port": req.port,
                            "address": addresses[0] if addresses else None, "addresses": addresses,
                            "allowed": bool(addresses), "reason": reason, "scheme": "http",
                            "method": req.method[:16], "path": req.path[:200]}
                if not await self._report(decision):
                    why = reason if not addresses else "the decision could not be recorded, so nothing is sent"
                    writer.write(refusal(403, "Forbidden", f"http://{req.authority[:255]}: {why}"))
                    return
                upstream = await self._reuse_or_open(upstream, addresses, req.port)
                if upstream is None:
                    writer.write(refusal(502, "Bad Gateway", f"cannot connect to {req.authority[:255]}"))
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

    async def _exchange(self, req: Request, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                        up: tuple[asyncio.StreamReader, asyncio.StreamWriter], meter: Meter) -> bool:
        """One request and its response; True when the connection can carry the next request. The request
        body is sent while the response is awaited: a server may answer (a 100 Continue, an early 413) first."""
        ur, uw = up
        idle = self.limits.idle_timeout_s
        uw.write(req.upstream_head())
        upload = asyncio.ensure_future(copy_body(cr, uw, req.framing, req.length, meter, idle))
        try:
            try:
                resp = await self._response_head(ur, cw, req.method, meter)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                    ValueError) as exc:
                cw.write(refusal(502, "Bad Gateway", f"no usable answer from {req.authority[:255]}: "
                                                      f"{exc or type(exc).__name__}"[:300]))
                return False
            await copy_body(ur, cw, resp.framing, resp.length, meter, idle)
            if not upload.done():
                return False  # answered before the whole request arrived: the rest cannot be framed
            upload.result()
            return req.keep_alive and resp.keep_alive
        finally:
            if not upload.done():
                upload.cancel()
                await asyncio.gather(upload, return_exceptions=True)

    async def _response_head(self, ur: asyncio.StreamReader, cw: asyncio.StreamWriter, method: str,
                             meter: Meter) -> Response:
        """Relay the response head, and any interim (1xx) heads before it, to the client."""
        while True:
            head = await asyncio.wait_for(ur.readuntil(b"\r\n\r\n"), self.limits.idle_timeout_s)
            resp = parse_response(head, method)
            meter.add(len(head))
            cw.write(head)
            await cw.drain()
            if not resp.interim:
                return resp


# A lingering close's bounds: what a client still sends after the proxy's last answer is read and dropped
# for at most this long and this much, then the socket is closed whatever comes.
LINGER_S = 2.0
LINGER_BYTES = 1 << 20


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The proxy's last answer is often a refusal sent before the client has sent the request's body: a
    socket closed with that body unread makes the client's next write fail (EPIPE, or a reset over TCP)
    before it reads the refusal: a client saw a broken pipe instead of the proxy's reason. So, as HTTP servers do: flush, shut our side for writing (the client reads the
    end), and drop what the client still sends until it closes, within LINGER_S and LINGER_BYTES."""
    try:
        await asyncio.wait_for(writer.drain(), LINGER_S)
        if writer.is_closing() or not writer.can_write_eof():
            return
        writer.write_eof()
        deadline, left = asyncio.get_running_loop().time() + LINGER_S, LINGER_BYTES
        while left > 0:
            chunk = await asyncio.wait_for(reader.read(min(left, 65536)),
                                           deadline - asyncio.get_running_loop().time())
            if not chunk:
                return
            left -= len(chunk)
    except (OSError, asyncio.TimeoutError, asyncio.CancelledError, RuntimeError, ValueError):
        return  # cancelled by the proxy's shutdown, or a client gone: closed at once


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 1)
    except (OSError, asyncio.TimeoutError, RuntimeError):
        pass
