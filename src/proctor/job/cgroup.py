"""Per-job cgroup v2 groups: the one cleanup mechanism that sees every descendant, `setsid` daemons included.

Owns creating a job's group under the writable cgroup2 hierarchy, joining a child to it before exec, listing
and killing its members, and removing it. It never decides *when* to kill; the process runner does.

Measured here (research/sandbox.md §2e): a process-group kill misses a double-forked `setsid` daemon that
keeps stdout open; writing `1` to `cgroup.kill` emptied the group in 4 ms. The hierarchy on this machine is
hybrid, with cgroup2 mounted at /sys/fs/cgroup/unified, so the mount is found from /proc/self/mounts rather
than assumed at /sys/fs/cgroup.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path


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


@cache
def parent_dir() -> Path | None:
    """The folder under which this process can make job groups, or None. Detected by trying a mkdir."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    # One shared parent for all proctor processes: job names are unique, so nothing is left per host pid.
    base = mount / _own_cgroup_path().lstrip("/") / "proctor"
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

    @classmethod
    def create(cls, name: str) -> JobGroup | None:
        parent = parent_dir()
        if parent is None:
            return None
        path = parent / name
        try:
            path.mkdir()
            fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return None
        return cls(path, fd)

    def join_child(self) -> None:
        """Runs in the forked child before exec: move itself into the group, so nothing it forks escapes.

        Deliberately tiny (one write on an fd opened by the parent): code between fork and exec must not
        take locks another thread may hold.
        """
        os.write(self._procs_fd, b"0")

    def close_fd(self) -> None:
        if self._procs_fd >= 0:
            os.close(self._procs_fd)
            self._procs_fd = -1

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
        for _ in range(500):
            try:
                self.path.rmdir()
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
    return killed
