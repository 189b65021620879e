"""Benchmark (not a test): what the base's own run costs a job (issue 38), and validation against the repo's
own warm command.

1. A pytest project (M modules of T tests), a one-line honest patch by the `patch` agent, confined: the
   job's wall time on its first run (the base's run made and kept) and on a cached base (the kept run
   reused), and the base's share of each. Goal: the baseline <= 5% of the job on a cached base.
2. Go (a vendored module) and cargo (itoa): the job's validation step (its own per-job build cache, cold)
   against the repo's own command run warm in the main checkout. Goal: <= 1.5x + 0.5 s.
Median of R runs each; the machine's load is printed beside the figures.
Run: .venv/bin/python bench/baseline.py [--modules 20] [--tests 25] [--runs 5] [--no-go] [--no-cargo]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
GIT = ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid", "-c", "init.defaultBranch=master"]


def config(home: Path, extra: str = ""):
    from proctor.mechanisms.config.load import load_config

    p = home / "bench.toml"
    p.write_text(f'confine = "required"\n{extra}')
    return load_config(p)


def pytest_project(root: Path, modules: int, tests: int) -> Path:
    repo = root / "proj"
    (repo / "tests").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[project]\nname = "lib"\nversion = "0"\n')
    (repo / "lib.py").write_text("def f(x):\n    return x * 2\n")
    for m in range(modules):
        body = "".join(f"def test_{t}():\n    assert lib.f({t}) == {2 * t}\n\n" for t in range(tests))
        (repo / "tests" / f"test_m{m}.py").write_text("import lib\n\n" + body)
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run([*GIT, *argv], cwd=repo, check=True, capture_output=True)
    return repo


PATCH = "--- a/lib.py\n+++ b/lib.py\n@@ -1,2 +1,2 @@\n def f(x):\n-    return x * 2\n+    return x + x\n"


def one_job(repo: Path, cfg, ticket: str):
    from proctor import RunAgentRequest, run_agent

    t0 = time.perf_counter()
    res = run_agent(RunAgentRequest(agent="patch", task=PATCH, repo=str(repo), ticket=ticket), config=cfg)
    took = time.perf_counter() - t0
    assert res.status.value == "completed" and not res.needs_human_review, (res.known_risks, res.summary)
    return took, res


def bench_pytest(root: Path, modules: int, tests: int, runs: int) -> None:
    repo = pytest_project(root, modules, tests)
    first, cached, base_first, base_cached = [], [], [], []
    for i in range(runs):
        home = root / f"home-{i}"
        home.mkdir()
        os.environ["PROCTOR_HOME"] = str(home)
        cfg = config(home)
        took, res = one_job(repo, cfg, f"F{i}")
        assert res.baseline["source"] == "ran", res.baseline
        first.append(took)
        base_first.append(res.baseline["duration_s"])
        took, res = one_job(repo, cfg, f"C{i}")
        assert res.baseline["source"] == "cached", res.baseline
        cached.append(took)
        base_cached.append(res.baseline["duration_s"])
    f, c = statistics.median(first), statistics.median(cached)
    bf, bc = statistics.median(base_first), statistics.median(base_cached)
    print(f"pytest, {modules * tests} tests: first job {f:.2f} s (the base's run {bf:.2f} s, {bf / f:.1%} of it); "
          f"on a cached base {c:.2f} s (the baseline {bc * 1000:.0f} ms, {bc / c:.1%} of it)")


def validation_vs_warm(label: str, repo: Path, cfg, own: list[str], env: dict[str, str], runs: int) -> None:
    from proctor import RunAgentRequest, run_agent

    subprocess.run(own, cwd=repo, env=env, check=True, capture_output=True)  # warm the repo's own cache
    warm, ours = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        subprocess.run(own, cwd=repo, env=env, check=True, capture_output=True)
        warm.append(time.perf_counter() - t0)
        res = run_agent(RunAgentRequest(agent="sh", task="t", repo=str(repo), ticket=f"W{i}"), config=cfg)
        assert res.status.value == "completed", (res.known_risks, res.tests_attempted)
        ours.append(res.validation[-1]["duration_s"])
    w, o = statistics.median(warm), statistics.median(ours)
    print(f"{label}: validation {o:.2f} s (its build cache a copy of the base run's) vs the repo's own warm command {w:.2f} s: "
          f"{o / w:.2f}x, {o - w:+.2f} s (goal <= 1.5x + 0.5 s: {o <= 1.5 * w + 0.5})")


def sh_agent(script: str) -> str:
    import json

    return f'[agents.sh]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\nprompt = "stdin"\nnetwork = false\n'


def bench_go(root: Path, runs: int) -> None:
    import test_ecosystems as eco

    repo = root / "clock"
    for rel, text in eco.GO_MODULE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run([*GIT, *argv], cwd=repo, check=True, capture_output=True)
    home = root / "home-go"
    home.mkdir()
    os.environ["PROCTOR_HOME"] = str(home)
    cfg = config(home, sh_agent("echo '// touched' >> clock.go"))
    validation_vs_warm("go test -mod=vendor ./...", repo, cfg, ["go", "test", "-mod=vendor", "./..."],
                       {**os.environ, "GOFLAGS": "", "GOPROXY": "off"}, runs)


def bench_cargo(root: Path, runs: int) -> None:
    import ecosystems_fetch as fx

    repo = fx.make_repo("rust", root)
    env = {**os.environ, **fx.rust_env()}
    os.environ.update(fx.rust_env())
    home = root / "home-cargo"
    home.mkdir()
    os.environ["PROCTOR_HOME"] = str(home)
    cfg = config(home, sh_agent("echo '// touched' >> src/lib.rs"))
    validation_vs_warm("cargo test", repo, cfg, ["cargo", "test", "--offline"], env, runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", type=int, default=20)
    ap.add_argument("--tests", type=int, default=25)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-go", action="store_true")
    ap.add_argument("--no-cargo", action="store_true")
    args = ap.parse_args()
    # Autodetected validation runs `python -m pytest`: this interpreter's, which has pytest.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    print(f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    root = Path(tempfile.mkdtemp(prefix="proctor-bench-baseline-"))
    try:
        bench_pytest(root, args.modules, args.tests, args.runs)
        if not args.no_go and shutil.which("go"):
            bench_go(root, args.runs)
        if not args.no_cargo:
            bench_cargo(root, args.runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
