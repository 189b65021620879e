"""Benchmark (not a test): the disk a job that ended keeps, against one `git worktree add` of the same base
(issue 44: goal <= 1.1x). Both measured with `du` (allocated blocks): the job's dir under `{repo}-agents/`
(its review checkout and its git dir: index, refs, the objects it wrote), and the worktree's checkout plus
its admin dir in the main repo's `.git/worktrees/` (its index lives there). `proctor gc --dry-run` is asked
what it would free, which must be the job's own.

Run: .venv/bin/python bench/disk.py [--files 2000,100000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many import PATCH, make_repo  # noqa: E402


def du(*paths: Path) -> int:
    out = subprocess.run(["du", "-s", "-c", "-B1", *map(str, paths)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1].split()[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", default="2000,100000")
    args = ap.parse_args()
    for n in [int(x) for x in args.files.split(",")]:
        root = Path(tempfile.mkdtemp(prefix="proctor-bench-disk-"))
        repo = make_repo(root, n)
        patch = root / "fix.diff"
        patch.write_text(PATCH)
        env = {**os.environ, "PROCTOR_HOME": str(root / "home"),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        proctor = str(Path(sys.executable).with_name("proctor"))
        res = json.loads(subprocess.run([proctor, "run-agent", "--agent", "patch", "--task-file", str(patch), "--repo",
                                         str(repo), "--ticket", "D", "--validate-cmd", "true"], capture_output=True,
                                        text=True, env=env).stdout)
        job = Path(res["worktreePath"])
        wt = root / "floor"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(wt), "master"], cwd=repo, check=True)
        admin = repo / ".git" / "worktrees" / wt.name
        kept, floor = du(job), du(wt, admin)
        gc = json.loads(subprocess.run([proctor, "gc", "--older-than", "0", "--dry-run", "--json"], capture_output=True,
                                       text=True, env=env).stdout or "{}")
        print(f"{n} files: a job that ended keeps {kept / 2**20:.1f} MiB, one worktree {floor / 2**20:.1f} MiB: "
              f"{kept / floor:.2f}x (goal <= 1.1x); gc --dry-run would free "
              f"{gc.get('would_free_bytes', 0) / 2**20:.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
