"""The disk limit of one run: the bytes it adds to its writable roots, polled, against the cap.

Owns `DiskWatch`. It never kills: it names the hit (`hit`, "resource_limit: ..."), and the process runner
(proctor.mechanisms.process.local) ends the run.

Disk is watched: the bytes a run adds to its writable roots (its cwd and `TMPDIR`, or `Spawn.disk_roots`) are summed
periodically from allocated blocks (sparse files count what they occupy; hard links once), plus files its
processes hold open after unlinking them, and the run is killed past the cap. A watcher rather than a tmpfs:
the worktree cannot be a tmpfs, and tmpfs pages are RAM (charged to the memory limit), so a 10 GiB TMPDIR
would be 10 GiB of the host's memory; `io.max` limits bandwidth, not space. Its price is overshoot between
two polls (at most the write rate times the interval) and a walk of the roots per poll.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from proctor.mechanisms.confine.cgroup import JobGroup
from proctor.mechanisms.confine.limits import crowd, human

DISK_POLL_S = 0.1
# A watch spends at most this share of one core on its walks, and waits at most DISK_POLL_MAX_S between two.
# Bounded by wall time alone (a walk at most 10% of it), each of 20 jobs at once on 2 cores walked its
# 2,000 files every 0.1-0.2 s: the watches took more CPU than the jobs' own tests (issue 44).
DISK_CPU_SHARE = 0.01
DISK_POLL_MAX_S = 2.0
DU_TIMEOUT_S = 600.0
_DU = shutil.which("du", path="/usr/bin:/bin")


def _usage(roots: Sequence[Path]) -> tuple[int, float]:
    """Bytes allocated beneath `roots` (st_blocks, no symlink followed, each inode once, the roots' own
    entries included), and the CPU seconds `du` took (0 for the walk: the caller counts its own thread's).
    coreutils' `du` walks in C, outside this interpreter's lock: 2.1x faster than the walk below on 100,000
    files (156 vs 331 ms), 1.4x on 2,000, and the run's drains and gate are not held up while it walks. The
    walk below where there is no `du` or it gave no total."""
    if _DU is not None:
        try:
            proc = subprocess.Popen([_DU, "-s", "-c", "-B1", "-0", "--", *map(str, roots)], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={"LC_ALL": "C"})
            killer = threading.Timer(DU_TIMEOUT_S, proc.kill)
            killer.start()
            try:
                with proc.stdout:  # type: ignore[union-attr]
                    out = proc.stdout.read()  # type: ignore[union-attr]
                # Reaped here, not by Popen: its rusage is what this walk cost, whatever else exits meanwhile.
                _, status, used = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
            finally:
                killer.cancel()
            # Records end with NUL (-0: a name with a newline is no line); the last is "<bytes>\ttotal". A
            # root that cannot be read makes du exit 1 with the total of the rest, as the walk counts it.
            total = out.rstrip(b"\0").rpartition(b"\0")[2]
            if total.endswith(b"\ttotal") and total[:-6].isdigit():
                # du counts each root's own entry, which the walk does not: their blocks are constant, and
                # only a difference of two walks is ever read.
                return int(total[:-6]), used.ru_utime + used.ru_stime
        except (OSError, subprocess.SubprocessError, ChildProcessError):
            pass
    return _walk_usage(roots), 0.0


def _walk_usage(roots: Sequence[Path]) -> int:
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


def interval(took_s: float, cpu_s: float, load: float | None = None) -> float:
    """The wait before the next walk: a big tree is walked at most ~10% of the time, and at most
    DISK_CPU_SHARE of the job's share of the machine (`cpu_s`: the whole look, `du` and this side's spawn
    and fd scan), that share waiting no longer than DISK_POLL_MAX_S (so the overshoot past the cap stays the
    write rate times that, where walks are quick). The share is a core while the machine has one for each
    runnable task, and the cores over the tasks past that (the 1-minute load average): 50 jobs at once on 2
    cores each polling 1% of a core spent half the machine on the watches, more as their jobs took longer
    (a waiting job 20 ms a second, 6.9 s of CPU a job at 50 against 1.5 alone, measured 2026-12-07)."""
    return max(DISK_POLL_S, 10 * took_s, min(DISK_POLL_MAX_S, cpu_s * crowd(load) / DISK_CPU_SHARE))


class DiskWatch:
    """Polls the bytes a run added to its writable roots; `hit` names the cap once they pass it."""

    def __init__(self, roots: Sequence[Path], cap: int, group: JobGroup | None) -> None:
        # Nested roots (a TMPDIR inside the cwd) are walked once.
        rs = sorted({Path(os.path.abspath(r)) for r in roots}, key=lambda p: len(p.parts))
        self.roots = tuple(r for i, r in enumerate(rs) if not any(o in r.parents for o in rs[:i]))
        self.cap = cap
        self.group = group
        t0, c0 = time.monotonic(), time.thread_time()
        self.baseline, du_cpu = _usage(self.roots)
        self._baseline_cpu = du_cpu + time.thread_time() - c0
        self._baseline_s = time.monotonic() - t0
        self.hit: str | None = None
        self.peak = 0
        self._stop = threading.Event()
        self._members: Callable[[], list[int]] | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self, members: Callable[[], list[int]]) -> None:
        """Start polling; `members` lists the run's live pids, read where there is no job group."""
        self._members = members
        self._thread.start()

    def _pids(self) -> list[int]:
        if self.group is not None:
            return self.group.pids()
        return self._members() if self._members is not None else []

    def check(self) -> str | None:
        return self._check()[0]

    def _check(self) -> tuple[str | None, float]:
        c0 = time.thread_time()
        usage, du_cpu = _usage(self.roots)
        added = usage + _unlinked_open(self._pids()) - self.baseline
        cpu = du_cpu + time.thread_time() - c0  # this side's spawn, wait and fd scan are the watch's too
        self.peak = max(self.peak, added)
        if added >= self.cap and self.hit is None:
            self.hit = (f"resource_limit: disk limit {human(self.cap)} reached: the job added {human(added)} "
                        f"({added} bytes) to {', '.join(map(str, self.roots))}")
        return self.hit, cpu

    def _loop(self) -> None:
        # The baseline was walked just before the launch: the first poll waits one interval, so a run shorter
        # than that is walked once more (by `final`), not twice at once.
        took, cpu = self._baseline_s, self._baseline_cpu
        while not self._stop.wait(interval(took, cpu)):
            t0 = time.monotonic()
            try:
                hit, cpu = self._check()
                if hit:
                    return
            except Exception:  # noqa: BLE001 - a failing walk must not end the watch silently
                pass
            took = time.monotonic() - t0

    def final(self) -> str | None:
        """One last look after the run exited (it may have written its last bytes just before)."""
        return self.hit or self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
