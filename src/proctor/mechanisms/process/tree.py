"""Finding and killing one run's whole process tree, `setsid` daemons included where the machine allows.

Owns `ProcessTree` (a run's members, by its job cgroup where there is one, else by descent from the root and
the run's marker among this host's orphans), and `become_subreaper`. It never decides when to kill: the
process runner (proctor.mechanisms.process.local) does.

Cleanup, measured on this machine (research/sandbox.md §2e and tests/test_process.py): a process-group kill
misses a double-forked `setsid` daemon that still holds stdout; a cgroup v2 group (joined before exec) and
a child subreaper both catch it. The cgroup is used where it can be made; otherwise the host becomes a
subreaper so orphans re-parent to it, and the tree is found by walking descendants and the job's marker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass, field
from functools import cache

import psutil

from proctor.mechanisms.confine.cgroup import JobGroup

KILL_SWEEPS_S = 5.0  # how long kill() keeps sweeping a tree that keeps forking
PR_SET_CHILD_SUBREAPER = 36


@cache
def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def dying(pid: int) -> bool:
    """The kernel has this process on its way out: in exit already, or a SIGKILL pending it cannot refuse
    (the members of a pid namespace whose init exited get one each, and under load they can wait a while to
    run it). Read from /proc; a process gone is dying too."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X", b"x") or int(fields[6]) & PF_EXITING:
            return True
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & SIGKILL_BIT:
                    return True
    except (OSError, IndexError, ValueError):
        return True
    return False


@dataclass
class ProcessTree:
    """Finds and kills one run's processes, by cgroup where possible, else by descent and marker."""

    root_pid: int
    marker: tuple[str, str]
    group: JobGroup | None
    seen: set[int] = field(default_factory=set)
    root_reaped: bool = False  # after the wait, root_pid may name an unrelated process

    def _members(self) -> list[psutil.Process]:
        if self.group is not None:
            out = []
            for pid in self.group.pids():
                try:
                    out.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
            return out
        procs: dict[int, psutil.Process] = {}
        if not self.root_reaped:
            try:
                root = psutil.Process(self.root_pid)
                procs[root.pid] = root
                for p in root.children(recursive=True):
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        # Orphans (a `setsid` daemon whose parent exited) re-parent to us as subreaper; claim those that
        # carry this run's marker. A daemon that scrubbed its environment is invisible here: that is why
        # the cgroup is preferred and the result names which cleanup ran.
        key, value = self.marker
        for p in psutil.Process().children(recursive=True):
            if p.pid in procs:
                continue
            try:
                if p.environ().get(key) == value:
                    procs[p.pid] = p
                    for c in p.children(recursive=True):
                        procs[c.pid] = c
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return list(procs.values())

    def alive(self) -> list[psutil.Process]:
        out = []
        members = self._members()
        self.seen.update(p.pid for p in members)
        for p in members:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def signal_all(self, sig: int) -> None:
        """One signal to every member: the process group at once, then those that left it (setsid).

        Never twice to the same process: a CLI that exits cleanly on its first TERM can die of a second one
        delivered mid-shutdown, which would turn its exit 0 into -15.
        """
        try:
            os.killpg(self.root_pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self._members():
            try:
                if os.getpgid(p.pid) != self.root_pid:
                    p.send_signal(sig)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass

    def kill(self) -> None:
        if self.group is not None:
            self.group.kill()
        # Repeat until none is left (bounded in time, not in sweeps, which a loaded machine stretches): a
        # fork loop can add members between one sweep and the next.
        deadline = time.monotonic() + KILL_SWEEPS_S
        while time.monotonic() < deadline:
            if not self.alive():
                break
            self.signal_all(signal.SIGKILL)
            time.sleep(0.01)
        self._reap()

    def _reap(self) -> None:
        # As subreaper we inherit this tree's orphans; reap their zombies so a long-lived host does not
        # collect them. Only pids of this tree: waitpid(-1) would steal another job's exit status.
        for pid in self.seen - {self.root_pid}:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
