"""Human progress goes to stderr, only on a terminal; stdout stays pure JSON either way."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))


def _on_a_tty(args: list[str]) -> tuple[subprocess.Popen, bytes, str]:
    """Run with stderr a pty (stdout a pipe); what the pty showed, decoded."""
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
    return p, out, b"".join(chunks).decode("utf-8", "replace")


def test_progress_on_a_tty_stderr_and_quiet_on_a_pipe(repo, fake):
    fake("claude", Behaviour(stdout="thinking hard about it\n", writes={"a": "1"}, sleep=0.6))
    args = [PROCTOR, "run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", "T",
            "--validate-cmd", "true"]
    _, out, shown = _on_a_tty(args)
    assert json.loads(out)["status"] == "completed"
    assert "completed" in shown and "worktree" in shown
    quiet = subprocess.run(args, check=False, capture_output=True, text=True, timeout=60)
    assert json.loads(quiet.stdout)["status"] == "completed" and quiet.stderr == ""


def test_a_refusal_after_the_progress_line_started_is_said_on_the_terminal(repo, fake):
    # UNKNOWN_AGENT is decided inside the host, with the live line already drawn: it is taken down first.
    fake("claude")
    p, out, shown = _on_a_tty([PROCTOR, "run-agent", "--agent", "nope\x1b]0;T\x07", "--task", "t", "--repo",
                               str(repo), "--ticket", "T"])
    assert p.returncode == 1 and json.loads(out)["code"] == "UNKNOWN_AGENT"
    # repr() already escaped the ESC; `visible` doubles that backslash, as it does any the text holds.
    assert "proctor: refused (UNKNOWN_AGENT): unknown agent 'nope\\\\x1b]0;T\\\\x07' (known: " in shown, shown
    assert "\x1b]0;T" not in shown  # the agent name a user typed is escaped like an agent's output
