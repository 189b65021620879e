"""The hostile suite: each escape is a real process, run once unconfined (the control: it works) and once per
confinement this machine gives (it must not). Real git repos with a linked worktree made by `git worktree add`.

Skips only when detect() says the kernel or the machine lacks a mechanism, with its reason. The setsid
daemon and fork storm cases belong to the process runner's and cgroup's tests.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from proctor.mechanisms.git import worktree
from proctor.mechanisms.confine import (
    ConfineRequest,
    LayeredConfiner,
    Unavailable,
    detect,
    job_roots,
    refuse_hard_links,
)

CAPS = detect()
MODES = {"bwrap+landlock": (True, True), "bwrap": (True, False), "landlock": (False, True)}
BRANCH = "wt/job1/T-1"
GIT_ID = ["-c", "user.email=agent@example.invalid", "-c", "user.name=agent"]


NO_NETNS = "landlock-without-netns"  # what a non-root host gets: the helper cannot make a network namespace


def _need(mode: str) -> LayeredConfiner:
    if mode == NO_NETNS:
        return replace(_need("landlock"), caps=replace(CAPS, helper_netns=False))
    use_bwrap, use_landlock = MODES[mode]
    if use_bwrap and CAPS.bwrap is None:
        pytest.skip(f"no bwrap here: {CAPS.bwrap_reason}")
    if use_landlock and not CAPS.landlock:
        pytest.skip(f"no Landlock here: {CAPS.landlock_reason}; helper: {CAPS.helper_reason}")
    return LayeredConfiner(CAPS, use_bwrap, use_landlock)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *GIT_ID, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@dataclass(frozen=True)
class Job:
    base: Path
    main: Path
    wt: Path
    outside: Path
    home: Path
    c1: str
    req: ConfineRequest

    def fingerprint(self) -> dict[str, str]:
        """Everything an agent must not change: the main checkout and its whole .git (objects and refs
        included: the job has a repository of its own), the outside dir and the ledger."""
        out = {}
        for root in (self.main, self.outside, self.home):
            for p in sorted(root.rglob("*")):
                if p.is_file() and not p.is_socket():
                    out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out


@pytest.fixture
def job(tmp_path: Path) -> Job:
    main, outside, home = (tmp_path / n for n in ("main", "outside", "home"))
    subprocess.run(["git", "init", "-q", "-b", "master", str(main)], check=True)
    (main / "README").write_text("main checkout\n")
    _git("add", "README", cwd=main)
    _git("commit", "-qm", "c1", cwd=main)
    c1 = _git("rev-parse", "HEAD", cwd=main)
    _git("commit", "-q", "--allow-empty", "-m", "c2", cwd=main)
    (main / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    repo = worktree.open_repo(main)
    made = worktree.create(repo, "job1", "T-1", worktree.Base("master", _git("rev-parse", "HEAD", cwd=main)))
    assert not isinstance(made, worktree.Failure), made
    wt = made.path
    outside.mkdir()
    (outside / "f.txt").write_text("orig\n")
    home.mkdir()
    (home / "ledger.sqlite3").write_text("ledger rows\n")
    req = job_roots(wt, tmp_path / "jobtmp", readonly=(main, main / ".git"), home=home)
    assert not isinstance(req, Unavailable), req
    # The outside dir is re-exposed read-only (it would be hidden under bwrap's private /tmp otherwise), so
    # a blocked write is EROFS/EACCES on a visible file, not a missing path.
    req = replace(req, readonly=(*req.readonly, outside))
    return Job(tmp_path, main, wt, outside, home, c1, req)


def run(job: Job, mode: str, script: str, req: ConfineRequest | None = None) -> subprocess.CompletedProcess:
    argv = ["sh", "-c", script]
    env = dict(os.environ)
    if mode != "control":
        plan = _need(mode).wrap(argv, req or job.req)
        assert not isinstance(plan, Unavailable), plan
        assert plan.confinement == mode.removesuffix("-without-netns")
        argv, env = plan.argv, {**env, **plan.env}
    return subprocess.run(argv, cwd=job.wt, env=env, capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


PROBES = {
    "absolute_path": "echo pwned > {outside}/f.txt",
    "dotdot": "echo pwned > ../../outside/f.txt",
    "symlink_out": "ln -s {outside}/f.txt link && echo pwned > link",
    "hard_link_out": "ln {outside}/f.txt hl && echo pwned > hl",
    "proc_self_root": "echo pwned > /proc/self/root{outside}/f.txt",
    "git_commit_main": "git -C {main} " + " ".join(GIT_ID) + " commit -q --allow-empty -m pwned",
    "main_hook": "printf '#!/bin/sh\\necho pwned\\n' > {main}/.git/hooks/pre-commit",
    "main_config": "git config -f {main}/.git/config core.hooksPath /tmp/evil",
    "update_ref_master": "git -C {main} update-ref refs/heads/master {c1}",
    "main_object": "for f in {main}/.git/objects/??/*; do chmod u+w $f; echo pwned > $f; done",
    "delete_main_objects": "rm -rf {main}/.git/objects/??",
    "ledger": "echo pwned > {home}/ledger.sqlite3",
}


def _script(job: Job, name: str) -> str:
    return PROBES[name].format(outside=job.outside, main=job.main, home=job.home, c1=job.c1)


@pytest.mark.parametrize("name", PROBES)
def test_control_escape_works_unconfined(job: Job, name: str) -> None:
    before = job.fingerprint()
    proc = run(job, "control", _script(job, name))
    assert proc.returncode == 0, proc.stderr
    assert job.fingerprint() != before


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", PROBES)
def test_escape_blocked(job: Job, name: str, mode: str) -> None:
    before = job.fingerprint()
    proc = run(job, mode, "echo started && " + _script(job, name))
    assert proc.stdout.startswith("started"), proc.stderr  # the sandbox ran; the probe itself was refused
    assert proc.returncode != 0, f"{name} under {mode} exited 0: {proc.stdout}{proc.stderr}"
    assert job.fingerprint() == before


@pytest.mark.parametrize("mode", MODES)
def test_agent_commits_on_its_branch(job: Job, mode: str) -> None:
    before = job.fingerprint()
    script = "echo work > new.txt && git add new.txt && git " + " ".join(GIT_ID) + " commit -qm agent-work"
    proc = run(job, mode, script)
    assert proc.returncode == 0, proc.stderr
    assert _git("log", "-1", "--format=%s", BRANCH, cwd=job.wt) == "agent-work"
    assert job.fingerprint() == before  # master, HEAD, config, hooks, objects, ledger untouched


@pytest.mark.parametrize("mode", ["control", *MODES])
def test_proctor_home_is_unreadable(job: Job, mode: str) -> None:
    (job.home / "keys").mkdir()
    (job.home / "keys" / "signing.key").write_text("secret\n")
    proc = run(job, mode, f"cat {job.home}/keys/signing.key {job.home}/ledger.sqlite3")
    assert ("secret" in proc.stdout) == (mode == "control"), proc.stdout
    assert ("ledger rows" in proc.stdout) == (mode == "control")


# --- network off -------------------------------------------------------------------------------------------

# Probes run as `sh -c "PY ..."`, where no argv token names the interpreter for the sandbox to expose: a
# system python, which the read-only root shows, keeps them independent of where the checkout lives.
PY = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def _tcp_script(port: int) -> str:
    return f"{PY} -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\""


@pytest.mark.parametrize("mode", ["control", *MODES, NO_NETNS])
def test_tcp_loopback_with_network_off(job: Job, mode: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        proc = run(job, mode, _tcp_script(srv.getsockname()[1]))
    assert (proc.returncode == 0) == (mode == "control"), proc.stderr


def test_tcp_allowed_when_network_on(job: Job) -> None:
    req = replace(job.req, network=True)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        proc = run(job, "landlock", _tcp_script(port), req)
    assert proc.returncode == 0, proc.stderr  # landlock-only shares the host netns: TCP rules lifted


@pytest.mark.parametrize("mode", ["control", *MODES, NO_NETNS])
def test_udp_with_network_off(job: Job, mode: str) -> None:
    confiner = None if mode == "control" else _need(mode)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(1.5)
        port = rx.getsockname()[1]
        argv = [PY, "-c", "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"s.sendto(b'leak', ('127.0.0.1', {port}))"]
        plan = confiner.wrap(argv, job.req) if confiner else None
        subprocess.run(plan.argv if plan else argv, cwd=job.wt, timeout=30, capture_output=True)
        try:
            received = rx.recv(16) == b"leak"
        except TimeoutError:
            received = False
    if plan is None:
        assert received
    elif "netns" in plan.details["network"]:
        assert not received  # the network namespace has its own loopback
    else:
        assert received  # Landlock ABI 7 has no UDP rights: a documented gap, which the plan must report
        assert any(g.startswith("UDP is not blocked") for g in plan.gaps)


def _unix_listener(path: Path) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
    return srv


@pytest.mark.parametrize("mode", ["control", *MODES])
def test_pathname_unix_socket_with_network_off(job: Job, mode: str) -> None:
    hidden, visible = job.base / "h.sock", job.outside / "v.sock"  # base: under the private /tmp; outside: ro
    connect = f"{PY} -c \"import socket,sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])\""
    with _unix_listener(hidden), _unix_listener(visible):
        ok_hidden = run(job, mode, f"{connect} {hidden}").returncode == 0
        ok_visible = run(job, mode, f"{connect} {visible}").returncode == 0
    if mode == "control":
        assert ok_hidden and ok_visible
        return
    plan = _need(mode).wrap(["true"], job.req)
    gap = any(g.startswith("pathname unix sockets") for g in plan.gaps)
    if MODES[mode][0]:
        assert not ok_hidden  # bwrap's private /tmp hides it
    # Wherever a socket stays reachable, the plan says so (Landlock ABI 7 has no RESOLVE_UNIX; ABI 9 has).
    assert gap and (ok_visible or ok_hidden)


# --- the two escapes of a naive bwrap profile (research/sandbox.md 2d) -------------------------------------

def _naive_bwrap(job: Job, *extra: str) -> list[str]:
    if CAPS.bwrap is None:
        pytest.skip(f"no bwrap here: {CAPS.bwrap_reason}")
    return [CAPS.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--ro-bind", str(job.outside), str(job.outside), "--bind", str(job.wt), str(job.wt),
            "--unshare-pid", "--die-with-parent", "--new-session", *extra, "--"]


REMOUNT = "mount -o remount,rw / && mount -o remount,bind,rw {outside} && echo pwned > {outside}/f.txt"
# `remount,rw /` reconfigures the host's own superblock: harmless where / is already rw (this machine),
# never to be run where the host root is read-only. The bind remount changes only the sandbox's mount.
HOST_ROOT_RW = any(line.split()[1] == "/" and "rw" in line.split()[3].split(",")
                   for line in Path("/proc/self/mounts").read_text().splitlines())
# Only the existing value is written back, as the research did: the point is that the write is allowed.
CORE_PATTERN = 'v=$(cat /proc/sys/kernel/core_pattern) && printf "%s\\n" "$v" > /proc/sys/kernel/core_pattern'


@pytest.mark.skipif(os.geteuid() != 0, reason="the escapes are those of bwrap started by real root")
def test_naive_bwrap_control_escapes(job: Job) -> None:
    before = job.fingerprint()
    script = REMOUNT.format(outside=job.outside)
    if not HOST_ROOT_RW:
        script = script.removeprefix("mount -o remount,rw / && ")
    remount = subprocess.run([*_naive_bwrap(job), "sh", "-c", script],
                             capture_output=True, text=True, timeout=30)
    assert remount.returncode == 0, remount.stderr
    assert job.fingerprint() != before  # the write landed on the host
    core = subprocess.run([*_naive_bwrap(job, "--cap-drop", "ALL"), "sh", "-c", CORE_PATTERN],
                          capture_output=True, text=True, timeout=30)
    assert core.returncode == 0, core.stderr  # even with every capability dropped


@pytest.mark.skipif(os.geteuid() != 0, reason="the escapes are those of bwrap started by real root")
@pytest.mark.parametrize("mode", MODES)
def test_remount_and_proc_sys_blocked(job: Job, mode: str) -> None:
    before = job.fingerprint()
    remount = run(job, mode, REMOUNT.format(outside=job.outside))
    assert remount.returncode != 0 and job.fingerprint() == before
    core = run(job, mode, CORE_PATTERN)
    assert core.returncode != 0, "core_pattern was writable"
    assert run(job, mode, "echo 1 > /proc/sys/vm/drop_caches").returncode != 0


# --- roots: what the host must refuse ----------------------------------------------------------------------

def test_refuse_hard_links_finds_planted_link(job: Job) -> None:
    assert refuse_hard_links(job.wt) == []
    os.link(job.outside / "f.txt", job.wt / "planted")
    assert refuse_hard_links(job.wt) == ["planted"]


def test_job_roots_grant_only_the_jobs_own_dirs(job: Job) -> None:
    assert job.req.git_paths == () and set(job.req.writable) == {job.wt, (job.base / "jobtmp").resolve()}
    assert {job.main, job.main / ".git"} <= set(job.req.readonly)
    assert job.req.hidden == (job.home,)


# --- what root would keep without the helper's capability drop ---------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="capabilities matter for an agent started by root")
@pytest.mark.parametrize("mode", ["control", *MODES])
def test_no_capabilities_no_device_nodes(job: Job, mode: str) -> None:
    # A block device node made inside the worktree would reach the raw disk past every path rule.
    mknod = run(job, mode, "mknod blk b 7 0")
    caps = run(job, mode, "grep CapEff /proc/self/status")
    if mode == "control":
        assert mknod.returncode == 0
        return
    assert mknod.returncode != 0 and not (job.wt / "blk").exists()
    assert caps.stdout.split() == ["CapEff:", "0000000000000000"]


@pytest.mark.parametrize("mode", ["control", *MODES])
def test_cannot_signal_host_processes(job: Job, mode: str) -> None:
    proc = run(job, mode, f"kill -0 {os.getpid()}")  # the test runner itself, owned by the same uid
    assert (proc.returncode == 0) == (mode == "control"), proc.stderr


@pytest.mark.parametrize("mode", MODES)
def test_scratch_space_is_private(job: Job, mode: str) -> None:
    marker = f"proctor-confine-{os.getpid()}-{mode.replace('+', '-')}"
    proc = run(job, mode, f'echo x > "$TMPDIR/{marker}" && echo x > /tmp/{marker} && echo x > /dev/shm/{marker}')
    if MODES[mode][0]:
        assert proc.returncode == 0, proc.stderr
        assert (job.req.tmpdir / marker).exists()
        assert not Path(f"/tmp/{marker}").exists() and not Path(f"/dev/shm/{marker}").exists()
    else:
        # Landlock alone shares the host's /tmp: only the job's TMPDIR is writable.
        assert proc.returncode != 0 and (job.req.tmpdir / marker).exists()
        assert not Path(f"/tmp/{marker}").exists()


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    return None


@pytest.mark.skipif(_cgroup2_root() is None, reason="no cgroup2 mount")
@pytest.mark.parametrize("mode", ["control", *MODES])
def test_cannot_leave_the_job_cgroup(job: Job, mode: str) -> None:
    # Moving itself to the root group would put the agent beyond the runner's cgroup.kill.
    proc = run(job, mode, f"echo $$ > {_cgroup2_root()}/cgroup.procs")
    assert (proc.returncode == 0) == (mode == "control"), proc.stderr
