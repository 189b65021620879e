"""Spawning an agent process tree under a hard deadline, with bounded output tails and a whole-tree kill.

Owns: the `ProcessRunner` seam, its real implementation `LocalRunner`, and the bounded `Tail`. It never
interprets output (classification and parsing are elsewhere) and never involves a shell: argv is a list.

Cleanup, measured on this machine (research/sandbox.md §2e and tests/test_process.py): a process-group kill
misses a double-forked `setsid` daemon that still holds stdout; a cgroup v2 group (joined before exec) and
a child subreaper both catch it. The cgroup is used where it can be made; otherwise the host becomes a
subreaper so orphans re-parent to it, and the tree is found by walking descendants and the job's marker.

Limits (`Limits`, cgroup.py): memory, pids and CPU weight are the kernel's, on the job's groups; the wait
loop reads their events and ends the run at the first hit (`killed_reason` "resource_limit: ..."). Disk is
watched: the bytes a run adds to its writable roots (its cwd and `TMPDIR`, or `Spawn.disk_roots`) are summed
periodically from allocated blocks (sparse files count what they occupy; hard links once), plus files its
processes hold open after unlinking them, and the run is killed past the cap. A watcher rather than a tmpfs:
the worktree cannot be a tmpfs, and tmpfs pages are RAM (charged to the memory limit), so a 10 GiB TMPDIR
would be 10 GiB of the host's memory; `io.max` limits bandwidth, not space. Its price is overshoot between
two polls (at most the write rate times the interval) and a walk of the roots per poll.

The stop switch and cancel (`Spawn.poll`) are read once more as the last thing before the spawn: nothing
is launched after `proctor stop`, however long the setup before it took.
"""

from __future__ import annotations

import ctypes
import dataclasses
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

from proctor.mechanisms.confine.cgroup import JobGroup, Limits, group_name, human

TAIL_BYTES = 1_000_000
READ_CHUNK = 1 << 16
TERM_GRACE_S = 2.0
POLL_S = 0.1
KILL_SWEEPS_S = 5.0  # how long kill() keeps sweeping a tree that keeps forking
LEFTOVER_SETTLE_S = 0.3  # a member still alive this long after the agent exited stayed: it is a leftover

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
    limits: Limits | None = None  # None: the runner's
    disk_roots: tuple[Path, ...] | None = None  # None: cwd and env's TMPDIR


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
    limits: tuple[str, ...] = ()  # what was enforced, e.g. "memory 8 GiB (+0 B swap) (cgroup v1)"
    limit_gaps: tuple[str, ...] = ()  # limits asked for and not enforced, with why
    launched: bool = True  # False: poll said stop/cancel at the last check before the spawn

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None


class ProcessRunner(Protocol):
    def run(self, spawn: Spawn) -> Exit: ...


class Limited:
    """A runner that gives every spawn these limits (and disk roots), and keeps what the last run enforced:
    how the host applies one job's limits to its agent, validation and probe through any `ProcessRunner`."""

    def __init__(self, inner: ProcessRunner, limits: Limits, disk_roots: tuple[Path, ...] | None = None) -> None:
        self.inner, self.limits, self.disk_roots = inner, limits, disk_roots
        self.enforced: tuple[str, ...] = ()
        self.gaps: tuple[str, ...] = ()

    def run(self, spawn: Spawn) -> Exit:
        spawn = dataclasses.replace(spawn, limits=spawn.limits or self.limits,
                                    disk_roots=spawn.disk_roots if spawn.disk_roots is not None else self.disk_roots)
        ex = self.inner.run(spawn)
        self.enforced = getattr(ex, "limits", ()) or self.enforced
        self.gaps = getattr(ex, "limit_gaps", ()) or self.gaps
        return ex


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


