"""Who holds a job: a process named by pid, its start time and the boot id, so a pid reused by another
process, or every pid after a reboot, never passes for the owner. It reads the process table; it never
signals a process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        # No Linux boot id (macOS, Windows): the boot time stands in; it changes on every reboot too.
        return f"boot-{int(psutil.boot_time())}"


def process_start(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        # A zombie has exited: it only waits for its parent to reap it (a subreaper that never does, say),
        # and an owner that is a zombie must not hold a job forever.
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


@dataclass(frozen=True)
class Owner:
    pid: int
    start: float
    boot: str

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start(pid) or 0.0, boot_id())

    def alive(self) -> bool:
        # pid + start time, because a pid is reused; boot id, because after a reboot every pid is someone else.
        if self.boot != boot_id():
            return False
        started = process_start(self.pid)
        return started is not None and abs(started - self.start) < 0.5
