"""Benchmark (not a test): a race against its slowest job alone, and many jobs at once.

1. A 3-agent race (issue 42: goal <= 1.2x) on a small Python repo with a held-out test: three scripted agents
   that wait like a model (`--think` seconds) and then write a right, a wrong and a hard-coded answer. The
   race's wall time against the slowest of its three jobs run alone, median of `--runs` each; the ranking is
   checked every run (right first, the cheat last).
2. `--many N` jobs at once (threads of one host process, as the MCP server and a race run them): wall time,
   every verdict checked, and the host's memory per job (its RSS growth over the batch, divided by N; the
   agents' own processes are not the host's).

Run: .venv/bin/python bench/race.py [--runs 3] [--think 2] [--many 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIT = ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid"]
FILES = {
    "pyproject.toml": '[project]\nname = "calc"\nversion = "0"\n',
    "calc.py": "def add(a, b):\n    raise NotImplementedError\n",
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
BODIES = {"right": "a + b", "wrong": "a - b", "cheat": "5"}


def setup(root: Path, think: float) -> tuple[Path, Path]:
    repo = root / "repo"
    for rel, text in FILES.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    subprocess.run([*GIT, "init", "-q", "-b", "master", str(repo)], check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "init"], cwd=repo, check=True)
    hidden = root / "holdout" / "tests"
    hidden.mkdir(parents=True)
    (hidden / "test_more.py").write_text("from calc import add\n\n\ndef test_more():\n    assert add(10, 20) == 30\n")
    agents = "".join(
        f'[agents.{name}]\ncommand = ["/bin/sh", "-c", "cat >/dev/null; sleep {think}; '
        f"printf 'def add(a, b):\\\\n    return {body}\\\\n' > calc.py\"]\nprompt = \"stdin\"\nnetwork = false\n"
        for name, body in BODIES.items())
    cfg = root / "config.toml"
    cfg.write_text(f'[holdout]\n"{repo}" = ["{hidden.parent}"]\n{agents}')
    return repo, cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--think", type=float, default=2.0, help="seconds each scripted agent waits, as on a model")
    ap.add_argument("--many", type=int, default=0, help="also run this many jobs at once")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="proctor-bench-race-"))
    os.environ["PROCTOR_HOME"] = str(root / "home")
    from proctor import RunAgentRequest, run_agent
    from proctor.mechanisms.config.load import load_config
    from proctor.services.race.race import race

    repo, cfg = setup(root, args.think)
    config = load_config(cfg)

    def req(agent: str) -> RunAgentRequest:
        return RunAgentRequest(agent=agent, task="make add add", repo=str(repo), ticket="BENCH")

    alone, raced = [], []
    for _ in range(args.runs):
        times = []
        for agent in BODIES:
            t0 = time.perf_counter()
            run_agent(req(agent), config=config)
            times.append(time.perf_counter() - t0)
        alone.append(max(times))
        t0 = time.perf_counter()
        out = race([req(a) for a in BODIES], config=config)
        raced.append(time.perf_counter() - t0)
        order = [r["agent"] for r in out.ranking]
        assert order == ["right", "wrong", "cheat"], order
    a, r = statistics.median(alone), statistics.median(raced)
    load = os.getloadavg()[0]
    print(f"3-agent race: {r:.2f} s, slowest job alone {a:.2f} s: {r / a:.2f}x (goal <= 1.2x); "
          f"agents think {args.think:.1f} s; median of {args.runs}; load {load:.2f}")
    if args.many:
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.many) as pool:
            results = list(pool.map(lambda i: run_agent(req("right" if i % 2 else "wrong"), config=config),
                                    range(args.many)))
        took = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        right = sum(1 for i, res in enumerate(results)
                    if (res.status.value == "completed") == bool(i % 2))  # right completes, wrong fails
        print(f"{args.many} jobs at once: {took:.2f} s wall, verdicts right {right}/{args.many}, host peak RSS "
              f"{rss1 / 1024:.0f} MB (+{(rss1 - rss0) / 1024 / args.many:.1f} MB a job over the batch); "
              f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
