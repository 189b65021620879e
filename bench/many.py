"""Benchmark (not a test): N jobs at once against N floors at once (issue 44).

A 2,000-file Python repo with a failing test; each job is the `patch` agent fixing it, default confinement,
pytest validation (autodetected), as a separate `proctor run-agent` process (as N terminals, N MCP clients or
a listener's N children run them). The floor of one job: `git worktree add`, the same patch applied with
`git apply`, `python -m pytest` in it, `git status`. Both sides run N at once (a process each) after one
warm-up job (the base's run cached, as on a repo one works on). Prints the wall times and their ratio, one
job alone against one floor, every verdict checked, the CPU the machine spent busy during each side (run it idle), and
each proctor process's own peak memory (RSS and PSS, read from /proc while it runs).

Run: .venv/bin/python bench/many.py [--files 2000] [--n 1,20] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIT = ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid"]
PATCH = """--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
"""


def make_repo(root: Path, n_files: int) -> Path:
    repo = root / "repo"
    (repo / "tests").mkdir(parents=True)
    for i in range(n_files):
        p = repo / f"pkg{i % 40}" / f"mod{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"file {i}\n" * 5)
    (repo / "pyproject.toml").write_text('[project]\nname = "calc"\nversion = "0"\n')
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "tests" / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    # Files older than the index, as in a repo one works on: files written in the second git writes its index
    # are "racily clean" to it, and every `git status` of the main checkout (a job reads its risks) hashed all
    # 2,000 of them again (98 ms a job, measured 2026-12-07), a cost of this bench's fresh repo alone.
    old = time.time() - 60
    for p in repo.rglob("*"):
        os.utime(p, (old, old))
    subprocess.run([*GIT, "init", "-q", "-b", "master", str(repo)], check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "init"], cwd=repo, check=True)
    return repo


def floor(repo: Path, patch: Path, env: dict[str, str], i: int) -> float:
    wt = repo.parent / "floors" / f"{i}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    for tries in range(10):
        # git 2.39's `worktree add` reads the other worktrees' admin dirs, and one being made at that moment
        # fails it ("failed to read .git/worktrees/N/commondir"): 13 of 50 at once here. Tried again, as a
        # script of a person's would; proctor's cut makes no admin dir in the repo and has no such race.
        done = subprocess.run(["git", "worktree", "add", "-q", "--detach", str(wt), "master"], cwd=repo,
                              capture_output=True)
        if done.returncode == 0:
            break
        if b"commondir" not in done.stderr or tries == 9:
            raise RuntimeError(f"git worktree add: {done.stderr.decode(errors='replace')}")
        wt = wt.with_name(f"{wt.name}-{tries}")
    subprocess.run(["git", "apply", str(patch)], cwd=wt, check=True)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=wt, check=True,
                   capture_output=True, env=env)
    subprocess.run(["git", "status", "--porcelain", "-z"], cwd=wt, check=True, capture_output=True)
    return time.perf_counter() - t0


def _kb(text: str, field: str) -> int:
    return int(text.split(field, 1)[1].split()[0])


def job(repo: Path, patch: Path, env: dict[str, str], i: int) -> tuple[float, bool, int, int]:
    """(seconds, verdict right, the proctor process's own peak RSS and peak PSS in KiB, 0 where not read).
    The memory is the host process's alone, read from /proc while it runs (VmHWM is its high-water mark,
    read every 0.2 s; PSS, its share of the pages it shares with the other jobs' processes, is sampled every
    0.1 s for the first job of a batch only: reading smaps walks the page tables, and sampling 50 processes
    20 times a second was a third of the jobs' measured CPU). The rusage of children would count the
    largest descendant, which is the validation's pytest, not proctor."""
    proctor = str(Path(sys.executable).with_name("proctor"))
    t0 = time.perf_counter()
    p = subprocess.Popen([proctor, "run-agent", "--agent", "patch", "--task-file", str(patch), "--repo", str(repo),
                          "--ticket", f"M{i}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    hwm = pss = 0
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(p.stdout.read()))
    reader.start()
    while p.poll() is None:
        try:
            hwm = max(hwm, _kb(Path(f"/proc/{p.pid}/status").read_text(), "VmHWM:"))
            if i <= 0:
                pss = max(pss, _kb(Path(f"/proc/{p.pid}/smaps_rollup").read_text(), "\nPss:"))
        except (OSError, IndexError):
            pass  # not started or already gone
        time.sleep(0.1 if i <= 0 else 0.2)
    reader.join()
    took = time.perf_counter() - t0
    res = json.loads(box[0])
    return took, res["status"] == "completed" and res["needs_human_review"] is False, hwm, pss


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot: a job's processes are not all this one's
    waited-for children (its sandbox's run in a pid namespace of their own), so rusage would miss them; run
    the bench on an otherwise idle machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def at_once(n: int, fn, *args) -> tuple[float, float, list]:
    """(wall seconds, the machine's busy CPU seconds meanwhile, each one's return)."""
    before = _busy_s()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda i: fn(*args, i), range(n)))
    return time.perf_counter() - t0, _busy_s() - before, got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--n", default="1,20")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="proctor-bench-many-"))
    repo = make_repo(root, args.files)
    patch = root / "fix.diff"
    patch.write_text(PATCH)
    env = {**os.environ, "PROCTOR_HOME": str(root / "home"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job(repo, patch, env, -1)  # warm: the base's run cached
    for n in [int(x) for x in args.n.split(",")]:
        floors, jobs, oks, fcpu, jcpu, hwms, psss = [], [], [], [], [], [], []
        for _ in range(args.runs):
            took, cpu, _ = at_once(n, floor, repo, patch, env)
            floors.append(took)
            fcpu.append(cpu)
            took, cpu, got = at_once(n, job, repo, patch, env)
            jobs.append(took)
            jcpu.append(cpu)
            oks.append(sum(1 for _, ok, _, _ in got if ok))
            hwms += [h for _, _, h, _ in got]
            psss += [p for _, _, _, p in got if p]
        f, j = statistics.median(floors), statistics.median(jobs)
        fc, jc = statistics.median(fcpu) / n, statistics.median(jcpu) / n
        # On C cores, N at once cannot end sooner than N jobs' CPU over C: the CPU ratio is what bounds the wall
        # ratio once N outnumbers the cores.
        print(f"{n} at once: jobs {j:.2f} s, floors {f:.2f} s: {j / f:.2f}x (goal <= 1.0x at 20 and 50; one: "
              f"<= 1.3x + 0.3 s); verdicts right {min(oks)}/{n}; CPU a job {jc:.2f} s against a floor's "
              f"{fc:.2f} s ({jc / fc:.2f}x); the proctor process's own peak RSS median "
              f"{statistics.median(hwms) / 1024:.1f} MB (max {max(hwms) / 1024:.1f}), peak PSS "
              f"{statistics.median(psss) / 1024:.1f} MB (goal 40); load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
