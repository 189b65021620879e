"""Start cost of `true` plain, under the Landlock helper, under bwrap, and under both (DESIGN.md 6).

Spawns the way the process runner does (subprocess, shell=False) with the argv a real job would get: a
throwaway repo with a linked worktree, its roots from job_roots(). Median of N interleaved runs each (default 100);
targets over plain: Landlock <= +2 ms, bwrap <= +10 ms, both <= +12 ms. Exit 1 when a target is missed.

    .venv/bin/python bench/confine.py [N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proctor.mechanisms.confine import LayeredConfiner, Unavailable, detect, job_roots

TARGETS_MS = {"landlock": 2.0, "bwrap": 10.0, "bwrap+landlock": 12.0}
LAYERS = {"landlock": (False, True), "bwrap": (True, False), "bwrap+landlock": (True, True)}


def _repo(base: Path) -> tuple[Path, Path]:
    main, wt = base / "main", base / "wt"
    git = ["git", "-c", "user.email=b@example.invalid", "-c", "user.name=bench"]
    subprocess.run([*git, "init", "-q", "-b", "master", str(main)], check=True)
    subprocess.run([*git, "-C", str(main), "commit", "-q", "--allow-empty", "-m", "c1"], check=True)
    subprocess.run([*git, "-C", str(main), "worktree", "add", "-q", "-b", "wt/bench/T", str(wt)], check=True)
    return main, wt


def _medians_ms(argvs: dict[str, list[str]], cwd: Path, n: int) -> dict[str, float]:
    # Round-robin, not one variant after another: a load spike from a neighbour then costs every variant.
    times: dict[str, list[float]] = {name: [] for name in argvs}
    for _ in range(n):
        for name, argv in argvs.items():
            t = time.perf_counter()
            subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, check=True)
            times[name].append((time.perf_counter() - t) * 1000)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(n: int) -> int:
    t = time.perf_counter()
    caps = detect()
    detect_ms = (time.perf_counter() - t) * 1000
    print(f"detect(): {detect_ms:.0f} ms; bwrap {caps.bwrap_version or '-'} ({caps.bwrap_reason}); "
          f"Landlock ABI {caps.landlock_abi} ({caps.landlock_reason}); helper: {caps.helper_reason}")
    with tempfile.TemporaryDirectory() as tmp:
        main_repo, wt = _repo(Path(tmp))
        # As a job's: the worktree and its tmpdir writable, the main repo read-only; the real $PROCTOR_HOME hidden.
        req = job_roots(wt, Path(tmp) / "jobtmp", readonly=(main_repo, main_repo / ".git"))
        assert not isinstance(req, Unavailable), req
        argvs = {"plain": ["true"]}
        for name, (use_bwrap, use_landlock) in LAYERS.items():
            if (use_bwrap and caps.bwrap is None) or (use_landlock and not caps.landlock):
                print(f"{name:<16}  n/a (not available here)")
                continue
            plan = LayeredConfiner(caps, use_bwrap, use_landlock).wrap(["true"], req)
            assert not isinstance(plan, Unavailable), plan
            argvs[name] = plan.argv
        ms = _medians_ms(argvs, wt, n)
    plain = ms.pop("plain")
    print(f"{'plain':<16}{plain:7.2f} ms")
    missed = 0
    for name, value in ms.items():
        ok = value - plain <= TARGETS_MS[name]
        missed += not ok
        print(f"{name:<16}{value:7.2f} ms  {value - plain:+6.2f} ms  (target <= +{TARGETS_MS[name]:.0f}) "
              f"{'ok' if ok else 'MISSED'}")
    print(f"median of {n} interleaved runs each")
    return 1 if missed else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=100, help="interleaved runs of each variant (default 100)")
    sys.exit(main(ap.parse_args().n))
