"""Spawning an agent process tree under a hard deadline, with bounded output tails and a whole-tree kill.

Owns: the `ProcessRunner` seam, its real implementation `LocalRunner`, and the bounded `Tail`. It never
interprets output (classification and parsing are elsewhere) and never involves a shell: argv is a list.

Cleanup, measured on this machine (research/sandbox.md §2e and tests/test_process.py): a process-group kill
misses a double-forked `setsid` daemon that still holds stdout; a cgroup v2 group (joined before exec) and
a child subreaper both catch it. The cgroup is used where it can be made; otherwise the host becomes a
subreaper so orphans re-parent to it, and the tree is found by walking descendants and the job's marker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import ClassVar, Protocol

import psutil

from proctor.job.cgroup import JobGroup, group_name

TAIL_BYTES = 1_000_000
READ_CHUNK = 1 << 16
TERM_GRACE_S = 2.0
POLL_S = 0.1

# (stream name, chunk) -> a reason to end the run now, or None. Called from the drain threads.
Watch = Callable[[str, bytes], str | None]
# () -> a reason to end the run now (stop switch, cancel, lease lost), or None. Polled by the wait loop.
Poll = Callable[[], str | None]


class Tail:
    """The last `cap` bytes of a stream; memory stays O(cap) however much flows through."""

    def __init__(self, cap: int = TAIL_BYTES) -> None:
        self.cap = cap
        self._buf = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self._buf += chunk
        if len(self._buf) > 2 * self.cap:
            del self._buf[: len(self._buf) - self.cap]

    @property
    def data(self) -> bytes:
        return bytes(self._buf[-self.cap :]) if self.cap else b""

    @property
    def dropped(self) -> int:
        return self.total - len(self.data)


@dataclass(frozen=True)
class Spawn:
    argv: Sequence[str]
    cwd: Path
    env: Mapping[str, str]
    deadline_s: float
    stdin: bytes | None = None  # None: /dev/null. Several agent CLIs hang forever on an open stdin pipe.
    tail_bytes: int = TAIL_BYTES
    watch: Watch | None = None
    poll: Poll | None = None
    name: str = "job"  # unique per run: names the cgroup
    term_grace_s: float = TERM_GRACE_S


@dataclass(frozen=True)
class Exit:
    exit_code: int | None  # None: never started (see spawn_error)
    timed_out: bool = False
    killed_reason: str | None = None  # poll/watch reason that ended the run
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    duration_s: float = 0.0
    cleanup: str = "none"  # "cgroup" | "subreaper"
    leftovers_killed: int = 0  # processes still alive after the main one exited
    spawn_error: str | None = None
    pid: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None


class ProcessRunner(Protocol):
    def run(self, spawn: Spawn) -> Exit: ...


PR_SET_CHILD_SUBREAPER = 36


@cache
def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class _Tree:
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
        # Repeat: a fork loop can add members between one sweep and the next.
        for _ in range(20):
            members = self.alive()
            if not members:
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


class LocalRunner:
    """The real runner: own session and process group, job cgroup or subreaper, deadline, bounded tails."""

    # Pids this process spawned and will wait for itself (any runner, any thread). As subreaper the host also
    # inherits orphans; a zombie that is not one of these is an orphan's and is reaped here, never one whose
    # exit status a Popen is about to read. Process-wide by nature: so is the subreaper bit.
    _own: ClassVar[set[int]] = set()
    _own_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, use_cgroup: bool = True) -> None:
        self.use_cgroup = use_cgroup

    def run(self, spawn: Spawn) -> Exit:
        start = time.monotonic()
        deadline = start + spawn.deadline_s
        group = JobGroup.create(group_name(spawn.name)) if self.use_cgroup else None
        cleanup = "cgroup" if group is not None else ("subreaper" if _become_subreaper() else "pgid")
        marker_value = f"{spawn.name}:{time.monotonic_ns()}"
        env = dict(spawn.env)
        env["PROCTOR_RUN_MARKER"] = marker_value

        # Registered under the lock that orphan reaping takes: no window where our own exited child looks
        # like an orphan's zombie to another thread.
        self._own_lock.acquire()
        try:
            proc = subprocess.Popen(
                list(spawn.argv),
                cwd=spawn.cwd,
                env=env,
                stdin=subprocess.PIPE if spawn.stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                # Joining the job group before exec is the one race-free way in pure Python: a child moved
                # after Popen returns could already have forked. The callback is one os.write.
                preexec_fn=group.join_child if group is not None else None,
            )
        except (OSError, subprocess.SubprocessError, ValueError) as exc:  # ValueError: a NUL in argv/env
            self._own_lock.release()
            if group is not None:
                group.remove()
            return Exit(exit_code=None, spawn_error=f"{type(exc).__name__}: {exc}", cleanup=cleanup)
        self._own.add(proc.pid)
        self._own_lock.release()
        if group is not None:
            group.close_fd()

        tree = _Tree(proc.pid, ("PROCTOR_RUN_MARKER", marker_value), group)
        tails = {"stdout": Tail(spawn.tail_bytes), "stderr": Tail(spawn.tail_bytes)}
        watch_reason: list[str] = []

        def drain(name: str, fh) -> None:
            fd = fh.fileno()
            tail = tails[name]
            try:
                while True:
                    chunk = os.read(fd, READ_CHUNK)
                    if not chunk:
                        break
                    tail.add(chunk)
                    if spawn.watch is not None and not watch_reason:
                        try:
                            reason = spawn.watch(name, chunk)
                        except Exception:  # noqa: BLE001 - a faulty watcher must never stop the drain
                            reason = None
                        if reason:
                            watch_reason.append(reason)
            except OSError:
                pass
            finally:
                fh.close()

        threads = [
            threading.Thread(target=drain, args=("stdout", proc.stdout), daemon=True),
            threading.Thread(target=drain, args=("stderr", proc.stderr), daemon=True),
        ]
        if spawn.stdin is not None:
            threads.append(threading.Thread(target=_feed, args=(proc.stdin, spawn.stdin), daemon=True))
        for t in threads:
            t.start()

        timed_out = False
        killed_reason: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                proc.wait(timeout=min(POLL_S, remaining))
                break
            except subprocess.TimeoutExpired:
                pass
            if watch_reason:
                killed_reason = watch_reason[0]
                break
            if spawn.poll is not None:
                reason = spawn.poll()
                if reason:
                    killed_reason = reason
                    break

        leftovers = 0
        if timed_out or killed_reason:
            # TERM first, a short grace, then KILL the whole tree: some CLIs ignore TERM for hours.
            tree.signal_all(signal.SIGTERM)
            grace_end = time.monotonic() + spawn.term_grace_s
            while time.monotonic() < grace_end and tree.alive():
                time.sleep(0.02)
            tree.kill()
        else:
            # The agent exited; nothing it started may outlive the job or hold its pipes open.
            left = [p for p in tree.alive() if p.pid != proc.pid]
            leftovers = len(left)
            if leftovers:
                tree.kill()
        exit_code = proc.wait()
        tree.root_reaped = True
        with self._own_lock:
            self._own.discard(proc.pid)
        if cleanup == "subreaper":
            self._reap_orphans()

        # Drains share the job's deadline; after the kill the pipes close at once.
        for t in threads:
            t.join(timeout=max(0.5, deadline - time.monotonic()))
        if group is not None:
            group.remove()
        return Exit(
            exit_code=exit_code,
            timed_out=timed_out,
            killed_reason=killed_reason,
            stdout=tails["stdout"].data,
            stderr=tails["stderr"].data,
            stdout_dropped=tails["stdout"].dropped,
            stderr_dropped=tails["stderr"].dropped,
            duration_s=time.monotonic() - start,
            cleanup=cleanup,
            leftovers_killed=leftovers,
            pid=proc.pid,
        )


    def _reap_orphans(self) -> None:
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for c in children:
            try:
                zombie = c.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                continue
            with self._own_lock:
                if zombie and c.pid not in self._own:
                    try:
                        os.waitpid(c.pid, os.WNOHANG)
                    except ChildProcessError:
                        pass


def _feed(fh, data: bytes) -> None:
    try:
        fh.write(data)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            fh.close()
        except OSError:
            pass
