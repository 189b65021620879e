"""Benchmark (not a test): the cost of validating the tree that would land, against the job as it was.

A job whose agent edits one file, validated with `true` (so the repo's own test time does not hide the
host's cost), on repos of 2,000 and 100,000 files: the current code (agent repo of the job's own, tree
built from content, review checkout, validation in a fresh checkout) against a baseline revision of proctor
(default e06f946, the last commit before issue 9: linked worktree, `git status` against a private index,
validation in the agent's directory), each job timed inside its own process. Median of N runs each.

Target (issue 9): <= 1.5x the baseline on 2,000 files.
Run: .venv/bin/python bench/landing.py [--runs 7] [--big-runs 3] [--baseline REV] [--confine off|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
GIT = ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid"]

JOB = r"""
import json, sys, time
from pathlib import Path
from proctor import RunAgentRequest, run_agent
from proctor.config import load_config
config = load_config(Path(sys.argv[2]))
times = []
for i in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    res = run_agent(RunAgentRequest(agent="edit", task="x", repo=sys.argv[1], ticket=f"B{i}", validateCommand="true"),
                    config=config)
    times.append(time.perf_counter() - t0)
    assert res.status.value == "completed" and res.changed_files == ["pkg0/mod0.txt"], res
print(json.dumps(times))
"""


def make_repo(root: Path, n_files: int) -> Path:
    repo = root / f"repo-{n_files}"
    for i in range(n_files):
        p = repo / f"pkg{i % 200}" / f"mod{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"file {i}\n" * 5)
    subprocess.run([*GIT, "init", "-q", "-b", "master", str(repo)], check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "init"], cwd=repo, check=True)
    return repo


def jobs(src: Path, repo: Path, config: Path, runs: int, home: Path) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(src), "PROCTOR_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", JOB, str(repo), str(config), str(runs + 1)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)[1:]  # the first run warms imports and caches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--big-runs", type=int, default=3)
    ap.add_argument("--baseline", default="e06f946")
    ap.add_argument("--confine", default="off", choices=["off", "auto"])
    ap.add_argument("--sizes", default="2000,100000", help="repo sizes in files; the first gets --runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="proctor-bench-landing-") as tmp:
        root = Path(tmp)
        base_src = root / "baseline"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base_src), args.baseline], cwd=HERE,
                       check=True, capture_output=True)
        try:
            config = root / "config.toml"
            config.write_text(f'confine = "{args.confine}"\n[agents.edit]\ncommand = ["/bin/sh", "-c", '
                              '"printf changed >> pkg0/mod0.txt"]\nprompt = "stdin"\nnetwork = false\n')
            sizes = [int(x) for x in args.sizes.split(",")]
            for n, runs in zip(sizes, [args.runs] + [args.big_runs] * (len(sizes) - 1)):
                repo = make_repo(root, n)
                # interleaved rounds so drift hits both alike
                now, then = [], []
                for _ in range(2):
                    then += jobs(base_src / "src", repo, config, max(1, runs // 2), root / "home-base")
                    now += jobs(HERE / "src", repo, config, max(1, runs - runs // 2), root / "home-now")
                b, c = statistics.median(then), statistics.median(now)
                target = " (target <= 1.5x)" if n <= 2000 else ""
                print(f"{n} files, one edit, validate `true`, confine {args.confine}, median of {len(now)}: "
                      f"baseline {args.baseline} {b * 1000:.0f} ms, landing-tree job {c * 1000:.0f} ms, "
                      f"ratio {c / b:.2f}x{target}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_src)], cwd=HERE, capture_output=True)


if __name__ == "__main__":
    main()
