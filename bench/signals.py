"""Benchmark (not a test): how often the cheat signals flag honest work (issue 39, item 9).

Honest diffs nobody here wrote: consecutive releases of real packages from PyPI (their sdists), each pair
committed as a base and a "job" commit in a scratch repo, read by the same `diff_signals` a job's diff gets
(test-defining files by proctor.mechanisms.git.frozen). Prints flagged / total, the rate, and each flagged
diff's first signals, by kind. Goal: <= 1% of honest diffs flagged.

Needs the PyPI registry (pip download; cached in $PROCTOR_FIXTURE_CACHE like the tests' fixtures).
Run: .venv/bin/python bench/signals.py [--pairs NAME==A:B ...] [--show 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# Consecutive releases of widely used pure-Python packages (a minor or patch step each): honest work.
PAIRS = [
    "six==1.16.0:1.17.0", "attrs==23.1.0:23.2.0", "click==8.1.6:8.1.7", "idna==3.6:3.7", "packaging==23.2:24.0",
    "pluggy==1.4.0:1.5.0", "iniconfig==2.0.0:2.1.0", "tomli==2.0.1:2.0.2", "itsdangerous==2.1.2:2.2.0",
    "markupsafe==2.1.4:2.1.5", "jinja2==3.1.3:3.1.4", "werkzeug==3.0.2:3.0.3", "flask==3.0.2:3.0.3",
    "requests==2.31.0:2.32.0", "urllib3==2.2.1:2.2.2", "certifi==2024.2.2:2024.6.2", "charset-normalizer==3.3.1:3.3.2",
    "pyparsing==3.1.1:3.1.2", "python-dateutil==2.8.2:2.9.0", "cachetools==5.3.3:5.4.0", "toolz==0.12.0:0.12.1",
    "more-itertools==10.2.0:10.3.0", "wcwidth==0.2.12:0.2.13", "filelock==3.13.4:3.14.0", "platformdirs==4.2.0:4.2.1",
    "decorator==5.1.0:5.1.1", "docutils==0.20:0.20.1", "pytz==2024.1:2024.2", "tabulate==0.8.10:0.9.0",
    "sortedcontainers==2.3.0:2.4.0", "bleach==6.0.0:6.1.0", "soupsieve==2.4.1:2.5", "multidict==6.0.4:6.0.5",
    "frozenlist==1.4.0:1.4.1", "zipp==3.18.1:3.18.2", "jsonschema==4.21.1:4.22.0", "rich==13.7.0:13.7.1",
    "pygments==2.17.1:2.17.2", "tqdm==4.66.2:4.66.4", "httpx==0.27.0:0.27.2",
]
GIT = ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid", "-c", "init.defaultBranch=master",
       "-c", "commit.gpgsign=false"]


def sdist(cache: Path, name: str, version: str) -> Path | None:
    d = cache / "signals-sdists"
    d.mkdir(parents=True, exist_ok=True)
    found = sorted(d.glob(f"{name.replace('-', '_')}-{version}.tar.gz")) + sorted(d.glob(f"{name}-{version}.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"{name}=={version}", "-d", str(d)], capture_output=True, timeout=300)
        found = sorted(p for p in d.glob("*.tar.gz") if p.name.lower().replace("_", "-").startswith(
            f"{name.lower()}-{version}.tar"))
    return found[0] if found else None


def unpack(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive) as tf:
        tf.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    return tops[0]


def commit_tree(repo: Path, src: Path, message: str) -> str:
    for p in repo.iterdir():
        if p.name != ".git":
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p in src.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, repo / p.name, symlinks=True)
        else:
            shutil.copy2(p, repo / p.name, follow_symlinks=False)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run([*GIT, "commit", "-qm", message, "--allow-empty"], cwd=repo, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def main() -> None:
    from ecosystems_fetch import cache_dir
    from proctor.mechanisms.evidence.signals import diff_signals
    from proctor.mechanisms.git.frozen import is_test_defining
    from proctor.mechanisms.git.trees import changed_paths

    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", nargs="*", default=PAIRS)
    ap.add_argument("--show", type=int, default=2)
    args = ap.parse_args()
    cache = cache_dir()
    work = Path(tempfile.mkdtemp(prefix="proctor-bench-signals-"))
    flagged, total, kinds = 0, 0, collections.Counter()
    try:
        for pair in args.pairs:
            name, _, versions = pair.partition("==")
            old_v, new_v = versions.split(":")
            a, b = sdist(cache, name, old_v), sdist(cache, name, new_v)
            if a is None or b is None:
                print(f"{pair}: not fetched (skipped)")
                continue
            repo = work / name
            repo.mkdir()
            subprocess.run([*GIT, "init", "-q"], cwd=repo, check=True)
            base = commit_tree(repo, unpack(a, work / f"{name}-a"), old_v)
            head = commit_tree(repo, unpack(b, work / f"{name}-b"), new_v)
            changed = changed_paths(repo / ".git", base, head)
            if not isinstance(changed, list):
                continue
            risks = diff_signals(repo / ".git", base, head, changed, is_test_defining)
            total += 1
            if risks:
                flagged += 1
                for r in risks:
                    kinds[r.split(": ", 3)[2].split(" through")[0].split(" (")[0] if r.count(": ") >= 3 else r[:60]] += 1
                print(f"{pair}: FLAGGED ({len(risks)}): " + " | ".join(r[:160] for r in risks[:args.show]))
            else:
                print(f"{pair}: clean ({len(changed)} files changed)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = flagged / total if total else 0.0
    print(f"\nhonest release diffs flagged: {flagged} of {total} ({rate:.1%}); goal <= 1%")
    for kind, n in kinds.most_common(12):
        print(f"  {n:4d}  {kind}")


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    main()
