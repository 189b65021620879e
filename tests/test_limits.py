"""Per-job resource limits on real processes (issue 11 item 2) and the stop check right before a launch (item 4).

Each kill has a control beside it: a legitimate run under the same limits that completes. Limits are
configured small (64 MiB, 64 tasks, a few MiB of disk) so the tests cost the 2-core / 24 GiB machine nothing.
Tests that need the cgroup skip where there is none, and fail instead under CI=true.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import UNCONFINED, make_repo

from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.config.model import LimitsSettings, parse_size
from proctor.contract import Code
from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.confine.limits import Limits, total_ram
from proctor.mechanisms.process.local import Limited, LocalRunner
from proctor.mechanisms.process.spawn import Spawn
from proctor.mechanisms.policy.stop import StopSwitch

PY = sys.executable
MIB = 1 << 20
SMALL = Limits(memory=64 * MIB, swap=0, pids=64, cpu_weight=50, disk=4 * MIB)


@pytest.fixture
def need_cgroup():
    group = cgroup.JobGroup.create(cgroup.group_name("probe"), SMALL)
    ok = group is not None and {"memory", "pids"} <= set(group.ctl)
    if group is not None:
        group.remove()
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: the per-job cgroup with memory and pids controllers is required here")
        pytest.skip("no writable cgroup with memory and pids controllers on this machine")


def run(tmp_path: Path, code: str, limits: Limits = SMALL, deadline: float = 30, **kw):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}
    return LocalRunner().run(Spawn(argv=[PY, "-c", code], cwd=work, env=env, deadline_s=deadline, limits=limits,
                                   name="limits", term_grace_s=0.2, **kw))


ALLOC = """
import sys
chunks = []
for _ in range(int(sys.argv[1])):
    chunks.append(bytearray(8 << 20))   # touched: bytearray zero-fills
print("allocated", len(chunks) * 8, "MiB", flush=True)
"""


# -- memory ---------------------------------------------------------------------------------------------

# How soon a limit's kill lands and how the host fares meanwhile (its 10 ms loop, a CPU-bound loop against
# an idle baseline) is measured by bench/limits.py; a test's clock would be the machine's load (issue 24).

def test_memory_limit_kills_the_job(tmp_path, need_cgroup):
    ex = run(tmp_path, ALLOC.replace("int(sys.argv[1])", "64"))  # 512 MiB against 64 MiB
    assert ex.killed_reason and ex.killed_reason.startswith("resource_limit: memory"), ex
    assert "oom_kill" in ex.killed_reason and b"allocated" not in ex.stdout
    assert not ex.timed_out, "ended by the limit, not by the 30 s deadline"
    assert any(s.startswith("memory 64 MiB") for s in ex.limits), ex.limits


def test_memory_control_below_the_limit_completes(tmp_path, need_cgroup):
    ex = run(tmp_path, ALLOC.replace("int(sys.argv[1])", "2"))  # 16 MiB against 64 MiB
    assert ex.ok and b"allocated 16 MiB" in ex.stdout, ex


# -- pids -----------------------------------------------------------------------------------------------

FORK_LOOP = """
import os, time
kids = []
for _ in range(int(N)):
    pid = os.fork()
    if pid == 0:
        time.sleep(30); os._exit(0)
    kids.append(pid)
print("forked", len(kids), flush=True)
for k in kids:
    os.kill(k, 9); os.waitpid(k, 0)
"""


def test_pids_limit_kills_a_fork_loop(tmp_path, need_cgroup):
    ex = run(tmp_path, FORK_LOOP.replace("int(N)", "400"))
    assert ex.killed_reason and ex.killed_reason.startswith("resource_limit: pids limit 64"), ex
    assert "pids.events max" in ex.killed_reason and b"forked" not in ex.stdout
    assert not ex.timed_out, "ended by the limit, not by the 30 s deadline"


def test_pids_control_a_few_children_complete(tmp_path, need_cgroup):
    ex = run(tmp_path, FORK_LOOP.replace("int(N)", "10"))
    assert ex.ok and b"forked 10" in ex.stdout, ex


# -- disk (watched) -------------------------------------------------------------------------------------

WRITE = """
import os, sys, time
where, mib = sys.argv[1], int(sys.argv[2])
path = os.path.join(os.environ["TMPDIR"] if where == "tmp" else os.getcwd(), "big.bin")
with open(path, "wb") as fh:
    if where == "unlinked":
        os.unlink(path)
    for _ in range(mib):
        fh.write(b"x" * (1 << 20)); fh.flush(); os.fsync(fh.fileno())
    print("wrote", mib, flush=True)
    time.sleep(60)   # a writer that stays past the 30 s deadline: only the watcher can end it in time
    print("slept", flush=True)
