"""Measure (not a test): a job killed at its memory, pids and disk limits, and the host meanwhile.

For each limit, one job runs past it under `LocalRunner` with small limits; the job itself records (in a
file, flushed, with CLOCK_MONOTONIC) the moment it crossed the limit, so the kill latency is job end minus
that moment. Meanwhile the host runs a loop timing itself (10 ms sleeps: the worst extra delay) and a
CPU-bound loop (iterations per second against an idle baseline): that is the host's responsiveness. A
control job (a legitimate one under the same limits) runs first.
Run: .venv/bin/python bench/limits.py [--runs 3] [--memory-mib 256] [--disk-mib 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from proctor.mechanisms.confine.limits import Limits
from proctor.mechanisms.process.local import LocalRunner
from proctor.mechanisms.process.spawn import Spawn

PY = sys.executable

MEMORY = """
import os, sys, time
mark, cap = sys.argv[1], int(sys.argv[2])
keep, n = [], 0
while True:
    keep.append(bytearray(4 << 20)); n += 4 << 20
    if n > cap * 3 // 4:  # the kernel kills at the limit: the last moment recorded is the crossing
        with open(mark + ".tmp", "w") as fh:
            fh.write(str(time.monotonic()))
        os.replace(mark + ".tmp", mark)
"""

PIDS = """
import os, sys, time
mark = sys.argv[1]
while True:
    try:
        if os.fork() == 0:
            time.sleep(60); os._exit(0)
    except OSError:
        if not os.path.exists(mark):
            open(mark, "w").write(str(time.monotonic()))
        time.sleep(0.001)
"""

DISK = """
import os, sys, time
mark, cap = sys.argv[1], int(sys.argv[2])
n = 0
i = 0
while True:   # many files of 1 MiB: the watcher's case (one big file stops at RLIMIT_FSIZE at once)
    with open(os.path.join(os.environ["TMPDIR"], f"f{i}.bin"), "wb") as fh:
        fh.write(b"x" * (1 << 20)); fh.flush(); os.fsync(fh.fileno())
    n += 1 << 20; i += 1
    if n >= cap and not os.path.exists(mark):
        open(mark, "w").write(str(time.monotonic()))
"""

CONTROL = "import time; b = bytearray(16 << 20); [i * i for i in range(200000)]; time.sleep(0.2); print('ok')"


class Host:
    """The host's own loops while a job runs."""

    def __init__(self) -> None:
        self.worst_gap = 0.0
        self.spins = 0
        self._stop = threading.Event()

    def _sleeper(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            self.worst_gap = max(self.worst_gap, now - last - 0.01)
            last = now

    def _spinner(self) -> None:
        while not self._stop.is_set():
            sum(range(1000))
            self.spins += 1

    def __enter__(self) -> Host:
        self.t0 = time.monotonic()
        self._ts = [threading.Thread(target=self._sleeper, daemon=True), threading.Thread(target=self._spinner, daemon=True)]
        for t in self._ts:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._ts:
            t.join()
        self.rate = self.spins / (time.monotonic() - self.t0)


def one(code: str, args: list[str], limits: Limits, tmp: Path) -> dict:
    mark = tmp / "mark"
    mark.unlink(missing_ok=True)
    (tmp / "t").mkdir(exist_ok=True)
    for f in (tmp / "t").iterdir():
        f.unlink()
    with Host() as host:
        ex = LocalRunner().run(Spawn(argv=[PY, "-c", code, str(mark), *args], cwd=tmp, deadline_s=60,
                                     env={**os.environ, "TMPDIR": str(tmp / "t")}, limits=limits, name="bench",
                                     term_grace_s=0.2))
        end = time.monotonic()
    crossed = float(mark.read_text()) if mark.exists() else None
    return {"reason": ex.killed_reason or f"exit {ex.exit_code}", "latency": (end - crossed) if crossed else None,
            "duration": ex.duration_s, "gap": host.worst_gap, "rate": host.rate}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory-mib", type=int, default=256)
    ap.add_argument("--disk-mib", type=int, default=64)
    a = ap.parse_args()
    limits = Limits(memory=a.memory_mib << 20, swap=0, pids=128, cpu_weight=100, disk=a.disk_mib << 20)
    print(f"limits: memory {a.memory_mib} MiB, pids 128, disk {a.disk_mib} MiB; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with Host() as idle:
            time.sleep(1)
        print(f"idle host: worst 10ms-sleep overshoot {idle.worst_gap * 1000:.1f} ms, spin {idle.rate:,.0f}/s")
        cases = [("control", CONTROL, []), ("memory", MEMORY, [str(a.memory_mib << 20)]), ("pids", PIDS, []),
                 ("disk", DISK, [str(a.disk_mib << 20)])]
        for name, code, args in cases:
            rs = [one(code, args, limits, tmp) for _ in range(a.runs)]
            lat = [r["latency"] for r in rs if r["latency"] is not None]
            print(f"{name:8s} {rs[0]['reason'][:140]}")
            print(f"         kill latency median {statistics.median(lat) * 1000:.0f} ms (max {max(lat) * 1000:.0f})"
                  if lat else "         (no limit crossed)",
                  f"| job {statistics.median(r['duration'] for r in rs):.2f} s"
                  f"| host worst sleep overshoot {max(r['gap'] for r in rs) * 1000:.1f} ms"
                  f"| host spin {min(r['rate'] for r in rs) / idle.rate:.0%} of idle")


if __name__ == "__main__":
    main()
