"""Benchmark (not a test): a whole job on a real project of each ecosystem, against the repo's own test
command run directly in a plain clone.

The projects are tests/ecosystems_fetch.py's (cachetools: src layout, editable in the active venv; six: flat
layout, the repo's own .venv; cachetools as a uv project: hatchling, uv.lock, `uv sync`'s .venv, found from
uv.lock with zero config; xtend: npm devDependencies; itoa: a crate), fetched once into the fixture cache.
The job is `run_agent` end to end: an `sh` agent that fixes a one-line bug, confined (bwrap+landlock), the
tree built, validation autodetected and run in the job's environment (private HOME and caches, the import
probe, shares), the review checkout made. The direct run is the same test command in a fresh `git clone`
with the developer's dependencies (the venv's python, `npm install` done, a cold cargo target dir as the
job's is), the clone and install not timed. Each side: the median of --runs, every run on a fresh tree.

Target (issue 12): job <= 1.5 x direct + 0.5 s, per ecosystem.
Run: .venv/bin/python bench/ecosystems.py [--runs 5] [--only python-src,node] [--confine required]
(python-uv needs uv: the `test` extra installs it.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import ecosystems_fetch as fx  # noqa: E402


BENCHED = ("python-src", "python-flat", "python-uv", "node", "rust")


def setup(key: str, root: Path) -> tuple[Path, dict[str, str], Path | None]:
    """(repo, the developer's environment additions, the python the developer runs tests with)."""
    repo = fx.make_repo(key, root)
    env: dict[str, str] = {}
    python = None
    if key == "python-src":
        venv = root / "venv"
        python = fx.make_venv(venv, repo)
        env = {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    elif key == "python-flat":
        python = fx.make_venv(repo / ".venv", repo)
    elif key == "python-uv":
        python = fx.uv_synced(repo) / "bin" / "python"  # the developer runs `uv run pytest`: this venv's python
    elif key == "node":
        fx.node_modules_installed(repo)
    elif key == "rust":
        env = {"PATH": fx.rust_env()["PATH"]}
    return repo, env, python


def direct_once(key: str, repo: Path, root: Path, env: dict[str, str], python: Path | None, i: int) -> float:
    clone = root / f"direct-{i}"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    if key == "node":
        fx.node_modules_installed(clone, {**os.environ, **env})
    argv = list(fx.PROJECTS[key].direct)
    if argv[0] == "python":
        argv[0] = str(python)
    run_env = {**os.environ, **env}
    if key == "rust":
        run_env["CARGO_TARGET_DIR"] = str(root / f"direct-target-{i}")  # cold, as the job's own
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=clone, env=run_env, capture_output=True)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{key}: the direct run failed ({res.returncode}): {res.stdout[-800:]!r}")
    shutil.rmtree(clone, ignore_errors=True)
    return took


def job_once(key: str, repo: Path, config) -> tuple[float, object]:
    from proctor import RunAgentRequest, run_agent

    t0 = time.perf_counter()
    res = run_agent(RunAgentRequest(agent="sh", task="fix the bug", repo=str(repo), ticket="B", branch="broken"),
                    config=config)
    took = time.perf_counter() - t0
    if res.status.value != "completed" or res.needs_human_review:
        raise SystemExit(f"{key}: the job did not complete cleanly: {res.status.value} {res.known_risks} "
                         f"(agent: {res.summary!r})")
    shutil.rmtree(res.worktree_path, ignore_errors=True)
    return took, res


def bench(key: str, runs: int, confine: str) -> dict:
    from proctor.mechanisms.config.load import load_config

    root = Path(tempfile.mkdtemp(prefix=f"proctor-bench-{key}-"))
    saved = dict(os.environ)
    try:
        repo, env, python = setup(key, root)
        os.environ.update(env)
        if key in ("python-flat", "python-uv"):
            os.environ.pop("VIRTUAL_ENV", None)
        cfg = root / "agent.toml"
        cfg.write_text(f'confine = "{confine}"\n[agents.sh]\ncommand = ["/bin/sh", "-c", '
                       f'{json.dumps(fx.PROJECTS[key].edit.fix)}]\nprompt = "stdin"\nnetwork = false\n')
        config = load_config(cfg)
        job_once(key, repo, config)  # warm-up: confinement detection, the Landlock helper, the ledger
        direct = [direct_once(key, repo, root, env, python, i) for i in range(runs)]
        jobs, last = [], None
        for _ in range(runs):
            took, last = job_once(key, repo, config)
            jobs.append(took)
        d, j = statistics.median(direct), statistics.median(jobs)
        target = 1.5 * d + 0.5
        return {"ecosystem": key, "project": fx.PROJECTS[key].name, "direct_s": round(d, 3), "job_s": round(j, 3),
                "ratio": round(j / d, 2), "target_s": round(target, 3), "ok": j <= target,
                "confinement": last.confinement, "validation": last.tests_attempted}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", default=",".join(BENCHED))
    ap.add_argument("--confine", default="required", choices=["required", "auto", "off"])
    args = ap.parse_args()
    # One PROCTOR_HOME for the whole run: confinement is detected once per process and its Landlock helper
    # is cached there.
    home = Path(tempfile.mkdtemp(prefix="proctor-bench-home-"))
    os.environ["PROCTOR_HOME"] = str(home)
    rows = []
    for key in [k for k in args.only.split(",") if k]:
        try:
            rows.append(bench(key, args.runs, args.confine))
        except fx.FetchError as exc:
            print(f"{key}: skipped, fixture not available: {exc}", file=sys.stderr)
            continue
        r = rows[-1]
        print(f"{r['ecosystem']:<12} {r['project']:<18} direct {r['direct_s']:6.3f}s  job {r['job_s']:6.3f}s  "
              f"ratio {r['ratio']:4.2f}x  target <= {r['target_s']:.3f}s  {'OK' if r['ok'] else 'OVER'}  "
              f"({r['confinement']}; {r['validation'][0]})", flush=True)
    shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(rows, indent=1))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
