"""The repositories the benches run jobs in: `n_files` small files over `dirs` directories (a README alone
when none), one commit, made with a fixed identity and no user config."""

from __future__ import annotations

import subprocess
from pathlib import Path

GIT = ["git", "-c", "user.name=b", "-c", "user.email=b@example.invalid"]


def make_repo(root: Path, n_files: int = 0, *, name: str = "repo", dirs: int = 40) -> Path:
    repo = root / name
    repo.mkdir(parents=True)
    for i in range(n_files):
        p = repo / f"pkg{i % dirs}" / f"mod{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"file {i}\n" * 5)
    if not n_files:
        (repo / "README.md").write_text("hello\n")
    subprocess.run([*GIT, "init", "-q", "-b", "master", str(repo)], check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "init"], cwd=repo, check=True)
    return repo
