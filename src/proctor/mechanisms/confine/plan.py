"""Choosing a Confiner for a policy and wrapping one agent argv into the plan the process runner spawns.

Owns the Confiner seam, which layers a policy gets on this machine, and the gaps each combination leaves.
It never spawns, never joins the cgroup (proctor.mechanisms.confine.cgroup, via the runner, does) and never weakens silently:
the plan's `confinement`, `details` and `gaps` say exactly what enforced what.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol

from proctor.mechanisms.confine.bwrap import bwrap_args, egress_socket_inside, private_writable, tmpfs_dirs
from proctor.mechanisms.confine.detect import Capabilities
from proctor.mechanisms.confine.landlock import helper_args
from proctor.mechanisms.confine.relay import RELAY_PORT, proxy_env, relay_argv, system_python
from proctor.mechanisms.confine.request import ConfinePlan, ConfineRequest, Confinement, Unavailable

Mode = Literal["auto", "required", "off"]
# Weakest first: a request may ask for no less than a floor (the listener's, an MCP client's grant), and
# re-validation takes the stronger of the job's mode and today's config.
CONFINE_ORDER = {"off": 0, "auto": 1, "required": 2}


class Confiner(Protocol):
    @property
    def name(self) -> Confinement: ...

    def wrap(self, argv: Sequence[str], req: ConfineRequest) -> ConfinePlan | Unavailable: ...


def _inside(path: Path, root: Path) -> bool:
    return path != root and path.is_relative_to(root)


def _gaps(req: ConfineRequest, bwrap: bool, landlock_abi: int, netns: bool, relay: bool) -> list[str]:
    # The host hides $PROCTOR_HOME and the user's home around what the job needs from it (proctor.services.job.
    # sandbox_home: toolchains, the agent's install, `read_home`); what is outside stays readable.
    shown = ", ".join(str(h) for h in req.hidden[:4]) + (f" and {len(req.hidden) - 4} more" if len(req.hidden) > 4
                                                          else "")
    gaps = [f"reads are allowed everywhere but the hidden paths ({shown or 'none'}): a secret elsewhere (/etc, "
            "another user's world-readable files, credentials kept outside the home or reached through a symlink "
            "left in it) stays readable",
            "a file with more than one hard link is writable through the worktree in every mode: the job's "
            "checkout has none, and one the repo's setup leaves is a risk (refuse_hard_links)",
            ]
    proxy = req.network and req.egress_socket is not None
    if not req.network or proxy:
        where = "outside /tmp, /run and /var/tmp" if bwrap else "anywhere"
        gaps.append(f"pathname unix sockets {where} stay connectable with network off (Landlock ABI < 9)")
        if not bwrap and not netns and relay:
            tcp = (f"and TCP to any host (Landlock ABI {landlock_abi} < 4)" if landlock_abi < 4
                   else "and TCP to the relay's port on any address")
            gaps.append("the network is open: without a network namespace (bwrap, or the helper as root) UDP "
                        f"reaches every host, DNS and host loopback services included, {tcp}")
        elif not bwrap and not netns:
            gaps.append("UDP is not blocked with network off (Landlock has no UDP rights; needs a netns)")
        if not bwrap and not netns and not relay and landlock_abi < 4:
            gaps.append(f"TCP is not blocked with network off (Landlock ABI {landlock_abi} < 4)")
    if proxy and not relay:
        gaps.append("no egress relay (neither the Landlock helper nor a system python3): the agent has no "
                    "network at all, not even its declared egress hosts")
    elif proxy and not req.egress:
        gaps.append("network is on but the adapter declares no egress hosts: the proxy refuses every connection")
    elif proxy:
        gaps.append(f"the declared egress hosts ({', '.join(req.egress)}) are reachable through the host's "
                    "proxy: whatever the agent can read can be sent there")
    elif req.network:
        gaps.append("the whole network is reachable, loopback and private ranges included: no egress proxy "
                    "was given")
    if not bwrap:
        if landlock_abi < 6:
            gaps.append(f"signals and abstract unix sockets are not scoped (Landlock ABI {landlock_abi} < 6)")
        gaps += [f"{ro} is writable: Landlock cannot make a path read-only inside the writable root {rw}"
                 for ro in req.readonly for rw in req.writable if _inside(ro, rw)]
        gaps += [f"{h} is readable: Landlock cannot hide a path inside the writable root {rw}"
                 for h in req.hidden for rw in req.writable if _inside(h, rw)]
    return gaps


@dataclass(frozen=True)
class LayeredConfiner:
    """bwrap outside, the Landlock helper inside, either alone, or neither (`none`, for mode off/auto)."""

    caps: Capabilities
    use_bwrap: bool
    use_landlock: bool
    why_none: str = ""

    @property
    def name(self) -> Confinement:
        layers = [n for n, on in (("bwrap", self.use_bwrap), ("landlock", self.use_landlock)) if on]
        return "+".join(layers) or "none"  # type: ignore[return-value]

    def wrap(self, argv: Sequence[str], req: ConfineRequest) -> ConfinePlan | Unavailable:
        env = {"TMPDIR": str(req.tmpdir)}
        if self.name == "none":
            details = {"files": "none", "network": "open", "cleanup": "runner", "uid": str(self.caps.uid)}
            return ConfinePlan(list(argv), env, "none", details, [f"no confinement: {self.why_none}"])
        missing = [str(p) for p in req.writable if not p.exists()]
        if missing:
            return Unavailable(f"writable roots must exist before a bind or a Landlock rule: {missing}")
        cmd = list(argv)
        abi = self.caps.landlock_abi if self.use_landlock else 0
        # network + egress_socket: the agent's only way out is the host's proxy, through the helper's relay
        # on 127.0.0.1 inside a network namespace that has nothing but loopback (egress.py).
        proxy = req.network and req.egress_socket is not None
        # Without bwrap, root can still give the agent an empty network namespace (measured: Landlock
        # alone let a UDP packet through, research/sandbox.md 2c).
        netns = self.use_landlock and not self.use_bwrap and (not req.network or proxy) and self.caps.helper_netns
        relay: tuple[int, str] | None = None
        if proxy and self.use_landlock:
            assert req.egress_socket is not None
            if self.use_bwrap:
                relay = (RELAY_PORT, str(egress_socket_inside(req.egress_socket)))
            else:  # no netns: the relay shares the host's loopback, so any free port (the helper sets the env)
                relay = (RELAY_PORT if netns else 0, str(req.egress_socket))
            env.update(proxy_env(relay[0] or None))
        elif proxy and self.use_bwrap and system_python():
            # No helper (no compiler, or no Landlock): the system python3 relays instead, ~20 ms more.
            assert req.egress_socket is not None
            relay = (RELAY_PORT, str(egress_socket_inside(req.egress_socket)))
            cmd = relay_argv(system_python() or "python3", *relay) + cmd
            env.update(proxy_env(RELAY_PORT))
        if self.use_landlock:
            assert self.caps.helper is not None
            # Under bwrap the hidden paths are already empty mounts, and host paths that the read rules
            # would name (siblings under /tmp) do not exist inside: Landlock there reads from `/`.
            inner = replace(req, hidden=()) if self.use_bwrap else req
            private = private_writable() if self.use_bwrap else ()
            cmd = helper_args(self.caps.helper, inner, abi, private, netns=netns, relay=relay) + cmd
        if self.use_bwrap:
            assert self.caps.bwrap is not None
            extra = (self.caps.helper,) if self.use_landlock and self.caps.helper else ()
            cmd = bwrap_args(self.caps.bwrap, req, extra + exec_roots(argv), egress=proxy) + cmd
        details = self._details(req, abi, netns, relay)
        return ConfinePlan(cmd, env, self.name, details, _gaps(req, self.use_bwrap, abi, netns, relay is not None))

    def _details(self, req: ConfineRequest, abi: int, netns: bool,
                 relay: tuple[int, str] | None = None) -> dict[str, object]:
        layers = (("netns", self.use_bwrap or netns), ("landlock-tcp", abi >= 4))
        net = "+".join(n for n, on in layers if on)
        proxy = req.network and req.egress_socket is not None
        extra: dict[str, object] = {}
        if proxy:
            extra = {"egress": list(req.egress), "network_layers": net or "none",
                     "relay": f"127.0.0.1:{relay[0] or 'any free port'}" if relay else None}
        return {
            "files": self.name,
            "network": "proxy" if relay else net if proxy else "open" if req.network else net,
            "cleanup": "pidns" if self.use_bwrap else "runner",
            "landlock_abi": abi or None,
            "bwrap_version": self.caps.bwrap_version if self.use_bwrap else None,
            "uid": "0 in a user namespace, no capabilities" if self.use_bwrap and self.caps.uid == 0
            else f"{self.caps.uid}, no capabilities" if self.use_landlock else str(self.caps.uid),
            **extra,
        }


def programs_of(argv: Sequence[str], path: str | None = None) -> list[str]:
    """The executables an argv runs: its program on `path` (default: this process's PATH), later tokens
    naming an executable file (`env -C DIR /venv/bin/python ...`), and the `#!` interpreter of each."""
    found = [shutil.which(argv[0], path=path) if argv and os.sep not in argv[0] else (argv[0] if argv else None)]
    found += [t for t in argv[1:] if t.startswith("/") and os.path.isfile(t) and os.access(t, os.X_OK)]
    out: list[str] = []
    for prog in (p for p in found if p):
        out.append(prog)
        try:
            with open(prog, "rb") as fh:
                head = fh.readline(512)
        except OSError:
            continue
        if head.startswith(b"#!"):
            interp = head[2:].strip().split(b" ")[0].decode("utf-8", "replace")
            if interp.startswith("/"):
                out.append(interp)
    return out


def exec_roots(argv: Sequence[str]) -> tuple[Path, ...]:
    """What the programs of `argv` need that the private tmpfs would hide: their install roots, read-only.

    Measured in a clean clone under /tmp: the venv's python (and a `#!` script's interpreter) vanished
    inside bwrap and every confined run exited 127. The programs are argv[0] and any later token naming an
    executable file (`env -C DIR /venv/bin/python ...`). `<root>/bin/<exe>` grants `<root>` (a venv needs
    its pyvenv.cfg and lib/), anything else its own folder; never a whole tmpfs dir.
    """
    paths = [Path(os.path.abspath(p)) for p in programs_of(argv)]
    tmpfs = {Path(d) for d in tmpfs_dirs()}
    roots: list[Path] = []
    for p in paths:
        for cand in (p, Path(os.path.realpath(p))):
            if not any(t in cand.parents for t in tmpfs):
                continue
            root = cand.parent.parent if cand.parent.name == "bin" else cand.parent
            if root in tmpfs or root == Path("/"):
                root = cand.parent
            if root not in tmpfs and root not in roots:
                roots.append(root)
    return tuple(roots)


def choose(mode: Mode, caps: Capabilities) -> Confiner | Unavailable:
    """The strongest confiner this machine gives for a policy.

    off: `none`. auto: bwrap+landlock > bwrap > landlock > none (the host records a risk for none).
    required: like auto, but with neither layer it is Unavailable and nothing may launch.
    """
    if mode not in ("auto", "required", "off"):
        raise ValueError(f"confine mode {mode!r} must be auto, required or off")
    if mode == "off":
        return LayeredConfiner(caps, False, False, "confinement is off by request")
    use_bwrap, use_landlock = caps.bwrap is not None, caps.landlock
    if not use_bwrap and not use_landlock:
        why = f"bwrap: {caps.bwrap_reason}; landlock: {caps.landlock_reason}, helper: {caps.helper_reason}"
        if mode == "required":
            return Unavailable(f"confinement is required and this machine has none ({why})")
        return LayeredConfiner(caps, False, False, why)
    return LayeredConfiner(caps, use_bwrap, use_landlock)
