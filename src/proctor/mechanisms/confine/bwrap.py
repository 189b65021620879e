"""bubblewrap: the argv prefix that gives one job a read-only root, private /tmp, and its own namespaces.

Owns the bwrap flags and the order of the bind mounts. It never runs bwrap (detect.py tries it once).

Measured here (research/sandbox.md 2d), and why each flag is not optional:
- bwrap started by real root keeps every capability unless a `--cap-*` flag is given; with them,
  `mount -o remount,rw /` worked inside and a write landed on the host. Hence `--unshare-user --cap-drop ALL`.
- Even then uid 0 could write /proc/sys/kernel/core_pattern (a route to host root). Hence the read-only
  re-bind of /proc/sys.
- `--unshare-all` gives a network namespace (UDP and TCP go nowhere) and a pid namespace (the tree dies
  with its pid 1). A job with the network gets it through the host's egress proxy (egress.py): its socket
  is bound in on a private tmpfs and the namespace keeps only `lo`; `--share-net` (the whole host network,
  loopback services included) only for a caller that gives no proxy socket, and the plan's gaps say so.
"""

from __future__ import annotations

import os
from pathlib import Path

from proctor.mechanisms.confine.request import ConfineRequest

PRIVATE_TMPFS = ("/tmp", "/run", "/var/tmp")


def tmpfs_dirs() -> list[str]:
    return [d for d in PRIVATE_TMPFS if os.path.isdir(d) and not os.path.islink(d)]


def private_writable() -> tuple[Path, ...]:
    """Dirs that are fresh, job-only mounts inside the sandbox (tmpfs and --dev's /dev/shm): safe to write."""
    return (*(Path(d) for d in tmpfs_dirs()), Path("/dev/shm"))


def _depth(path: Path) -> int:
    return len(path.parts)


def egress_socket_inside(host_path: Path) -> Path:
    """Where the host's egress proxy socket appears inside the sandbox: on a private tmpfs, so the agent
    cannot replace it (a mount point cannot be unlinked or renamed over)."""
    dirs = tmpfs_dirs()
    if not dirs:
        return host_path
    return Path("/run" if "/run" in dirs else dirs[0]) / "proctor-egress.sock"


def bwrap_args(bwrap: str, req: ConfineRequest, extra_ro: tuple[Path, ...] = (), *,
               egress: bool = False) -> list[str]:
    """`bwrap ... --`; the caller appends the command. `extra_ro` are files the command itself needs
    (the Landlock helper) that may sit under a path hidden by the private tmpfs. `egress`: the network is
    the host's proxy only, so no `--share-net` (bwrap's own netns has just `lo`, brought up) and the proxy
    socket `req.egress_socket` is bound in at egress_socket_inside()."""
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-all", "--unshare-user"]
    shared = req.network and not egress
    if shared:
        args.append("--share-net")
    args += ["--cap-drop", "ALL", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
             "--ro-bind", "/proc/sys", "/proc/sys"]
    for d in tmpfs_dirs():
        args += ["--tmpfs", d]
    # A hidden dir becomes an empty tmpfs, made read-only only after every deeper mount (the helper may
    # sit inside $PROCTOR_HOME) has created its mount point; a hidden file becomes /dev/null.
    mounts: list[tuple[Path, list[str]]] = [
        (h, ["--tmpfs", str(h)] if h.is_dir() else ["--ro-bind", "/dev/null", str(h)])
        for h in req.hidden if h.exists()]
    mounts += [(p, ["--ro-bind-try", str(p), str(p)]) for p in (*req.readonly, *extra_ro)]
    mounts += [(p, ["--bind", str(p), str(p)]) for p in req.writable]
    # A share is deeper than the worktree it sits in, so its read-only bind lands on top of the rw one.
    mounts += [(dst, ["--ro-bind", str(src), str(dst)]) for src, dst in req.ro_binds]
    if egress and req.egress_socket is not None:
        inside = egress_socket_inside(req.egress_socket)
        mounts.append((inside, ["--bind", str(req.egress_socket), str(inside)]))
    if shared:
        # A resolv.conf that points into /run (systemd-resolved) would vanish under the private /run.
        resolv = Path(os.path.realpath("/etc/resolv.conf"))
        if resolv.parts[:2] == ("/", "run"):
            mounts.append((resolv, ["--ro-bind-try", str(resolv), str(resolv)]))
    # Deeper mounts go later so the most specific rule wins: an rw ref dir inside the ro common dir, an ro
    # `.git` pointer inside the rw worktree. Ties keep hidden, ro, rw order, which only matters for equal paths.
    for _, op in sorted(mounts, key=lambda m: _depth(m[0])):
        args += op
    for h in req.hidden:
        if h.is_dir():
            args += ["--remount-ro", str(h)]
    return [*args, "--chdir", str(req.worktree), "--"]
