"""The process runner on real processes: deadline, whole-tree kill, bounded tails, stdin handling.

Each "killed" test has a control showing the same payload survives a naive host, so the kill is evidence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.confine.limits import Limits
from proctor.mechanisms.process.local import LocalRunner, Tail
from proctor.mechanisms.process.spawn import Spawn

PY = sys.executable
CGROUP = cgroup.parent_dir() is not None

# Double-forks a setsid daemon that keeps stdout/stderr open and records its pid, then the main process
# either exits at once or sleeps (to be killed at the deadline).
DAEMON = r"""
import os, sys, time
pidfile, main_sleep = sys.argv[1], float(sys.argv[2])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(pidfile, "w").write(str(os.getpid()))
        if len(sys.argv) > 3: os.environ.clear()
        time.sleep(600); os._exit(0)
    os._exit(0)
os.wait()
while not os.path.exists(pidfile): time.sleep(0.01)
print("main done", flush=True)
time.sleep(main_sleep)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pid(pidfile: Path) -> int:
    return int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 60, "the daemon's pid"))


def _drains() -> set[threading.Thread]:
    """The runner's output readers alive now (threads running its `drain`)."""
    return {t for t in threading.enumerate() if t.name.endswith("(drain)") and t.is_alive()}


def _spawn(tmp_path, argv, **kw) -> Spawn:
    return Spawn(argv=argv, cwd=tmp_path, env=dict(os.environ), **kw)


def test_control_naive_killpg_leaves_setsid_daemon_alive(tmp_path):
    """Control: a process-group kill misses the daemon, and the pipe stays open."""
    pidfile = tmp_path / "d.pid"
    p = subprocess.Popen([PY, "-c", DAEMON, str(pidfile), "30"], stdout=subprocess.PIPE, start_new_session=True)
    pid = _pid(pidfile)
    try:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        time.sleep(0.2)
        assert _alive(pid), "control failed: the daemon died without a tree kill"
    finally:
        os.kill(pid, signal.SIGKILL)
        p.stdout.close()


@pytest.mark.parametrize("use_cgroup", [pytest.param(True, marks=pytest.mark.skipif(not CGROUP, reason="no writable cgroup v2 here")), False])
def test_deadline_kills_whole_tree_including_setsid_daemon(tmp_path, use_cgroup):
    pidfile = tmp_path / "d.pid"
    before = _drains()
    ex = LocalRunner(use_cgroup=use_cgroup).run(_spawn(tmp_path, [PY, "-c", DAEMON, str(pidfile), "60"], deadline_s=1.5, term_grace_s=0.2))
    pid = _pid(pidfile)
    assert ex.timed_out
    assert ex.cleanup == ("cgroup" if use_cgroup else "subreaper")
    assert not _alive(pid), "the setsid daemon survived the deadline"
    # The daemon held stdout: with it killed the pipes closed and the drains ended, rather than being given
    # up on with the daemon still writing (how long the kill took is bench/kill.py's).
    assert _drains() <= before, "a drain outlived the run: the daemon's pipe stayed open"
    assert b"main done" in ex.stdout


@pytest.mark.parametrize("use_cgroup", [pytest.param(True, marks=pytest.mark.skipif(not CGROUP, reason="no writable cgroup v2 here")), False])
def test_daemon_left_after_a_normal_exit_is_killed_and_counted(tmp_path, use_cgroup):
    pidfile = tmp_path / "d.pid"
    before = _drains()
    ex = LocalRunner(use_cgroup=use_cgroup).run(_spawn(tmp_path, [PY, "-c", DAEMON, str(pidfile), "0"], deadline_s=30))
    # Not timed out: the host did not wait on the pipe the daemon held (that wait ends only at the deadline).
    assert ex.exit_code == 0 and not ex.timed_out
    assert _drains() <= before, "a drain outlived the run: the daemon's pipe stayed open"
    assert ex.leftovers_killed >= 1
    assert not _alive(_pid(pidfile))


@pytest.mark.skipif(not CGROUP, reason="no writable cgroup v2 here")
def test_cgroup_catches_a_daemon_that_scrubbed_its_environment(tmp_path):
    pidfile = tmp_path / "d.pid"
    ex = LocalRunner().run(_spawn(tmp_path, [PY, "-c", DAEMON, str(pidfile), "0", "scrub"], deadline_s=30))
    assert ex.leftovers_killed >= 1
    assert not _alive(_pid(pidfile))


def test_term_ignored_then_killed_after_grace(tmp_path):
    # It notes the TERM and carries on. Ended once it is up (its handler set), so TERM always finds the
    # handler: a 1 s deadline raced a loaded machine's Python start-up.
    code = ("import signal,sys,time\n"
            "signal.signal(signal.SIGTERM, lambda *_: print('got TERM', flush=True))\n"
            "print('up', flush=True)\n"
            "for _ in range(600): time.sleep(0.1)\n")
    ex = LocalRunner().run(_spawn(tmp_path, [PY, "-c", code], deadline_s=300, term_grace_s=0.5,
                                  watch=lambda s, c: "up" if b"up" in c else None))
    # TERM came first and was survived, then KILL ended it (not the minute of sleep, nor the deadline).
    assert ex.killed_reason == "up" and not ex.timed_out
    assert b"got TERM" in ex.stdout and ex.exit_code == -signal.SIGKILL, ex


