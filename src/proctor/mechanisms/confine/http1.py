"""HTTP/1.1 on the egress proxy's wire: request and response heads read strictly, bodies relayed as framed.

Owns parsing a plain proxy request (absolute-form `http://`) and an upstream response head (RFC 9112: strict
where a lax reading lets a request smuggle), relaying one message body chunk by chunk as it arrives, the byte
bound per client connection, the refusal the agent's CLI is shown, and the two byte pumps of a CONNECT
tunnel. It never decides what is allowed (proctor.mechanisms.confine.endpoints) and never opens a connection
(proctor.mechanisms.confine.egress).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from proctor.mechanisms.confine.endpoints import split_host_port

# --- HTTP/1.1 framing for plain requests (RFC 9112): strict where a lax reading lets a request smuggle --

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
# Hop-by-hop: they describe the client's connection to the proxy, not the proxy's to the server. `Upgrade`
# is dropped too: a switched protocol (a WebSocket) would be an opaque stream, past per-request decisions.
_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization", "proxy-authenticate",
                  "te", "upgrade", "host"})


@dataclass(frozen=True)
class Request:
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
class Response:
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


def parse_request(head: bytes) -> Request | str:
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
        host, port_text = split_host_port(authority)
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
    return Request(method, authority, host, int(port_text or 80), target if target[0] == "/" else "/" + target,
                    version, tuple(headers), framing[0], framing[1], keep)


def parse_response(head: bytes, method: str) -> Response:
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
        return Response(True, "none", 0, True)
    framing = ("none", 0) if method == "HEAD" or status in (204, 304) else _framing(headers, request=False)
    if isinstance(framing, str):
        raise ValueError(framing)
    keep = parts[0] == "HTTP/1.1" and framing[0] != "close" and "close" not in _values(headers, "connection")
    return Response(False, framing[0], framing[1], keep)


class Meter:
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


async def _send(dst: asyncio.StreamWriter, data: bytes, meter: Meter) -> None:
    meter.add(len(data))
    dst.write(data)
    await dst.drain()


async def copy_body(src: asyncio.StreamReader, dst: asyncio.StreamWriter, framing: str, length: int,
                    meter: Meter, idle_s: float) -> None:
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


async def _copy_chunks(src: asyncio.StreamReader, dst: asyncio.StreamWriter, meter: Meter, idle_s: float) -> None:
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


def refusal(status: int, phrase: str, reason: str) -> bytes:
    """A refusal the agent's CLI can show: the reason as text, and the connection closed after it."""
    body = f"proctor egress proxy: {reason}\n".encode("utf-8", "replace")
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# --- CONNECT: an opaque tunnel once the proxy answered 200 ---------------------------------------------------

async def tunnel(cr: asyncio.StreamReader, cw: asyncio.StreamWriter, ur: asyncio.StreamReader,
                 uw: asyncio.StreamWriter, idle_timeout_s: float, max_tunnel_bytes: int) -> None:
    """Relay a CONNECT tunnel's bytes both ways until one side ends or fails: `idle_timeout_s` without a
    byte either way ends it, so do more than `max_tunnel_bytes` in both directions together."""
    state = {"last": time.monotonic(), "bytes": 0}

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            try:
                data = await asyncio.wait_for(src.read(65536), idle_timeout_s / 4)
            except asyncio.TimeoutError:
                if time.monotonic() - state["last"] >= idle_timeout_s:
                    raise
                continue
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            state["bytes"] += len(data)
            state["last"] = time.monotonic()
            if state["bytes"] > max_tunnel_bytes:
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
