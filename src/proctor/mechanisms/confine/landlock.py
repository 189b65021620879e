"""Landlock: the kernel's ABI version, and the helper argv that applies one job's ruleset.

Owns the access-right numbers, which of them each ABI handles, and turning a ConfineRequest into
`landlock-exec FS NET SCOPED NETNS MASK:PATH... --`. It never applies Landlock to the calling process (that would
confine the host) and never runs the agent: the helper does, after restricting itself.

Measured here (research/sandbox.md 2b-2d): writes outside the rules fail with EACCES; TCP bind/connect are
denied from ABI 4; UDP and pathname unix sockets are not covered on ABI 7; root keeps its capabilities
under Landlock unless they are dropped (the helper drops them all).
"""

from __future__ import annotations

import ctypes
import errno
import os
from functools import cache
from pathlib import Path

from proctor.mechanisms.confine.request import ConfineRequest
from proctor.mechanisms.confine.roots import around

SYS_CREATE_RULESET = 444  # same number on every architecture (unified syscall table)
CREATE_RULESET_VERSION = 1

# Bit numbers from include/uapi/linux/landlock.h; bits 0-12 are ABI 1, REFER 13 is ABI 2, TRUNCATE 14 ABI 3,
# IOCTL_DEV 15 ABI 5. Only the rights this module names individually are spelled out.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
MAKE_CHAR, MAKE_BLOCK, TRUNCATE, IOCTL_DEV = 1 << 6, 1 << 11, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only rights a non-dir rule may hold
READ_ONLY = EXECUTE | READ_FILE | READ_DIR
# Never granted, even in a writable root: as root, mknod of /dev/sda's numbers inside the worktree would give
# raw disk access that no path rule sees. Device ioctls are granted only on the few device files below.
NEVER = MAKE_CHAR | MAKE_BLOCK | IOCTL_DEV
DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/full")


@cache
def abi() -> tuple[int, str]:
    """(ABI version, reason). Version 0 means unusable; the reason says why (ENOSYS, disabled at boot...)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        v = libc.syscall(ctypes.c_long(SYS_CREATE_RULESET), None, ctypes.c_size_t(0),
                         ctypes.c_uint32(CREATE_RULESET_VERSION))
    except (OSError, AttributeError) as exc:
        return 0, f"cannot call syscall(): {exc}"
    if v < 0:
        err = ctypes.get_errno()
        return 0, f"landlock_create_ruleset: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    return int(v), f"ABI {v}"


def handled_fs(version: int) -> int:
    """Every filesystem right the ABI knows: all are handled, so anything not granted is denied."""
    if version >= 5:
        return (1 << 16) - 1
    if version >= 3:
        return (1 << 15) - 1
    if version == 2:
        return (1 << 14) - 1
    return (1 << 13) - 1


def _rule(mask: int, path: Path, handled: int) -> str:
    if not path.is_dir():
        mask &= FILE_RIGHTS
    return f"{mask & handled}:{path}"


def _read_rules(hidden: tuple[Path, ...]) -> list[tuple[int, Path]]:
    """Read rules covering everything but `hidden`. Landlock only adds rights, so instead of `/` the rules
    name every sibling along the way down to each hidden path. `/` keeps READ_DIR, so listing works
    everywhere (a hidden dir's names show, never its contents). Symlinks need no rule: rules bind to what
    they resolve to."""
    if not hidden:
        return [(READ_ONLY, Path("/"))]
    return [(READ_DIR, Path("/")), *((READ_ONLY, p) for p in around(Path("/"), hidden))]


def helper_args(helper: Path, req: ConfineRequest, version: int, private: tuple[Path, ...] = (),
                *, netns: bool = False, relay: tuple[int, str] | None = None) -> list[str]:
    """`helper FS NET SCOPED NETNS [relay=PORT:SOCKET] rules... --`; the caller appends the agent argv.

    `private` are extra writable dirs that are this job's own mounts (bwrap's tmpfs /tmp, /var/tmp, /dev/shm).
    `netns` puts the agent in an empty network namespace first: without bwrap it is the only way to stop UDP.
    `relay` (port, socket path as the helper sees it) starts the egress relay: the network stays "off" for
    Landlock (TCP bind and connect handled) but for a connect to the relay's port, which the helper adds.
    """
    fs = handled_fs(version)
    net = NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 and (not req.network or relay is not None) else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if version >= 6 else 0
    writable = fs & ~NEVER
    rules = [f"relay={relay[0]}:{relay[1]}"] if relay is not None else []
    rules += [_rule(mask, p, fs) for mask, p in _read_rules(req.hidden)]
    # A read-only path inside a hidden one (the person's checkout hidden, its git dir shown): Landlock only
    # adds rights, so it is granted on its own.
    rules += [_rule(READ_ONLY, p, fs) for p in req.readonly if any(p != h and p.is_relative_to(h) for h in req.hidden)]
    rules += [_rule(writable, p, fs) for p in req.writable]
    rules += [_rule(READ_FILE | WRITE_FILE | TRUNCATE | IOCTL_DEV, Path(d), fs) for d in DEVICE_FILES]
    rules += [_rule(writable, p, fs) for p in private]
    return [str(helper), str(fs), str(net), str(scoped), str(int(netns)), *rules, "--"]