def test_fork_storm_is_bounded_by_the_deadline(tmp_path):
    code = "import os,time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n    time.sleep(0.05)\n"
    # No pids limit here (Limits() is all None): the deadline alone bounds it; the pids limit is
    # tests/test_limits.py's.
    me = psutil.Process()
    # Children this process had before (multiprocessing's resource tracker, started by an earlier test's
    # spawn pool, lives as long as pytest: CI counted it as a fork) are not the storm's.
    before = {c.pid for c in me.children(recursive=True)}
    ex = LocalRunner(limits=Limits()).run(_spawn(tmp_path, [PY, "-c", code], deadline_s=1.0, term_grace_s=0.1))
    assert ex.timed_out

    def stragglers() -> list[psutil.Process]:
        out = []
        for c in me.children(recursive=True):
            try:
                if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE:
                    out.append(c)
            except psutil.NoSuchProcess:
                pass
        return out

    # Killed ones may take a moment to be gone on a loaded machine; one that lives on fails the bound.
    wait_until(lambda: not stragglers(), 60, "no fork of the storm left")


def test_tail_is_bounded_and_counts_what_it_dropped(tmp_path):
    n = 64 * 1024 * 1024
    code = f"import os\nb=b'a'*(1<<20)\nfor _ in range({n >> 20}): os.write(1, b)\nos.write(1, b'THE-END')"
    ex = LocalRunner().run(_spawn(tmp_path, [PY, "-c", code], deadline_s=60, tail_bytes=1_000_000))
    assert ex.exit_code == 0
    assert len(ex.stdout) == 1_000_000 and ex.stdout.endswith(b"THE-END")
    assert ex.stdout_dropped == n + 7 - 1_000_000


def test_tail_unit():
    t = Tail(10)
    for i in range(100):
        t.add(bytes([65 + i % 26]) * 3)
    assert len(t.data) == 10 and t.total == 300 and t.dropped == 290


def test_stdin_is_dev_null_unless_given(tmp_path):
    code = "import os,sys; st=os.fstat(0); print(os.major(st.st_rdev), os.minor(st.st_rdev), repr(sys.stdin.read()))"
    ex = LocalRunner().run(_spawn(tmp_path, [PY, "-c", code], deadline_s=10))
    assert ex.stdout.decode().split()[:3] == ["1", "3", "''"]  # /dev/null is char 1:3
    ex2 = LocalRunner().run(_spawn(tmp_path, [PY, "-c", "import sys; print(len(sys.stdin.read()))"], deadline_s=10, stdin=b"x" * 500_000))
    assert ex2.stdout.strip() == b"500000"


def test_watch_reason_ends_the_run_early(tmp_path):
    code = "import time; print('STOP-NOW', flush=True); time.sleep(60); print('slept')"
    ex = LocalRunner().run(_spawn(tmp_path, [PY, "-c", code], deadline_s=30, term_grace_s=0.2,
                                  watch=lambda s, c: "saw stop" if b"STOP-NOW" in c else None))
    # Ended by the watch's reason, by a signal, before its sleep ran out or the deadline came.
    assert ex.killed_reason == "saw stop" and not ex.timed_out and ex.exit_code == -signal.SIGTERM, ex
    assert b"slept" not in ex.stdout


def test_poll_reason_ends_the_run_and_control_runs_to_the_end(tmp_path):
    # The run sleeps far longer than the polls take to come round, however crowded the machine (they wait
    # up to POLL_MAX_S there): a run that printed would be one the reason did not end.
    code = "import time; time.sleep(60); print('finished')"
    flag = {"n": 0}

    def poll():
        flag["n"] += 1
        return "stopped by test" if flag["n"] > 2 else None

    ex = LocalRunner().run(_spawn(tmp_path, [PY, "-c", code], deadline_s=120, poll=poll, term_grace_s=0.2))
    assert ex.killed_reason == "stopped by test" and not ex.timed_out and b"finished" not in ex.stdout
    code = "import time; time.sleep(1.0); print('finished')"
    control = LocalRunner().run(_spawn(tmp_path, [PY, "-c", code], deadline_s=30, poll=lambda: None))
    assert control.ok and b"finished" in control.stdout


def test_missing_executable_is_a_spawn_error_not_an_exception(tmp_path):
    ex = LocalRunner().run(_spawn(tmp_path, ["/nonexistent/agent-cli"], deadline_s=5))
    assert ex.exit_code is None and "FileNotFoundError" in (ex.spawn_error or "")


def test_a_child_that_is_exiting_as_the_agent_exits_is_not_a_leftover(tmp_path):
    # What a pid namespace's member mid-exit looks like to the runner: gone a moment after the agent.
    ending = LocalRunner(limits=Limits()).run(_spawn(tmp_path, ["sh", "-c", "sleep 0.1 & exit 0"], deadline_s=10))
    assert ending.exit_code == 0 and ending.leftovers_killed == 0
    # The control: one that stays is a leftover, and is killed.
    staying = LocalRunner(limits=Limits()).run(_spawn(tmp_path, ["sh", "-c", "sleep 30 & exit 0"], deadline_s=10))
    assert staying.exit_code == 0 and staying.leftovers_killed == 1


def test_dying_is_what_the_kernel_is_already_ending():
    """A member on its way out (a zombie, in exit, or a SIGKILL pending: a pid namespace's members when its
    init exits) is no leftover; a live one is (the control)."""
    from proctor.mechanisms.process.tree import dying

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not dying(child.pid), "control: a sleeping child is alive and staying"
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dying(child.pid)  # killed, not yet reaped
    finally:
        child.kill()
        child.wait()
    assert dying(child.pid)  # gone