"""


@pytest.mark.parametrize("where", ["tmp", "worktree", "unlinked"])
def test_disk_limit_kills_a_job_writing_past_it(tmp_path, where):
    code = WRITE.replace("sys.argv[1], int(sys.argv[2])", f"{where!r}, 16")
    ex = run(tmp_path, code)
    assert ex.killed_reason and ex.killed_reason.startswith("resource_limit: disk limit 4 MiB"), ex
    # Killed while it ran (a signal, its sleep cut short, before the deadline): the watcher ended it, not a
    # check after its exit.
    assert not ex.timed_out and ex.exit_code is not None and ex.exit_code < 0, ex
    assert b"slept" not in ex.stdout


def test_disk_control_small_writes_and_a_sparse_file_complete(tmp_path):
    code = WRITE.replace("sys.argv[1], int(sys.argv[2])", "'tmp', 1").replace("time.sleep(60)", "pass")
    code += "\nf = open('sparse.bin', 'wb'); f.truncate(1 << 30); f.close()\n"  # 1 GiB apparent, ~0 allocated
    ex = run(tmp_path, code)
    assert ex.ok and b"wrote 1" in ex.stdout, ex


def test_disk_baseline_is_what_was_there_before(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "checkout.bin").write_bytes(os.urandom(8 * MIB))  # the repo's own files: not counted
    ex = run(tmp_path, "print('ok')")
    assert ex.ok, ex


# -- through run_agent ----------------------------------------------------------------------------------

AGENT = """#!{py}
import os, sys, time
if sys.argv[1:] == ["--version"]:
    if os.environ.get("STOP_IN_PROBE"):
        from pathlib import Path
        Path(os.environ["STOP_IN_PROBE"]).write_text("stopped during the probe\\n")
    print("lim 1.0"); sys.exit(0)
open(os.path.join(os.environ["CALLS"], str(time.monotonic_ns())), "w").close()
what = os.environ.get("DO", "")
if what == "alloc":
    keep = [bytearray(8 << 20) for _ in range(64)]
elif what == "fork":
    kids = [os.fork() or (time.sleep(30), os._exit(0)) for _ in range(400)]
elif what in ("tmp", "worktree"):
    d = os.environ["TMPDIR"] if what == "tmp" else os.getcwd()
    with open(os.path.join(d, "big.bin"), "wb") as fh:
        for _ in range(16):
            fh.write(b"x" * (1 << 20)); fh.flush(); os.fsync(fh.fileno())
        time.sleep(3)
