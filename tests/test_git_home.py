"""Host-side git runs with an empty HOME of the process's own; the process removes it as it exits (every
proctor process, and every test, used to leave one in /tmp)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import os
from proctor.mechanisms.git.command import _empty_home, git
assert git(["--version"]).ok
home = _empty_home()
print(home, os.path.isdir(home), flush=True)
"""


def test_the_empty_home_is_gone_when_the_process_ends() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    home, existed = out.stdout.split()
    assert Path(home).name.startswith("proctor-git-home-")
    assert existed == "True"  # the control: git ran with it while the process lived
    assert not Path(home).exists()
