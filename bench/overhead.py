"""Benchmark (not a test): what proctor adds on top of the irreducible cost of an agent job.

1. A no-op agent job on a repo of ~2,000 files through `run_agent`, against the raw floor: `git worktree add`
   + spawning the same no-op + `git status --porcelain -z`. Median of N runs each; prints the ratio.
2. Draining a 2 GB agent log through the runner's bounded tail, against `cat > /dev/null` on the same pipe,
   and the host's peak RSS growth (each measured in a fresh child, so ru_maxrss is this drain's alone).

Targets (issue 2): overhead <= 1.3x the floor; drain >= 0.5x pipe speed with <= 8 MB RSS growth.
`--phases` also prints where a job's time goes (median per phase over the runs: the worktree and its
checkout, the environment, the agent's spawn, landing, validation, the review checkout, the rest).
Run: .venv/bin/python bench/overhead.py [--runs 10] [--gib 2] [--phases]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from repos import make_repo  # bench/, the script's own dir, is first on sys.path


def floor_once(repo: Path, i: int) -> float:
    wt = repo.parent / "floor-wt" / str(i)
    t0 = time.perf_counter()
    subprocess.run(["git", "worktree", "add", "-q", "-b", f"floor/{i}", str(wt), "master"], cwd=repo, check=True,
                   capture_output=True)
    subprocess.run(["/bin/true"], cwd=wt, stdin=subprocess.DEVNULL, check=True)
    subprocess.run(["git", "status", "--porcelain", "-z"], cwd=wt, check=True, capture_output=True)
    return time.perf_counter() - t0


def proctor_once(repo: Path, config) -> float:
    from proctor import RunAgentRequest, run_agent

    t0 = time.perf_counter()
    res = run_agent(RunAgentRequest(agent="noop", task="nothing", repo=str(repo), ticket="B"), config=config)
    took = time.perf_counter() - t0
    assert res.exit_codes == [0], res
    return took


PHASES = (  # (name, the functions whose time is the phase's), in the job's order (services/job/run_agent.py)
    ("worktree (cut)", ("worktree.create",)),
    ("  of which git's checkout", ("worktree.checkout",)),
    ("  beside it: the main checkout's risks", ("worktree.checkout_risks",)),
    ("environment (gate, confinement, probe, repo settings, setup)",
     ("gate.start", "prepare.confine_agent", "prepare._probe_version", "prepare._repo_settings", "prepare._setup")),
    ("agent spawn (run_attempts)", ("agent.run_attempts",)),
    ("landing (scan, hash, commit, checkout)", ("land.land",)),
    ("  of which the scan", ("scan.scan",)),
    ("diff risks", ("land.diff_risks",)),
    ("validation", ("validate.validate",)),
    ("review checkout", ("land.review_checkout",)),
)


def time_phases() -> list[dict[str, float]]:
    """Wrap the functions PHASES names; each job's times go in a dict of the returned list (appended by
    `proctor_once` callers: one dict per job)."""
    import functools

    from proctor.mechanisms.git import landing, scan, worktree
    from proctor.services.job import agent, gate, land, prepare, validate

    runs: list[dict[str, float]] = []
    mods = {"worktree": worktree, "landing": landing, "scan": scan, "gate": gate, "prepare": prepare, "agent": agent,
            "land": land, "validate": validate}
    for _, names in PHASES:
        for name in names:
            mod, attr = name.split(".")
            inner = getattr(mods[mod], attr)

            def timed(*a, _inner=inner, _name=name, **k):
                t0 = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    if runs:
                        runs[-1][_name] = runs[-1].get(_name, 0.0) + time.perf_counter() - t0

            setattr(mods[mod], attr, functools.wraps(inner)(timed))
    return runs


def print_phases(runs: list[dict[str, float]], totals: list[float]) -> None:
    total = statistics.median(totals)
    print(f"  where a job's time goes (median of {len(runs)}; total {total * 1000:.1f} ms):")
    top = 0.0
    for name, keys in PHASES:
        v = statistics.median(sum(r.get(k, 0.0) for k in keys) for r in runs)
        top += 0.0 if name.startswith("  ") else v
        print(f"  {v * 1000:9.1f} ms  {name}")
    print(f"  {(total - top) * 1000:9.1f} ms  admission, ledger and record, the rest")


DRAIN_CHILD = r"""
import resource, sys, time, json
from pathlib import Path
from proctor.mechanisms.process.local import LocalRunner
from proctor.mechanisms.process.spawn import Spawn
n = int(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
ex = LocalRunner().run(Spawn(argv=["head", "-c", str(n), "/dev/zero"], cwd=Path("/"), env={"PATH": "/usr/bin:/bin"}, deadline_s=600))
took = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": took, "rss_growth_kib": after - before, "kept": len(ex.stdout), "dropped": ex.stdout_dropped}))
"""


def drain(n_bytes: int) -> dict:
    t0 = time.perf_counter()
    subprocess.run(f"head -c {n_bytes} /dev/zero | cat > /dev/null", shell=True, check=True)
    raw = time.perf_counter() - t0
    out = subprocess.run([sys.executable, "-c", DRAIN_CHILD, str(n_bytes)], check=True, capture_output=True, text=True)
    res = json.loads(out.stdout)
    res["raw_s"] = raw
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--confine", default="off", choices=["off", "auto"],
                    help="off: the issue-2 floor compares plain spawns; auto adds bwrap+landlock (see confine.py)")
    ap.add_argument("--phases", action="store_true", help="also print where a job's time goes")
    args = ap.parse_args()
    from proctor.mechanisms.config.load import load_config

    with tempfile.TemporaryDirectory(prefix="proctor-bench-") as tmp:
        root = Path(tmp)
        os.environ["PROCTOR_HOME"] = str(root / "home")
        cfg_file = root / "config.toml"
        cfg_file.write_text(f'confine = "{args.confine}"\n[agents.noop]\ncommand = ["/bin/true"]\nprompt = "stdin"\n')
        config = load_config(cfg_file)
        repo = make_repo(root, args.files)
        proctor_once(repo, config)  # warm imports and caches once, outside the measurement
        floor_once(repo, 10_000)
        phases = time_phases() if args.phases else None
        floors, jobs = [], []
        for i in range(args.runs):  # interleaved, so drift hits both alike
            floors.append(floor_once(repo, i))
            if phases is not None:
                phases.append({})
            jobs.append(proctor_once(repo, config))
        f, j = statistics.median(floors), statistics.median(jobs)
        print(f"no-op job (confine {args.confine}), {args.files} files, median of {args.runs}: floor {f * 1000:.1f} ms, "
              f"proctor {j * 1000:.1f} ms, ratio {j / f:.2f}x (target <= 1.3x)")
        if phases is not None:
            print_phases(phases, jobs)
    n = int(args.gib * (1 << 30))
    d = drain(n)
    print(f"drain of {args.gib:g} GiB: cat {d['raw_s']:.2f} s, proctor {d['s']:.2f} s, speed "
          f"{d['raw_s'] / d['s']:.2f}x of pipe (target >= 0.5x); peak RSS growth {d['rss_growth_kib'] / 1024:.1f} MiB "
          f"(target <= 8); kept {d['kept']} bytes, dropped {d['dropped']}")


if __name__ == "__main__":
    main()