open("done.txt", "w").write("done\\n")
"""


def agent_setup(tmp_path, fake_bin, do: str, limits: str = 'memory = "64MiB"\npids = 64\ndisk = "4MiB"\n',
                stop_in_probe: bool = False):
    calls = tmp_path / "calls"
    calls.mkdir()
    exe = fake_bin / "lim-agent"
    exe.write_text(AGENT.replace("{py}", PY))
    exe.chmod(0o755)
    # The stop file's path given by the adapter: the agent's environment has no PROCTOR_HOME (sandbox_home).
    stop = Path(os.environ["PROCTOR_HOME"], "STOP")
    env = f'DO = "{do}", CALLS = "{calls}"' + (f', STOP_IN_PROBE = "{stop}"' if stop_in_probe else "")
    cfg = tmp_path / "config.toml"
    cfg.write_text(UNCONFINED + f'[limits]\n{limits}\n[agents.lim]\ncommand = ["lim-agent", "{{prompt}}"]\n'
                   f'version_args = ["--version"]\nenv = {{ {env} }}\n')
    return load_config(cfg), calls


def job(tmp_path, config):
    repo = make_repo(tmp_path / "repo")
    return run_agent(RunAgentRequest(agent="lim", task="t", repo=str(repo), ticket="T-1", validateCommand="true"),
                     config=config)


@pytest.mark.parametrize("do,limit,observed", [("alloc", "memory", "oom_kill"), ("fork", "pids", "pids.events max"),
                                               ("tmp", "disk", "bytes"), ("worktree", "disk", "bytes")])
def test_run_agent_killed_at_a_limit_is_resource_limit_never_retried(tmp_path, fake_bin, need_cgroup, do, limit,
                                                                     observed):
    config, calls = agent_setup(tmp_path, fake_bin, do)
    res = job(tmp_path, config)
    assert res.status is Status.failed and res.code is Code.RESOURCE_LIMIT, res
    assert res.attempts == 1 and len(list(calls.iterdir())) == 1, "a limit kill is never retried"
    risk = next(r for r in res.known_risks if "resource limit" in r)
    assert f"{limit} limit" in risk and observed in risk, risk
    assert res.needs_human_review


def test_run_agent_control_completes_and_reports_its_limits(tmp_path, fake_bin, need_cgroup):
    config, calls = agent_setup(tmp_path, fake_bin, "nothing")
    res = job(tmp_path, config)
    assert res.status is Status.completed and res.code is Code.OK, res
    limits = res.confinement_details["limits"]
    assert any(s.startswith("memory 64 MiB") for s in limits), limits
    assert any(s.startswith("pids 64") for s in limits) and any(s.startswith("disk 4 MiB") for s in limits)
    assert not any("resource limit" in r for r in res.known_risks)


def test_validation_runs_under_the_same_limits(tmp_path):
    seen = []

    class Recorder:
        def run(self, spawn):
            seen.append(spawn)
            return LocalRunner().run(spawn)

    config, _ = agent_setup(tmp_path, tmp_path, "nothing")  # bin dir unused: the recorder is the runner
    lim = Limited(Recorder(), config.limits.resolve(), (tmp_path,))
    lim.run(Spawn(argv=["true"], cwd=tmp_path, env=dict(os.environ), deadline_s=5))
    assert seen[0].limits.memory == 64 * MIB and seen[0].limits.disk == 4 * MIB and seen[0].disk_roots == (tmp_path,)


# -- stop: the last check before each launch (item 4) ----------------------------------------------------

def test_stop_engaged_during_the_version_probe_launches_nothing(tmp_path, fake_bin):
    config, calls = agent_setup(tmp_path, fake_bin, "nothing", stop_in_probe=True)
    try:
        res = job(tmp_path, config)
    finally:
        StopSwitch().release()
    assert res.status is Status.failed and res.code is Code.STOPPED, res
    assert list(calls.iterdir()) == [], "the agent launched after proctor stop"
    assert any("nothing was launched" in r for r in res.known_risks), res.known_risks


def test_stop_control_same_probe_without_stop_launches(tmp_path, fake_bin):
    config, calls = agent_setup(tmp_path, fake_bin, "nothing")
    res = job(tmp_path, config)
    assert res.status is Status.completed and len(list(calls.iterdir())) == 1, res


def test_runner_reads_poll_right_before_the_spawn(tmp_path):
    marker = tmp_path / "ran"
    argv = [PY, "-c", f"open({str(marker)!r}, 'w').close()"]
    ex = LocalRunner().run(Spawn(argv=argv, cwd=tmp_path, env=dict(os.environ), deadline_s=5,
                                 poll=lambda: "stopped: test"))
    assert not ex.launched and ex.killed_reason == "stopped: test" and ex.pid is None and not marker.exists()
    control = LocalRunner().run(Spawn(argv=argv, cwd=tmp_path, env=dict(os.environ), deadline_s=5, poll=lambda: None))
    assert control.ok and control.launched and marker.exists()


@pytest.mark.parametrize("use_cgroup,disk", [(True, False), (False, False), (True, True)],
                         ids=["group", "no-group", "group+disk"])
def test_a_stopped_launch_leaves_no_child_and_a_missing_program_is_a_spawn_error(tmp_path, use_cgroup, disk, request):
    """With and without the job group (a child that joins it between fork and exec), and with a disk limit
    (its baseline walked between the group's creation and the launch): a stop before the launch leaves no
    process behind, and exec's own failure (or a cwd that is gone) comes back as the spawn's error, not as
    an exit code. Control: a real program runs."""
    import psutil

    if use_cgroup:
        request.getfixturevalue("need_cgroup")
    limits = SMALL if disk else None
    before = {c.pid for c in psutil.Process().children()}
    stopped = LocalRunner(use_cgroup=use_cgroup, limits=limits).run(
        Spawn(argv=[PY, "-c", "pass"], cwd=tmp_path, env=dict(os.environ), deadline_s=5, poll=lambda: "stopped: t"))
    assert not stopped.launched and stopped.spawn_error is None, stopped
    assert {c.pid for c in psutil.Process().children()} - before == set()
    missing = LocalRunner(use_cgroup=use_cgroup, limits=limits).run(
        Spawn(argv=[str(tmp_path / "no-such-program")], cwd=tmp_path, env=dict(os.environ), deadline_s=5))
    assert missing.spawn_error and "FileNotFoundError" in missing.spawn_error and missing.pid is None, missing
    gone = LocalRunner(use_cgroup=use_cgroup, limits=limits).run(
        Spawn(argv=[PY, "-c", "pass"], cwd=tmp_path / "gone", env=dict(os.environ), deadline_s=5))
    assert gone.spawn_error and "FileNotFoundError" in gone.spawn_error and not gone.ok, gone
    assert {c.pid for c in psutil.Process().children()} - before == set()
    ran = LocalRunner(use_cgroup=use_cgroup, limits=limits).run(
        Spawn(argv=[PY, "-c", "print('ran')"], cwd=tmp_path, env=dict(os.environ), deadline_s=5))
    assert ran.ok and ran.stdout.strip() == b"ran", ran


# -- config ---------------------------------------------------------------------------------------------

def test_limits_config_defaults_and_sizes(tmp_path):
    d = LimitsSettings().resolve()
    ram = total_ram()
    assert d.memory == ram // 3 and d.memory_total == ram * 3 // 4 and d.pids == 1024 and d.disk == 10 << 30
    assert d.swap == 0 and d.cpu_weight == 100
    assert parse_size("64MiB") == 64 * MIB and parse_size("1.5 GiB") == 3 << 29 and parse_size(4096) == 4096
    bad = tmp_path / "bad.toml"
    bad.write_text('[limits]\nmemory = "lots"\n')
    with pytest.raises(ConfigError, match="limits.memory"):
        load_config(bad)
    raised = tmp_path / "raised.toml"
    raised.write_text('[limits]\nmemory = "16GiB"\npids = 4096\ndisk = "50GiB"\n')
    r = load_config(raised).limits.resolve()
    assert r.memory == 16 << 30 and r.pids == 4096 and r.disk == 50 << 30


# -- the held child: forked into its group while the disk baseline is walked, exec'd on release ------------

def _held_children(before: set[int]) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process().children() if c.pid not in before]


def test_a_held_child_killed_before_its_exec_is_a_kill_never_an_exit_of_0(tmp_path, need_cgroup):
    """Killed while held (here from the last check before the launch), the agent never ran: the run says
    signal 9, not the 0 a lost exit status reads as. Control: the same run, not killed, exits 0 and ran."""
    import psutil

    marker = tmp_path / "ran"
    argv = [PY, "-c", f"open({str(marker)!r}, 'w').close()"]
    before = {c.pid for c in psutil.Process().children()}
    seen: list[int] = []

    def kill_the_held() -> None:
        seen.extend(_held_children(before))
        for pid in seen:
            os.kill(pid, signal.SIGKILL)

    ex = LocalRunner(limits=SMALL).run(Spawn(argv=argv, cwd=tmp_path, env=dict(os.environ), deadline_s=10,
                                             poll=kill_the_held))
    assert seen and ex.exit_code == -9 and not ex.ok and not marker.exists(), (seen, ex)
    control = LocalRunner(limits=SMALL).run(Spawn(argv=argv, cwd=tmp_path, env=dict(os.environ), deadline_s=10,
                                                  poll=lambda: None))
    assert control.ok and marker.exists(), control


def test_a_held_child_ends_by_a_signal_never_through_the_hosts_handler(tmp_path, need_cgroup):
    """The held child is a fork of the host: a TERM it gets (a `pkill` or a service stop meant for the host)
    must end it as a signal, not run the host's Python handler (the MCP server's exits 0). Control: the
    host's handler does run in the host."""
    import psutil

    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        before = {c.pid for c in psutil.Process().children()}

        def term_the_held() -> None:
            for pid in _held_children(before):
                got.append(pid)
                os.kill(pid, signal.SIGTERM)

        ex = LocalRunner(limits=SMALL).run(Spawn(argv=[PY, "-c", "print('ran')"], cwd=tmp_path,
                                                 env=dict(os.environ), deadline_s=10, poll=term_the_held))
        assert got and ex.exit_code == -signal.SIGTERM and ex.stdout == b"", (got, ex)
    finally:
        signal.signal(signal.SIGTERM, previous)
    control = subprocess.run([PY, "-c", "import os, signal, time; signal.signal(signal.SIGTERM, "
                              "lambda *_: os._exit(0)); os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)"],
                             timeout=30)
    assert control.returncode == 0


