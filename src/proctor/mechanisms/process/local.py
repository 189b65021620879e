"""Spawning an agent process tree under a hard deadline, with bounded output tails and a whole-tree kill.

Owns: the `ProcessRunner` seam, its real implementation `LocalRunner`, `Limited`, and the bounded `Tail`. It never
interprets output (classification and parsing are elsewhere) and never involves a shell: argv is a list. A
spawn's request and result are proctor.mechanisms.process.spawn's; finding and killing its tree (and why a
cgroup or a subreaper) proctor.mechanisms.process.tree's.

Limits (`Limits`, proctor.mechanisms.confine.limits): memory, pids and CPU weight are the kernel's, on the job's
groups (proctor.mechanisms.confine.cgroup); the wait loop reads their events and ends the run at the first hit
(`killed_reason` "resource_limit: ..."). Disk is watched (proctor.mechanisms.confine.disk says how, and why not
a tmpfs), and the run is killed past the cap.

The stop switch and cancel (`Spawn.poll`) are read once more as the last thing before the spawn: nothing
is launched after `proctor stop`, however long the setup before it took.
"""

from __future__ import annotations

import dataclasses
import math
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import ClassVar, Protocol

import psutil

from proctor.mechanisms.confine.cgroup import JobGroup, group_name
from proctor.mechanisms.confine.disk import DiskWatch
from proctor.mechanisms.confine.limits import Limits, crowd, human
from proctor.mechanisms.process.held import Held
from proctor.mechanisms.process.spawn import TAIL_BYTES, Exit, Spawn
from proctor.mechanisms.process.tree import ProcessTree, become_subreaper, dying

# Still imported from here by services and surfaces (Watch, Poll) until they import them from spawn.

