"""Per-job cgroup v2 groups: the one cleanup mechanism that sees every descendant, `setsid` daemons included.

Owns creating a job's group under the writable cgroup2 hierarchy, joining a child to it before exec, listing
and killing its members, and removing it. It never decides *when* to kill; the process runner does.

Measured here (research/sandbox.md §2e): a process-group kill misses a double-forked `setsid` daemon that
keeps stdout open; writing `1` to `cgroup.kill` emptied the group in 4 ms. The hierarchy on this machine is
hybrid, with cgroup2 mounted at /sys/fs/cgroup/unified, so the mount is found from /proc/self/mounts rather
than assumed at /sys/fs/cgroup.

Resource limits (`Limits`, proctor.mechanisms.confine.limits): memory (+ swap), pids and CPU weight are set on
the job's group. Where the cgroup2 hierarchy lacks a controller (this machine: hybrid, cgroup2 offers only
`hugetlb`; memory, pids and cpu are bound to v1 hierarchies) the same limit is set on a v1 group of that
controller, which the child joins before exec as well. What is enforced, and by which hierarchy, is reported (`JobGroup.enforced`); a
limit that could not be set is a gap, never silently dropped.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from proctor.mechanisms.confine.limits import Limits, human

# Still imported from here by proctor.mechanisms.config.model until it imports it from limits.


def _cgroup2_mount() -> Path | None:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    return Path(parts[1])
    except OSError:
        return None
    return None


def _own_cgroup_path() -> str:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return "/"


def _v1_mount(controller: str) -> Path | None:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 4 and parts[2] == "cgroup" and controller in parts[3].split(","):
                    return Path(parts[1])
    except OSError:
        return None
    return None


def _own_v1_path(controller: str) -> str:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and controller in parts[1].split(","):
                    return parts[2]
    except OSError:
        pass
    return "/"


@cache
def v1_parent(controller: str) -> Path | None:
    """The v1 folder of `controller` under which job groups are made, or None (no v1 mount, not writable)."""
    mount = _v1_mount(controller)
    if mount is None:
        return None
    base = mount / _own_v1_path(controller).lstrip("/") / "proctor"
    try:
        base.mkdir(exist_ok=True)
    except OSError:
        return None
    return base if (base / "cgroup.procs").exists() else None


@cache
def _v2_controllers(parent: Path) -> set[str]:
    """Controllers usable in job groups under `parent`, enabling them down from the mount where allowed."""
    try:
        have = set((parent / "cgroup.controllers").read_text().split())
    except OSError:
        have = set()
    want = {"memory", "pids", "cpu"}
    if want <= have:
        return want
    mount = _cgroup2_mount()
    if mount is None:
        return have & want
    try:
        offered = set((mount / "cgroup.controllers").read_text().split()) & want
    except OSError:
        offered = set()
    if not offered:
        return set()  # hybrid hierarchy: the controllers are bound to v1; nothing to enable here
    # Enable top-down: each level's subtree_control (fails with EBUSY where the level holds processes,
    # the "no internal processes" rule; then the controller stays unavailable below it).
    chain = [parent, *parent.parents]
    chain = [d for d in reversed(chain) if d == mount or mount in d.parents]
    for ctl in sorted(offered):
        for d in chain[:-1]:
            try:
                if ctl not in (d / "cgroup.subtree_control").read_text().split():
                    (d / "cgroup.subtree_control").write_text(f"+{ctl}")
            except OSError:
                break
    try:
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(want & have)))
    except OSError:
        pass
    try:
        return set((parent / "cgroup.subtree_control").read_text().split()) & want
    except OSError:
        return set()


def _write(path: Path, value: str) -> str | None:
    try:
        path.write_text(value)
        return None
    except OSError as exc:
        return f"{path.name}: {exc.strerror or exc}"


@cache
def jobs_root() -> Path | None:
    """Where this host's job groups live, `<cgroup2>/<this process's group>/proctor`, made or not."""
    mount = _cgroup2_mount()
    # One shared parent for all proctor processes: job names are unique, so nothing is left per host pid.
    return None if mount is None else mount / _own_cgroup_path().lstrip("/") / "proctor"


def parent_dir() -> Path | None:
    """The folder under which this process can make job groups, or None. Detected by trying a mkdir."""
    base = jobs_root()
    if base is None:
        return None
    try:
        base.mkdir(exist_ok=True)
        probe = base / f"probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        ok = (probe / "cgroup.procs").exists() and (probe / "cgroup.kill").exists()
        probe.rmdir()
    except OSError:
        return None
    return base if ok else None


@dataclass
class JobGroup:
    path: Path
    _procs_fd: int = -1
    # controller -> the group holding it: `path` (v2) or a v1 group; what `enforced` and `limit_hit` read.
    ctl: dict[str, Path] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    enforced: dict[str, str] = field(default_factory=dict)  # limit -> "value (hierarchy)"
    gaps: list[str] = field(default_factory=list)
    _extra_fds: list[int] = field(default_factory=list)
    _v1_dirs: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, name: str, limits: Limits | None = None) -> JobGroup | None:
        parent = parent_dir()
        if parent is None:
            return None
        path = parent / name
        try:
            path.mkdir()
            fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return None
        group = cls(path, fd)
        if limits is not None:
            group._apply(limits, name)
        return group

    def _apply(self, limits: Limits, name: str) -> None:
        self.limits = limits
        needed = {"memory": limits.memory is not None, "pids": limits.pids is not None,
                  "cpu": limits.cpu_weight is not None}
        v2 = _v2_controllers(self.path.parent)
        for ctl, need in needed.items():
            if not need:
                continue
            if ctl in v2:
                self.ctl[ctl] = self.path
                continue
            base = v1_parent(ctl)
            if base is None:
                self.gaps.append(f"{ctl} limit not enforced: no {ctl} controller in cgroup v2 or v1")
                continue
            d = base / name
            try:
                d.mkdir()
                self._v1_dirs.append(d)
                self._extra_fds.append(os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
            except OSError as exc:
                self.gaps.append(f"{ctl} limit not enforced: {exc.strerror or exc}")
                continue
            self.ctl[ctl] = d
            if ctl == "memory" and limits.memory_total is not None:
                _write(base / "memory.limit_in_bytes", str(limits.memory_total))
        self._set_limits()

    def _set_limits(self) -> None:
        lim = self.limits
        for ctl, d in self.ctl.items():
            v1 = d != self.path
            tag = "cgroup v1" if v1 else "cgroup v2"
            errs: list[str | None] = []
            if ctl == "memory":
                if v1:
                    errs.append(_write(d / "memory.limit_in_bytes", str(lim.memory)))
                    if lim.swap is not None and (d / "memory.memsw.limit_in_bytes").exists():
                        errs.append(_write(d / "memory.memsw.limit_in_bytes", str(lim.memory + lim.swap)))
                else:
                    errs.append(_write(d / "memory.max", str(lim.memory)))
                    if lim.swap is not None and (d / "memory.swap.max").exists():
                        errs.append(_write(d / "memory.swap.max", str(lim.swap)))
                    _write(d / "memory.oom.group", "1")
                value = f"memory {human(lim.memory)} (+{human(lim.swap or 0)} swap)"
            elif ctl == "pids":
                errs.append(_write(d / "pids.max", str(lim.pids)))
                value = f"pids {lim.pids}"
            else:
                w = max(1, min(10_000, lim.cpu_weight))
                errs.append(_write(d / "cpu.shares", str(max(2, w * 1024 // 100))) if v1
                            else _write(d / "cpu.weight", str(w)))
                value = f"cpu weight {w}"
            bad = [e for e in errs if e]
            if bad:
                self.gaps.append(f"{ctl} limit not fully set ({tag}): {'; '.join(bad)}")
            self.enforced[ctl] = f"{value} ({tag})"

    def join_child(self) -> None:
        """Runs in the forked child before exec: move itself into the group, so nothing it forks escapes.

        Deliberately tiny (one write per hierarchy, on fds opened by the parent): code between fork and exec
        must not take locks another thread may hold.
        """
        for fd in self._extra_fds:
            os.write(fd, b"0")
        os.write(self._procs_fd, b"0")

    def fds(self) -> list[int]:
        """The fds `join_child` writes to (a child that closes what it inherited keeps these)."""
        return [fd for fd in (*self._extra_fds, self._procs_fd) if fd >= 0]

    def close_fd(self) -> None:
        if self._procs_fd >= 0:
            os.close(self._procs_fd)
            self._procs_fd = -1
        for fd in self._extra_fds:
            os.close(fd)
        self._extra_fds = []

    def _events(self, ctl: str, v2_file: str, v1_file: str) -> dict[str, int]:
        d = self.ctl.get(ctl)
        if d is None:
            return {}
        try:
            text = (d / (v2_file if d == self.path else v1_file)).read_text()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
        return out

    def peak_memory(self) -> int | None:
        d = self.ctl.get("memory")
        if d is None:
            return None
        for f in (("memory.peak",) if d == self.path else ("memory.max_usage_in_bytes",)):
            try:
                return int((d / f).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return None

    def limit_hit(self) -> str | None:
        """Which limit the kernel enforced on this job, with the observed value; None when none was."""
        mem = self._events("memory", "memory.events", "memory.oom_control")
        if mem.get("oom_kill", 0) > 0:
            peak = self.peak_memory()
            return (f"resource_limit: memory limit {human(self.limits.memory or 0)} reached: the kernel "
                    f"OOM-killed {mem['oom_kill']} process(es) (memory.events oom_kill {mem['oom_kill']}"
                    + (f", peak {human(peak)}" if peak else "") + ")")
        pids = self._events("pids", "pids.events", "pids.events")
        if pids.get("max", 0) > 0:
            return (f"resource_limit: pids limit {self.limits.pids} reached: {pids['max']} fork/clone call(s) "
                    f"refused (pids.events max {pids['max']})")
        return None

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def populated(self) -> bool:
        try:
            for line in (self.path / "cgroup.events").read_text().splitlines():
                if line.startswith("populated "):
                    return line.split()[1] == "1"
        except OSError:
            return False
        return bool(self.pids())

    def signal(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, wait_s: float = 2.0) -> bool:
        """SIGKILL every member at once; True when the group is empty afterwards."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            self.signal(signal.SIGKILL)
        end = time.monotonic() + wait_s
        while self.populated():
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    def remove(self) -> None:
        self.close_fd()
        for path in (self.path, *self._v1_dirs):
            _rmdir(path)


def _rmdir(path: Path) -> None:
    for _ in range(500):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            # EBUSY for a moment after the last member was reaped (measured: ~1 ms); poll finely.
            time.sleep(0.001)


def group_name(prefix: str) -> str:
    """`<prefix>-<host pid>-<ns>`: unique, and names the host that owns the group (see `sweep_orphans`)."""
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"


def sweep_orphans() -> int:
    """Kill and remove the groups of hosts that died without cleaning up (a `kill -9`ed listener, a crash).

    Their agents would otherwise run on unwatched; returns how many processes were killed. A group whose
    host pid is alive (or was reused) is left alone: conservative by construction.
    """
    parent = parent_dir()
    if parent is None:
        return 0
    killed = 0
    for d in parent.iterdir():
        parts = d.name.rsplit("-", 2)
        if not d.is_dir() or len(parts) != 3 or not parts[1].isdigit():
            continue
        if Path(f"/proc/{parts[1]}").exists():
            continue
        group = JobGroup(d)
        killed += len(group.pids())
        group.kill()
        group.remove()
    for ctl in ("memory", "pids", "cpu"):
        base = v1_parent(ctl)
        if base is None:
            continue
        for d in base.iterdir():
            parts = d.name.rsplit("-", 2)
            if d.is_dir() and len(parts) == 3 and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
                try:
                    d.rmdir()  # empty once the v2 group was killed; a busy one is left for the next sweep
                except OSError:
                    pass
    return killed