def test_a_held_child_keeps_no_pipe_of_the_hosts_open(tmp_path, need_cgroup):
    """Held for the whole baseline walk, the child must not keep the fds it inherited: another thread's (or
    job's) pipe would see its EOF only when the child execs, and two jobs' held children waiting on each
    other's pipes deadlocked a host. A pipe made before the fork, closed by the host during the hold, reads
    EOF at once. Control: a plain child holding its copy keeps the reader waiting."""
    import psutil

    r, w = os.pipe()
    os.set_blocking(r, False)
    state: dict[str, object] = {}
    before = {c.pid for c in psutil.Process().children()}

    def close_and_read() -> None:
        state["held"] = _held_children(before)
        os.close(w)
        try:
            state["read"] = os.read(r, 1)
        except BlockingIOError:
            state["read"] = "blocked"

    try:
        ex = LocalRunner(limits=SMALL).run(Spawn(argv=[PY, "-c", "pass"], cwd=tmp_path, env=dict(os.environ),
                                                 deadline_s=10, poll=close_and_read))
        assert ex.ok and state["held"] and state["read"] == b"", (ex, state)
    finally:
        os.close(r)
    r, w = os.pipe()
    os.set_blocking(r, False)
    holder = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"], pass_fds=(w,))
    try:
        os.close(w)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        holder.kill()
        holder.wait()
        os.close(r)