READ_CHUNK = 1 << 16
POLL_S = 0.1  # between two checks of the run's limits and stop switch, on a machine with a core to spare
POLL_MAX_S = 1.0  # however crowded the machine: the longest a stop or a limit waits to be seen
LEFTOVER_SETTLE_S = 0.3  # a member still alive this long after the agent exited stayed: it is a leftover


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
        cleanup = "cgroup" if group is not None else ("subreaper" if become_subreaper() else "pgid")
        enforced = tuple(group.enforced.values()) if group is not None else ()
        gaps = list(group.gaps) if group is not None else []
        if group is None and any(v is not None for v in (limits.memory, limits.pids, limits.cpu_weight)):
            gaps.append("memory, pids and CPU limits not enforced: no writable cgroup on this machine")
        marker_value = f"{spawn.name}:{time.monotonic_ns()}"
        env = dict(spawn.env)
        env["PROCTOR_RUN_MARKER"] = marker_value
        popen = dict(args=list(spawn.argv), cwd=spawn.cwd, env=env,
                     stdin=subprocess.PIPE if spawn.stdin is not None else subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        disk: DiskWatch | None = None
        roots: tuple[Path, ...] = ()
        if limits.disk is not None:
            roots = spawn.disk_roots if spawn.disk_roots is not None else tuple(
                Path(p) for p in (spawn.cwd, env.get("TMPDIR")) if p)
        gaps_t = tuple(gaps)

        def not_launched(proc: subprocess.Popen | None, **why) -> Exit:
            if proc is not None:  # a held child told not to exec, or whose exec failed: it has exited
                proc.wait()
                for f in (proc.stdin, proc.stdout, proc.stderr):
                    if f is not None:
                        f.close()
                with self._own_lock:
                    self._own.discard(proc.pid)
            if group is not None:
                group.remove()
            return Exit(exit_code=None, cleanup=cleanup, limits=enforced, limit_gaps=gaps_t, **why)

        # With a disk baseline to walk and a group to join, the child is forked first and held before its
        # exec (proctor.mechanisms.process.held): the join's wait in the kernel passes beside the walk.
        held: Held | None = None
        proc: subprocess.Popen | None = None
        if group is not None and roots and spawn.argv:
            # Registered under the lock that orphan reaping takes: no window where our own exited child
            # looks like an orphan's zombie to another thread. Under it too, the held child's pipes exist
            # only while no other runner's child can be forked with a copy of them.
            with self._own_lock:
                held = Held(spawn.argv, env, group)
                held.block_signals()
                try:
                    proc = subprocess.Popen(**popen, preexec_fn=held.preexec)
                except (OSError, subprocess.SubprocessError, ValueError) as exc:  # ValueError: a NUL
                    held.abandon()
                    return not_launched(None, spawn_error=f"{type(exc).__name__}: {exc}")
                finally:
                    held.unblock_signals()
                self._own.add(proc.pid)
                held.forked()
        try:
            if limits.disk is not None:
                disk = DiskWatch(roots, limits.disk, group)
                enforced += (f"disk {human(limits.disk)} added to {', '.join(map(str, disk.roots))} (watched)",)
            # The last check before the launch: a stop engaged during the setup (worktree, version probe,
            # confinement, the disk baseline) launches nothing.
            reason = None
            if spawn.poll is not None:
                try:
                    reason = spawn.poll()
                except Exception as exc:  # noqa: BLE001 - a poll that fails is a reason not to launch
                    reason = f"stopped: the stop check failed ({exc})"
        except BaseException:
            if held is not None:
                held.release(go=False)
                not_launched(proc)
            raise
        if reason:
            if held is not None:
                held.release(go=False)
            return not_launched(proc, killed_reason=reason, launched=False, duration_s=time.monotonic() - start)

        if held is not None:
            failed = held.release(go=True)
            if failed is not None:
                return not_launched(proc, spawn_error=f"{type(failed).__name__}: {failed}")
        else:
            with self._own_lock:
                try:
                    proc = subprocess.Popen(
                        **popen,
                        # Joining the job group before exec is the one race-free way in pure Python: a child
                        # moved after Popen returns could already have forked. The callback is one os.write.
                        preexec_fn=group.join_child if group is not None else None,
                    )
                except (OSError, subprocess.SubprocessError, ValueError) as exc:  # ValueError: a NUL in argv/env
                    return not_launched(None, spawn_error=f"{type(exc).__name__}: {exc}")
                self._own.add(proc.pid)
        if group is not None:
            group.close_fd()

        tree = ProcessTree(proc.pid, ("PROCTOR_RUN_MARKER", marker_value), group)
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
            disk.start(lambda: [p.pid for p in tree.alive()])

        timed_out = False
        killed_reason: str | None = None
        exited = _ExitWatch(proc)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            # An exit is seen at once (a pidfd); the checks below wait longer on a crowded machine.
            if exited.wait(min(POLL_S * crowd(), POLL_MAX_S, remaining)):
                break
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
            # leftover "running after it exited" in CI). So what is still alive a moment later counts, and
            # not what the kernel is already ending (50 jobs at once on 2 cores: two patch jobs of 50 were
            # said to leave a process, each a member killed with its namespace that had not yet run).
            def staying() -> list[psutil.Process]:
                return [p for p in tree.alive() if p.pid != proc.pid and not dying(p.pid)]

            left = staying()
            settle = time.monotonic() + LEFTOVER_SETTLE_S
            while left and time.monotonic() < settle:
                time.sleep(0.02)
                left = staying()
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
        exited.close()
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


class _ExitWatch:
    """Waits for a child's exit, woken by the kernel the moment it exits (a pidfd, Linux 5.3+), where
    `Popen.wait(timeout)` polls with growing sleeps: a no-op agent's exit was seen ~3 ms late."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.fd: int | None = None
        self._poll: select.poll | None = None
        try:
            self.fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # an older kernel or Python: Popen's own wait
            return
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """True once the child exited (not yet reaped: `proc.wait()` does that), False after `timeout`."""
        if self._poll is None:
            try:
                self.proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        return bool(self._poll.poll(max(0, math.ceil(timeout * 1000))))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = close  # a run that raised on its way out still gives the fd back


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
