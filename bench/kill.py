"""Measure (not a test): which whole-tree kill catches a double-forked `setsid` daemon holding the pipes.

For each method, spawn an agent whose grandchild calls setsid() and keeps stdout open, kill the tree, and
report whether the daemon died, whether stdout reached EOF, and how long the kill took (median of N).
Methods: killpg only; psutil descendant walk only (no subreaper); subreaper + walk + env marker (the
runner's fallback); cgroup v2 `cgroup.kill` (the runner's default where writable).
Run: .venv/bin/python bench/kill.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from proctor.mechanisms.process.local import LocalRunner
from proctor.mechanisms.process.spawn import Spawn

PAYLOAD = r"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(sys.argv[1], "w").write(str(os.getpid())); time.sleep(600); os._exit(0)
    os._exit(0)
os.wait()
while not os.path.exists(sys.argv[1]): time.sleep(0.005)
time.sleep(float(sys.argv[2]))
"""


def _pid(p: Path) -> int:
    while not (p.exists() and p.read_text()):
        time.sleep(0.005)
    return int(p.read_text())


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def naive(method: str, tmp: Path) -> tuple[bool, bool, float]:
    pidfile = tmp / f"{method}-{time.monotonic_ns()}.pid"
    p = subprocess.Popen([sys.executable, "-c", PAYLOAD, str(pidfile), "30"], stdout=subprocess.PIPE,
                         start_new_session=True)
    daemon = _pid(pidfile)
    t0 = time.perf_counter()
    if method == "killpg":
        os.killpg(p.pid, signal.SIGKILL)
    else:  # walk: the daemon re-parented to init when its parent exited, so the walk cannot see it
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
    p.wait()
    took = time.perf_counter() - t0
    os.set_blocking(p.stdout.fileno(), False)
    try:
        eof = p.stdout.read() == b""
    except (BlockingIOError, TypeError):
        eof = False
    died = _dead(daemon)
    if not died:
        os.kill(daemon, signal.SIGKILL)
    p.stdout.close()
    return died, eof, took


def runner(use_cgroup: bool, tmp: Path) -> tuple[bool, bool, float]:
    pidfile = tmp / f"r-{time.monotonic_ns()}.pid"
    t0 = time.perf_counter()
    LocalRunner(use_cgroup=use_cgroup).run(Spawn(argv=[sys.executable, "-c", PAYLOAD, str(pidfile), "0.3"],
                                                 cwd=tmp, env=dict(os.environ), deadline_s=0.2, term_grace_s=0))
    took = time.perf_counter() - t0 - 0.2
    # The runner returns once both drains saw EOF, or gives up on them after 0.5 s: a quick return is EOF.
    return _dead(_pid(pidfile)), took < 0.45, took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    n = ap.parse_args().runs
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, fn in [("killpg only", lambda: naive("killpg", tmp)), ("psutil walk only", lambda: naive("walk", tmp)),
                         ("subreaper + walk + marker", lambda: runner(False, tmp)), ("cgroup v2 cgroup.kill", lambda: runner(True, tmp))]:
            rows = [fn() for _ in range(n)]
            died = sum(r[0] for r in rows)
            eof = sum(r[1] for r in rows)
            print(f"{name:28s} daemon killed {died}/{n}, stdout EOF {eof}/{n}, "
                  f"median kill {statistics.median(r[2] for r in rows) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
