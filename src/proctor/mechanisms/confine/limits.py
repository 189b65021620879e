"""A job's resource ceilings as one value, and the sizes they are said in.

Owns `Limits` (memory + swap, pids, CPU weight, disk, and all jobs' memory together) with its defaults for this
machine, and `human` for a size in a message. It never enforces anything: the kernel does, through the job's
groups (proctor.mechanisms.confine.cgroup), and the disk watch (proctor.mechanisms.confine.disk).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * GIB


@dataclass(frozen=True)
class Limits:
    """Per-job ceilings; None = not limited. `memory_total` caps all jobs of this host together."""

    memory: int | None = None  # bytes: memory.max / memory.limit_in_bytes
    swap: int | None = 0  # bytes of swap on top of `memory` (memory.swap.max / memsw); 0 = none
    pids: int | None = None  # tasks (threads count): pids.max
    cpu_weight: int | None = None  # cgroup v2 semantics, 1..10000, 100 = default share; v1: shares = w*1024/100
    disk: int | None = None  # bytes the job may add to its writable roots (worktree, TMPDIR): watched
    memory_total: int | None = None

    @classmethod
    def default(cls) -> Limits:
        """Defaults that keep the host alive (24 GiB / 2 cores here): a job gets a third of RAM, all jobs
        together three quarters, 1024 tasks, the default CPU share, 10 GiB of disk."""
        ram = total_ram()
        return cls(memory=ram // 3, swap=0, pids=1024, cpu_weight=100, disk=10 * GIB, memory_total=ram * 3 // 4)


def crowd(load: float | None = None) -> float:
    """How many runnable tasks share each core (the 1-minute load average over the cores), at least 1: what a
    job's periodic looks (its disk walks, its run's checks) stretch their waits by, so that N jobs on C cores
    spend on looking a share of the machine that does not grow with N (issue 44: at 50 jobs on 2 cores a
    waiting job's looks cost 20 ms a second each, a quarter of the machine)."""
    return max(1.0, (os.getloadavg()[0] if load is None else load) / (os.cpu_count() or 1))


def human(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"
