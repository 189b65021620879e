"""Which endpoints an agent may reach: its adapter's declared `host[:port]` entries, parsed, and the allow decision.

Owns parsing egress entries, matching a requested host and port against them, and deciding which addresses a
request may go to: a declared IP literal is the operator's explicit choice; a declared name is resolved once,
by the host, and refused when any address it resolves to is not global unicast (DNS rebinding, `localhost`).
It never opens a connection: proctor.mechanisms.confine.egress does, to the addresses decided here only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

DEFAULT_PORT = 443
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Endpoint:
    host: str  # lower-case name without a trailing dot, or an IP literal's canonical text
    port: int
    literal: IPAddress | None  # set when the entry was an IP literal

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def split_host_port(text: str) -> tuple[str, str | None]:
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
    host, port_text = split_host_port(text)
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


def match(allowed: Sequence[Endpoint], host: str, port: int) -> Endpoint | None:
    try:
        literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    name = str(literal) if literal is not None else host.lower().rstrip(".")
    for ep in allowed:
        if ep.port == port and ep.host == name:
            return ep
    return None


async def decide(allowed: Sequence[Endpoint], host: str, port: int,
                 resolve: Callable[[str, int], Awaitable[list[str]]]) -> tuple[list[str], str]:
    """(addresses to try in order, reason); no address means refused. Only these addresses are ever
    connected to: the name is not resolved again (DNS rebinding)."""
    ep = match(allowed, host, port)
    if ep is None:
        return [], "not a declared egress host:port"
    if ep.literal is not None:
        return [ep.host], "declared IP literal (the operator's explicit choice)"
    try:
        addrs = await resolve(ep.host, port)
    except (OSError, TimeoutError, UnicodeError) as exc:  # asyncio's timeout is TimeoutError (3.11)
        return [], f"cannot resolve {ep.host}: {exc or type(exc).__name__}"
    if not addrs:
        return [], f"{ep.host} resolves to no address"
    bad = [a for a in addrs if not is_public(ipaddress.ip_address(a.split("%")[0]))]
    if bad:
        return [], f"{ep.host} resolves to non-public {', '.join(bad[:4])} (loopback, private or reserved)"
    return addrs[:8], f"declared host, resolved to public {', '.join(addrs[:4])}"
