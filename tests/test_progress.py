"""Human progress goes to stderr, only on a terminal; stdout stays pure JSON either way."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from proctor.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))


def test_progress_on_a_tty_stderr_and_quiet_on_a_pipe(repo, fake):
    fake("claude", Behaviour(stdout="thinking hard about it\n", writes={"a": "1"}, sleep=0.6))
    args = [PROCTOR, "run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", "T",
            "--validate-cmd", "true"]
    master, slave = pty.openpty()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out, _ = p.communicate(timeout=60)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    shown = b"".join(chunks).decode("utf-8", "replace")
    assert json.loads(out)["status"] == "completed"
    assert "completed" in shown and "worktree" in shown
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert json.loads(quiet.stdout)["status"] == "completed" and quiet.stderr == ""
