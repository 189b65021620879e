"""Benchmark: a command request's before+after snapshot of a 100,000-file tree vs `git status`.

Builds a repo of tracked, untracked and git-ignored files (ignored ones are what `git status` alone would
not account for), then times, median of --repeat runs each:
  snapshot   take() before + take(reference=) after + diff()  -- what run_request does around a command
  git        `git status --porcelain --ignored` once, and twice (a git-based before and after)
and prints the ratios. Target: snapshot pair <= 2x a single git status.

    .venv/bin/python bench/snapshot.py [--files 100000] [--repeat 5] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proctor.services.commands import snapshot

GIT = ["git", "-c", "core.fsmonitor=false", "-c", "core.untrackedCache=false"]


def build(root: Path, files: int) -> dict[str, int]:
    """80% tracked (committed), 10% untracked, 10% ignored; 100 files per folder, two levels deep."""
    counts = {"tracked": int(files * 0.8), "untracked": int(files * 0.1)}
    counts["ignored"] = files - counts["tracked"] - counts["untracked"]
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}
    subprocess.run([*GIT, "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("build/\n*.log\n")
    n = 0
    for kind, count in counts.items():
        for i in range(count):
            if kind == "ignored":
                rel = f"build/d{i // 1000}/s{(i // 100) % 10}/f{i}.o" if i % 2 else f"logs/d{i // 1000}/f{i}.log"
            else:
                rel = f"{kind}/d{i // 1000}/s{(i // 100) % 10}/f{i}.txt"
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x" * (n % 200))
            n += 1
        if kind == "tracked":
            subprocess.run([*GIT, "add", "-A", "."], cwd=root, check=True, env=env)
            subprocess.run([*GIT, "commit", "-qm", "bench"], cwd=root, check=True, env=env)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--root", type=Path, help="an existing bench tree to reuse (built there when empty)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="proctor-bench-") as tmp:
        root = args.root or Path(tmp) / "tree"
        if not (root / ".git").exists():
            root.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            counts = build(root, args.files)
            print(f"built {counts} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
            # Files younger than the racy window are hashed; a real project's files are older than that.
            time.sleep(snapshot.RACY_WINDOW_NS / 1e9)
        watch = snapshot.git_watch_paths([root / ".git"])

        def status() -> None:
            subprocess.run([*GIT, "status", "--porcelain", "--ignored"], cwd=root, check=True,
                           stdout=subprocess.DEVNULL)

        def pair() -> tuple[snapshot.Snapshot, snapshot.Snapshot]:
            before = snapshot.take(root, watch)
            after = snapshot.take(root, watch, reference=before)
            assert not snapshot.diff(before, after).paths
            return before, after

        status()  # warm the index's stat cache and the page cache for both sides
        entries = len(snapshot.take(root, watch).entries)
        # Interleaved, so load from other work on a shared machine falls on both sides alike.
        runs: dict[str, list[float]] = {"one": [], "both": [], "git": []}
        for _ in range(args.repeat):
            for name, fn in (("git", status), ("one", lambda: snapshot.take(root, watch)), ("both", pair)):
                t = time.perf_counter()
                kept = fn()  # freed after the clock stops: the walk is timed, not the deallocation
                runs[name].append(time.perf_counter() - t)
                del kept
        one, both, git1 = (statistics.median(runs[k]) for k in ("one", "both", "git"))
    print(f"entries in snapshot:            {entries}")
    print(f"snapshot, one take:             {one * 1000:8.1f} ms")
    print(f"snapshot, before+after+diff:    {both * 1000:8.1f} ms")
    print(f"git status --porcelain --ignored:{git1 * 1000:8.1f} ms")
    print(f"ratio before+after / git status: {both / git1:.2f}x  (target <= 2x)")
    print(f"ratio before+after / 2 x git status: {both / (2 * git1):.2f}x")
    print(f"ratio one take / git status:     {one / git1:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