class LocalRunner:
    """The real runner: own session and process group, job cgroup or subreaper, deadline, bounded tails."""

    # Pids this process spawned and will wait for itself (any runner, any thread). As subreaper the host also
    # inherits orphans; a zombie that is not one of these is an orphan's and is reaped here, never one whose
    # exit status a Popen is about to read. Process-wide by nature: so is the subreaper bit.
    _own: ClassVar[set[int]] = set()
    _own_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, use_cgroup: bool = True, limits: Limits | None = None) -> None:
        self.use_cgroup = use_cgroup
        # Kernel limits by default; the disk watcher only where a caller asks (it walks the roots).
        self.limits = limits if limits is not None else dataclasses.replace(Limits.default(), disk=None)

    def run(self, spawn: Spawn) -> Exit:
        start = time.monotonic()
        deadline = start + spawn.deadline_s
        limits = spawn.limits or self.limits
        group = JobGroup.create(group_name(spawn.name), limits) if self.use_cgroup else None
        cleanup = "cgroup" if group is not None else ("subreaper" if _become_subreaper() else "pgid")
        enforced = tuple(group.enforced.values()) if group is not None else ()
        gaps = list(group.gaps) if group is not None else []
        if group is None and any(v is not None for v in (limits.memory, limits.pids, limits.cpu_weight)):
            gaps.append("memory, pids and CPU limits not enforced: no writable cgroup on this machine")
        marker_value = f"{spawn.name}:{time.monotonic_ns()}"
        env = dict(spawn.env)
        env["PROCTOR_RUN_MARKER"] = marker_value
        disk: _DiskWatch | None = None
        if limits.disk is not None:
            roots = spawn.disk_roots if spawn.disk_roots is not None else tuple(
                Path(p) for p in (spawn.cwd, env.get("TMPDIR")) if p)
            disk = _DiskWatch(roots, limits.disk, group)
            enforced += (f"disk {human(limits.disk)} added to {', '.join(map(str, disk.roots))} (watched)",)
        gaps_t = tuple(gaps)

        # The last check before the launch: a stop engaged during the setup (worktree, version probe,
        # confinement, the disk baseline) launches nothing.
        if spawn.poll is not None:
            try:
                reason = spawn.poll()
            except Exception as exc:  # noqa: BLE001 - a poll that fails is a reason not to launch
                reason = f"stopped: the stop check failed ({exc})"
            if reason:
                if group is not None:
                    group.remove()
                return Exit(exit_code=None, killed_reason=reason, cleanup=cleanup, launched=False,
                            duration_s=time.monotonic() - start, limits=enforced, limit_gaps=gaps_t)

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
                preexec_fn=_preexec(group, None),  # RLIMIT_FSIZE off: it broke sparse files and hid unlinked-file kills
            )
        except (OSError, subprocess.SubprocessError, ValueError) as exc:  # ValueError: a NUL in argv/env
            self._own_lock.release()
            if group is not None:
                group.remove()
            return Exit(exit_code=None, spawn_error=f"{type(exc).__name__}: {exc}", cleanup=cleanup,
                        limits=enforced, limit_gaps=gaps_t)
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
        if disk is not None:
            disk.start(tree)

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
            hit = (group.limit_hit() if group is not None else None) or (disk.hit if disk is not None else None)
            if hit:
                killed_reason = hit
                break
            if spawn.poll is not None:
                reason = spawn.poll()
                if reason:
                    killed_reason = reason
                    break

        leftovers = 0
        if timed_out or killed_reason:
            # TERM first, a short grace, then KILL the whole tree: some CLIs ignore TERM for hours. A run
            # past a resource limit gets no grace: a fork bomb or a runaway allocation would use it.
            if not (killed_reason or "").startswith("resource_limit"):
                tree.signal_all(signal.SIGTERM)
            grace_end = time.monotonic() + (0 if (killed_reason or "").startswith("resource_limit")
                                            else spawn.term_grace_s)
            while time.monotonic() < grace_end and tree.alive():
                time.sleep(0.02)
            tree.kill()
        else:
            # The agent exited; nothing it started may outlive the job or hold its pipes open. A member
            # caught mid-exit is not one that stayed: in a pid namespace (bwrap) the kernel kills every
            # member with the namespace's init, and under load one was counted before it was gone (a
            # leftover "running after it exited" in CI). So what is still alive a moment later counts.
            left = [p for p in tree.alive() if p.pid != proc.pid]
            settle = time.monotonic() + LEFTOVER_SETTLE_S
            while left and time.monotonic() < settle:
                time.sleep(0.02)
                left = [p for p in tree.alive() if p.pid != proc.pid]
            leftovers = len(left)
            if leftovers:
                tree.kill()
            # The kernel may have killed a member (the OOM killer) or refused a fork just before the exit:
            # the run was still ended, or changed, by a limit.
            hit = (group.limit_hit() if group is not None else None) or (disk.final() if disk is not None else None)
            if hit:
                killed_reason = hit
        if disk is not None:
            disk.stop()
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
            limits=enforced,
            limit_gaps=gaps_t,
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


