"""Who is at the other end of a loopback TCP connection: the kernel's word, not the address's.

Owns the one exact-4-tuple `sock_diag` lookup (NETLINK_SOCK_DIAG, `SOCK_DIAG_BY_FAMILY`) that gives the client
socket's owner uid, inode, TCP state and cgroup id, and the rule a server applies to it (`refusal`). Loopback
ports and addresses are no boundary between local users: any of them sends from any 127.x.y.z, to any port.
The socket's uid is: it is the uid that created the client's socket, which the client cannot choose.

What it cannot see: a relay the person runs themselves (`ssh -L`, a published container port) is the
person's own socket to the server, so whoever talks through the relay talks as the person.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.confine.cgroup import jobs_root

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_CGROUP_ID = 21
NO_COOKIE = 0xFFFFFFFF
TCP_ESTABLISHED, TCP_CLOSE_WAIT = 1, 8
# A client that already closed reads as uid 0, inode 0: root, on an install run as root. Only these states,
# with a live inode, name an owner.
LIVE_STATES = {TCP_ESTABLISHED: "ESTABLISHED", TCP_CLOSE_WAIT: "CLOSE_WAIT"}


@dataclass(frozen=True)
class Peer:
    uid: int
    inode: int
    state: int
    cgroup: int | None  # the cgroup v2 id of the socket (its creator's cgroup), when the kernel says


def _addr16(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    return ip.packed + b"\0" * (16 - len(ip.packed))


def _query(family: int, src: ipaddress.IPv4Address | ipaddress.IPv6Address, sport: int,
           dst: ipaddress.IPv4Address | ipaddress.IPv6Address, dport: int) -> Peer | None:
    """The socket (src:sport -> dst:dport) of `family`, exactly, or None when there is none."""
    sockid = struct.pack("!HH", sport, dport) + _addr16(src) + _addr16(dst) + struct.pack("=III", 0, NO_COOKIE,
                                                                                           NO_COOKIE)
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
        nl.sendto(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + req, (0, 0))
        data = nl.recv(65536)
    length, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR or length < 16 + 72:
        return None
    body = data[16:length]
    state = body[1]
    uid, inode = struct.unpack_from("=II", body, 4 + 48 + 12)
    cgroup, at = None, 72
    while at + 4 <= len(body):
        size, attr = struct.unpack_from("=HH", body, at)
        if size < 4:
            break
        if attr == INET_DIAG_CGROUP_ID and size >= 12:
            cgroup = struct.unpack_from("=Q", body, at + 4)[0]
        at += (size + 3) & ~3
    return Peer(uid, inode, state, cgroup)


def tcp_peer(peer: tuple, local: tuple) -> Peer | None:
    """The client's socket of an accepted TCP connection: `peer` is its address as the server sees it,
    `local` the server's own. An IPv4 client of a dual-stack server shows as ::ffff:a.b.c.d: looked up as
    the IPv4 socket it is, then as an IPv6 one (a client that itself used a mapped address). None: not
    found, or the kernel would not say (no netlink here)."""
    try:
        src, dst = ipaddress.ip_address(peer[0]), ipaddress.ip_address(local[0])
        tries: list[tuple[int, ipaddress.IPv4Address | ipaddress.IPv6Address,
                          ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
        if src.version == 6 and src.ipv4_mapped is not None and dst.version == 6 and dst.ipv4_mapped is not None:
            tries.append((socket.AF_INET, src.ipv4_mapped, dst.ipv4_mapped))
        tries.append((socket.AF_INET if src.version == 4 else socket.AF_INET6, src, dst))
        for family, a, b in tries:
            found = _query(family, a, int(peer[1]), b, int(local[1]))
            if found is not None:
                return found
    except (OSError, ValueError, IndexError, struct.error):
        return None
    return None


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    ip = ip.ipv4_mapped or ip if ip.version == 6 else ip
    return ip.is_loopback


def job_cgroups() -> set[int]:
    """The cgroup ids (cgroup2 inode numbers) of every job group under this host's proctor parent, and
    their descendants: a connection made from one of them is an agent's or its validation's."""
    parent = jobs_root()
    if parent is None:
        return set()
    found: set[int] = set()
    for root, dirs, _ in os.walk(parent):
        for d in dirs:
            try:
                found.add(os.stat(Path(root) / d).st_ino)
            except OSError:
                continue
    return found


def refusal(peer: Peer | None, allowed: Iterable[int]) -> str | None:
    """Why a loopback connection is refused, or None: its client socket must be found live, owned by an
    allowed uid (the install's user, and those config names), and not made from a job's cgroup (an agent
    runs as the same uid as the person's browser)."""
    if peer is None:
        return "the connection's client socket could not be found (it closed, or the kernel would not say)"
    if peer.state not in LIVE_STATES or not peer.inode:
        return f"the connection's client socket is not live (TCP state {peer.state}, inode {peer.inode})"
    allowed = set(allowed)
    if peer.uid not in allowed:
        return f"the connection is from uid {peer.uid}, not this install's user ({', '.join(map(str, sorted(allowed)))})"
    if peer.cgroup is not None and peer.cgroup in job_cgroups():
        return "the connection is from inside a proctor job (an agent or its validation)"
    return None