def test_a_held_child_that_fails_after_dropping_its_fds_is_a_spawn_error_not_an_exit(tmp_path, need_cgroup):
    """Past the point where the held child closed Popen's error pipe, a failure (here an exec the OS refuses
    for an environment name execve will not take) comes back as the spawn's error, never as a launched
    run that exited 255. Control: the same run with a plain environment runs."""
    bad = LocalRunner(limits=SMALL).run(Spawn(argv=[PY, "-c", "pass"], cwd=tmp_path,
                                              env={**os.environ, "": "x"}, deadline_s=10))
    assert bad.spawn_error and bad.exit_code is None and not bad.ok, bad
    good = LocalRunner(limits=SMALL).run(Spawn(argv=[PY, "-c", "pass"], cwd=tmp_path, env=dict(os.environ),
                                               deadline_s=10))
    assert good.ok and good.spawn_error is None, good


def test_a_host_started_with_its_stdio_closed_still_holds_and_runs(tmp_path, need_cgroup):
    """A host whose fd 0 is closed gets it back from pipe(): the held child's own pipe must not land where
    Popen puts the child's stdin. Control: the run's output comes back either way."""
    code = ("import os, sys\n"
            "from proctor.mechanisms.process.local import LocalRunner\n"
            "from proctor.mechanisms.process.spawn import Spawn\n"
            "from proctor.mechanisms.confine.limits import Limits\n"
            f"ex = LocalRunner(limits=Limits(memory={SMALL.memory}, swap=0, pids=64, disk={SMALL.disk})).run(Spawn("
            f"argv=[sys.executable, '-c', 'print(42)'], cwd={str(tmp_path)!r}, env=dict(os.environ), deadline_s=10))\n"
            "print(ex.exit_code, ex.stdout.strip().decode(), ex.spawn_error, file=sys.stderr)\n")
    for closed in ("0<&-", ""):
        out = subprocess.run(["/bin/sh", "-c", f'exec "$0" -c "$1" {closed}', PY, code], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert out.returncode == 0 and out.stderr.strip().splitlines()[-1] == "0 42 None", (closed, out.stderr)


def test_the_disk_watch_polls_within_its_share_of_the_machine():
    """The wait between two looks at the disk: 1% of a core of what a look cost while the machine has a
    core for each runnable task; past that, 1% of the job's share (the cores over the load), never longer
    than 2 s between looks nor a walk more than ~10% of the time."""
    from proctor.mechanisms.confine.disk import DISK_POLL_MAX_S, DISK_POLL_S, interval
    from proctor.mechanisms.confine.limits import crowd

    assert crowd(0.0) == 1.0 and crowd(10.0 * (os.cpu_count() or 1)) == 10.0

    cores = os.cpu_count() or 1
    assert interval(0.001, 0.003, load=0.5 * cores) == pytest.approx(0.3)  # 3 ms a look: one each 0.3 s
    assert interval(0.001, 0.003, load=cores) == pytest.approx(0.3)
    assert interval(0.001, 0.003, load=4 * cores) == pytest.approx(1.2)  # four tasks a core: a quarter of one
    assert interval(0.001, 0.003, load=25 * cores) == DISK_POLL_MAX_S  # 50 jobs on 2 cores: the cap
    assert interval(0.001, 0.0001, load=cores) == DISK_POLL_S  # a tiny tree: the floor
    assert interval(0.5, 0.003, load=cores) == pytest.approx(5.0)  # a slow walk: at most ~10% of the time
