"""Host-side git runs with a HOME and XDG_CONFIG_HOME that cannot exist (beneath /dev/null): it reads no
user config from there, and a proctor process leaves nothing behind for it, even one killed before any
exit hook ran (each used to leave an empty dir in /tmp)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import os, sys
from pathlib import Path
from proctor.mechanisms.git.command import git
repo = Path(sys.argv[1])
assert git(["init", "-q", str(repo)]).ok
listed = git(["config", "--list", "--show-origin"], cwd=repo)
print(listed.ok, "alias.planted" in listed.text, listed.err == "", flush=True)
os._exit(0)  # no atexit: as a killed process ends
"""


def test_git_reads_no_home_config_and_leaves_nothing_in_tmp(tmp_path) -> None:
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    (home / ".gitconfig").write_text("[alias]\n\tplanted = !touch /tmp/pwned\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, "HOME": str(home),
           "XDG_CONFIG_HOME": str(home), "TMPDIR": str(tmp)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "repo")], capture_output=True, text=True,
                         timeout=60, check=True, env=env)
    assert out.stdout.split() == ["True", "False", "True"], out  # git ran, saw no home config, warned of nothing
    assert list(tmp.iterdir()) == []
    # The control: git run plainly with the same environment does read that HOME's config.
    plain = subprocess.run(["git", "config", "--list", "--show-origin"], cwd=tmp_path / "repo", env=env,
                           capture_output=True, text=True, check=True)
    assert "alias.planted" in plain.stdout
    assert not Path("/dev/null/proctor-git-home").exists()