DISK_POLL_S = 0.1


def _preexec(group: JobGroup | None, disk: int | None) -> Callable[[], None] | None:
    """What the child does between fork and exec: join the job's groups, and cap any one file it writes at
    the disk limit (RLIMIT_FSIZE: the kernel refuses the byte past it, so a single huge file never
    overshoots between two polls of the watcher). Syscalls only: no lock another thread may hold."""
    if disk is None:
        return group.join_child if group is not None else None
    import resource

    cap = (disk, disk)

    def child() -> None:
        if group is not None:
            group.join_child()
        resource.setrlimit(resource.RLIMIT_FSIZE, cap)

    return child


def _usage(roots: Sequence[Path]) -> int:
    """Bytes allocated beneath `roots` (st_blocks, no symlink followed, each inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(r) for r in roots]
    while stack:
        top = stack.pop()
        try:
            it = os.scandir(top)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return total


def _unlinked_open(pids: Sequence[int]) -> int:
    """Bytes held by files the run's processes keep open after unlinking them (invisible to a walk)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if st.st_nlink == 0 and (st.st_dev, st.st_ino) not in seen and (st.st_mode & 0o170000) == 0o100000:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class _DiskWatch:
    """Polls the bytes a run added to its writable roots; `hit` names the cap once they pass it."""

    def __init__(self, roots: Sequence[Path], cap: int, group: JobGroup | None) -> None:
        # Nested roots (a TMPDIR inside the cwd) are walked once.
        rs = sorted({Path(os.path.abspath(r)) for r in roots}, key=lambda p: len(p.parts))
        self.roots = tuple(r for i, r in enumerate(rs) if not any(o in r.parents for o in rs[:i]))
        self.cap = cap
        self.group = group
        self.baseline = _usage(self.roots)
        self.hit: str | None = None
        self.peak = 0
        self._stop = threading.Event()
        self._tree: _Tree | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self, tree: _Tree) -> None:
        self._tree = tree
        self._thread.start()

    def _pids(self) -> list[int]:
        if self.group is not None:
            return self.group.pids()
        return [p.pid for p in self._tree.alive()] if self._tree is not None else []

    def check(self) -> str | None:
        added = _usage(self.roots) + _unlinked_open(self._pids()) - self.baseline
        self.peak = max(self.peak, added)
        if added >= self.cap and self.hit is None:
            self.hit = (f"resource_limit: disk limit {human(self.cap)} reached: the job added {human(added)} "
                        f"({added} bytes) to {', '.join(map(str, self.roots))}")
        return self.hit

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if self.check():
                    return
            except Exception:  # noqa: BLE001 - a failing walk must not end the watch silently
                pass
            # Adaptive: a big tree is walked at most ~10% of the time.
            self._stop.wait(max(DISK_POLL_S, 10 * (time.monotonic() - t0)))

    def final(self) -> str | None:
        """One last look after the run exited (it may have written its last bytes just before)."""
        return self.hit or self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


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
