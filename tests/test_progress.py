"""Human progress goes to stderr, only on a terminal; stdout stays pure JSON either way."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "completed (OK)" in shown and "next: proctor show" in shown
    quiet = subprocess.run(args, check=False, capture_output=True, text=True, timeout=60)
    assert json.loads(quiet.stdout)["status"] == "completed"
    # On a pipe no live line (no spinner, no agent output): only the job's closing lines (issue 43).
    assert "thinking hard" not in quiet.stderr and quiet.stderr.startswith("completed (OK) in "), quiet.stderr
    assert all(line.startswith(("completed", "tests:", "next:")) for line in quiet.stderr.splitlines()), quiet.stderr


def test_a_refusal_after_the_progress_line_started_is_said_on_the_terminal(repo, fake):
    # UNKNOWN_AGENT is decided inside the host, with the live line already drawn: it is taken down first.
    fake("claude")
    p, out, shown = _on_a_tty([PROCTOR, "run-agent", "--agent", "nope\x1b]0;T\x07", "--task", "t", "--repo",
                               str(repo), "--ticket", "T"])
    assert p.returncode == 1 and json.loads(out)["code"] == "UNKNOWN_AGENT"
    # repr() already escaped the ESC; `visible` doubles that backslash, as it does any the text holds.
    assert "proctor: refused (UNKNOWN_AGENT): unknown agent 'nope\\\\x1b]0;T\\\\x07' (known: " in shown, shown
    assert "\x1b]0;T" not in shown  # the agent name a user typed is escaped like an agent's output


def _progress_file(job_id: str) -> dict:
    from proctor.services.job.record import job_dir

    return json.loads((job_dir(job_id) / "progress.json").read_text())


def test_the_progress_record_defers_a_phase_that_comes_too_soon_and_loses_none():
    """progress.json (the review page's view of a running job) is written for the first phase at once; the
    phases right after it are carried by one later write, and the job's end is written at once with all.
    The window is an hour here, so no stall of a loaded machine can open it early; the pending write is then
    run as its timer would run it."""
    from types import SimpleNamespace

    from proctor.contract import Code, Status
    from proctor.services.job.progress import NullProgress
    from proctor.services.job.record import LiveProgress

    class Patient(LiveProgress):
        PHASE_EVERY_S = 3600.0

    live = Patient("T1-defer", NullProgress())
    live.phase("checking the request")
    live.phase("making the worktree")
    live.phase("running claude (attempt 1)")
    # At once: the first phase only; the two after it waited (a write each was the job's own cost).
    assert [p["name"] for p in _progress_file("T1-defer")["phases"]] == ["checking the request"]
    assert live._timer is not None
    live._timer.function()  # the deferred write, with both phases
    names = [p["name"] for p in _progress_file("T1-defer")["phases"]]
    assert names == ["checking the request", "making the worktree", "running claude (attempt 1)"]
    assert _progress_file("T1-defer")["ended"] is None
    live.phase("validating")
    live.done(SimpleNamespace(status=Status.completed, code=Code.OK))
    ended = _progress_file("T1-defer")
    assert ended["ended"] == "completed (OK)" and ended["phases"][-1]["name"] == "validating"


@pytest.mark.parametrize("origin", [0.0, 5.0, 1e6], ids=["clock-at-0", "clock-inside-window", "control-up-long"])
def test_the_first_phase_is_written_at_once_whatever_the_clock_counts_from(origin):
    """Issue 37: "never written" was the time 0.0, so under a monotonic clock that started less than the
    window ago (a machine up 56 minutes, a fresh container or microVM) the first phase was deferred and
    progress.json did not exist. The same record under a clock at 0, one inside the window and the control
    (a clock far past it) writes the first phase at once and defers the next, each alike."""
    from proctor.services.job.progress import NullProgress
    from proctor.services.job.record import LiveProgress

    class Patient(LiveProgress):
        PHASE_EVERY_S = 3600.0

    now = [origin]
    job = f"T1-origin-{int(origin)}"
    live = Patient(job, NullProgress(), clock=lambda: now[0])
    live.phase("checking the request")
    assert [p["name"] for p in _progress_file(job)["phases"]] == ["checking the request"]
    assert live._timer is None
    now[0] += 1.0
    live.phase("making the worktree")  # one second later: inside the hour, so it waits
    assert [p["name"] for p in _progress_file(job)["phases"]] == ["checking the request"]
    assert live._timer is not None
    live._timer.cancel()
    now[0] += 3600.0
    live.phase("validating")  # the window is up: written at once, with the one that waited
    assert [p["name"] for p in _progress_file(job)["phases"]] == [
        "checking the request", "making the worktree", "validating"]
    assert _progress_file(job)["elapsedS"] == 3601.0


def test_the_progress_records_deferred_write_comes_by_itself():
    """With the job's own window, the phases said too soon reach the file without anything more happening
    (a bounded poll on the file: the bound is not the property)."""
    from conftest import wait_until

    from proctor.services.job.progress import NullProgress
    from proctor.services.job.record import LiveProgress

    live = LiveProgress("T1-timer", NullProgress())
    for name in ("checking the request", "making the worktree", "running claude (attempt 1)"):
        live.phase(name)
    wait_until(lambda: len(_progress_file("T1-timer")["phases"]) == 3, 30, "the deferred progress write")


def test_the_progress_record_writes_each_phase_at_once_when_they_come_apart():
    """The control: with no deferral window, every phase is in the file as soon as it is said."""
    from proctor.services.job.progress import NullProgress
    from proctor.services.job.record import LiveProgress

    class Eager(LiveProgress):
        PHASE_EVERY_S = 0.0

    live = Eager("T1-eager", NullProgress())
    live.phase("checking the request")
    live.phase("making the worktree")
    assert [p["name"] for p in _progress_file("T1-eager")["phases"]] == ["checking the request",
                                                                         "making the worktree"]
