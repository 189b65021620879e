"""Issue 21 items 3-5 and the review checkout's root mode: no host file operation on a path an agent or a
repo controls follows a symlink; every dir proctor keeps state in is the user's; landing never destroys a
file the person has. Each attack beside its control (the same operation on honest input works)."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_repo, sh
from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import beneath
from proctor.contract import Code
from proctor.services.job import record
from proctor.mechanisms.git import worktree
from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = Path(sys.executable).with_name("proctor")
CI = os.environ.get("CI") == "true"


# -- the mechanism ---------------------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "real" / "f").write_text("honest\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("SECRET\n")
    (root / "link").symlink_to(outside)  # a directory turned into a symlink
    (root / "abs").symlink_to("/etc")
    (root / "real" / "last").symlink_to(outside / "secret")
    return root, outside


@pytest.mark.parametrize("opener", [beneath.open_beneath, beneath.walk_open], ids=["openat2", "walk"])
def test_no_symlink_is_followed_at_any_component(tree, opener):
    root, _ = tree
    fd = beneath.open_root(root)
    try:
        data = os.read(opener(fd, "real/f", os.O_RDONLY), 100)  # control: a real file opens
        assert data == b"honest\n"
        for rel, code in (("link/secret", errno.ELOOP), ("abs/passwd", errno.ELOOP), ("real/last", errno.ELOOP),
                          ("../outside/secret", errno.EXDEV), ("/etc/passwd", errno.EXDEV)):
            with pytest.raises(OSError) as got:
                opener(fd, rel, os.O_RDONLY)
            assert got.value.errno == code, rel
    finally:
        os.close(fd)
    if opener is beneath.open_beneath:
        assert beneath._has_openat2() or os.uname().release < "5.6", "openat2 should be there on this kernel"


def test_create_and_remove_beneath_never_cross_a_link(tree):
    root, outside = tree
    fd = beneath.open_root(root)
    try:
        with pytest.raises(OSError) as got:
            beneath.create_excl(fd, "link/.env", b"secret")
        assert got.value.errno == errno.ELOOP and not (outside / ".env").exists()
        beneath.create_excl(fd, "new/dir/.env", b"secret")  # control: parents made, file written
        assert (root / "new/dir/.env").read_bytes() == b"secret"
        with pytest.raises(FileExistsError):
            beneath.create_excl(fd, "new/dir/.env", b"again")
        (root / "real" / "locked").mkdir()
        (root / "real" / "locked" / "x").write_text("x")
        (root / "real" / "locked" / "out").symlink_to(outside)
        os.chmod(root / "real" / "locked", 0)
        beneath.rmtree(fd, "real")
        beneath.rmtree(fd, "link")
        assert not (root / "real").exists() and not os.path.lexists(root / "link")
        assert (outside / "secret").read_text() == "SECRET\n", "rmtree followed a link out of its root"
    finally:
        os.close(fd)
    # worktree.remove_tree on a path that is itself a link removes the link, never its target.
    (root / "l2").symlink_to(outside)
    assert worktree.remove_tree(root / "l2") and (outside / "secret").exists()


# -- copy: both reproductions, each beside its control -----------------------------------------------------

def _config(tmp_path: Path, repo: Path, script: str, copy: list[str]):
    p = tmp_path / "config.toml"
    p.write_text('confine = "off"\n[agents.sh]\ncommand = ["/bin/sh", "-c", ' + json.dumps(script) + ']\n'
                 'prompt = "stdin"\nnetwork = false\n'
                 f'[repos."{repo}"]\ncopy = {json.dumps(copy)}\n')
    return load_config(p)


def _job(repo: Path, tmp_path: Path, script: str, copy: list[str], validate: str):
    req = RunAgentRequest(agent="sh", task="t", repo=str(repo), ticket="T", validateCommand=validate)
    return run_agent(req, config=_config(tmp_path, repo, script, copy))


@pytest.mark.parametrize("hostile", [True, False], ids=["agent-made-symlink", "control"])
def test_copy_never_writes_through_a_directory_the_agent_made_a_link(tmp_path, hostile):
    """(a) The agent turns the tracked dir `conf` into a link to a host dir it cannot write; `copy` of the
    main checkout's untracked `conf/.env` must not be written through it."""
    repo = make_repo(tmp_path, {"conf/app.toml": "x = 1\n"})
    (repo / "conf" / ".env").write_text("API_KEY=secret\n")  # untracked in the main checkout
    host_dir = tmp_path / "host-only"
    host_dir.mkdir()
    script = f"rm -rf conf && ln -s {host_dir} conf" if hostile else "echo fix > fix.txt"
    res = _job(repo, tmp_path, script, ["conf/.env"], "cat conf/.env")
    assert not (host_dir / ".env").exists(), "the host wrote the secret through the agent's link"
    if hostile:
        assert any("conf/.env" in r and "symlink" in r for r in res.known_risks), res.known_risks
        assert "API_KEY" not in json.dumps(res.validation)
    else:
        assert res.status is Status.completed, res.known_risks
        assert "API_KEY=secret" in json.dumps(res.validation), "control: the copy was made"


@pytest.mark.parametrize("hostile", [True, False], ids=["committed-link-to-home", "control"])
def test_copy_never_reads_through_a_committed_link(tmp_path, proctor_home, hostile):
    """(b) A committed `ph -> $PROCTOR_HOME` in the base; the agent removes it from its tree so the copy's
    target is free; `copy = ["ph/keys/host.key"]` must not read the listener's key through the link."""
    keys = proctor_home / "keys"
    keys.mkdir(exist_ok=True)
    (keys / "host.key").write_text("PRIVATE-KEY\n")
    repo = make_repo(tmp_path, {"README.md": "x\n"})
    if hostile:
        (repo / "ph").symlink_to(proctor_home)
        sh("git", "add", "ph", cwd=repo)
        sh("git", "commit", "-qm", "link", cwd=repo)
    else:
        (repo / "ph" / "keys").mkdir(parents=True)  # an honest untracked file at the same path
        (repo / "ph" / "keys" / "host.key").write_text("HONEST-FILE\n")
    res = _job(repo, tmp_path, "rm -f ph; echo fix > fix.txt", ["ph/keys/host.key"], "cat ph/keys/host.key")
    assert "PRIVATE-KEY" not in json.dumps(res.model_dump(mode="json")), "the listener's key reached the result"
    if hostile:
        assert any("ph/keys/host.key" in r and "symlink" in r for r in res.known_risks), res.known_risks
    else:
        assert res.status is Status.completed and "HONEST-FILE" in json.dumps(res.validation), res.known_risks


# -- the review checkout's root mode -------------------------------------------------------------------------

def test_review_checkout_root_mode_is_normalised(tmp_path):
    repo = make_repo(tmp_path, {"d/f": "x\n"})
    res = _job(repo, tmp_path, "chmod 0777 . d && echo y > g", [], "true")
    assert res.status is Status.completed, res.known_risks
    wt = Path(res.worktree_path)
    assert stat.S_IMODE(wt.stat().st_mode) == 0o755, oct(wt.stat().st_mode)
    assert stat.S_IMODE((wt / "d").stat().st_mode) == 0o755  # control: the entry below, as before


# -- directories: checked, and a second local user cannot plant one ----------------------------------------------

@pytest.fixture
def shared_dir():
    """A world-writable sticky dir every local user reaches (tmp_path's parents are root's 0700)."""
    d = Path(f"/tmp/proctor-shared-{secrets.token_hex(4)}")
    d.mkdir()
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# useradd/userdel lock /etc/passwd and fail at once on a held lock: one worker for them under xdist.
@pytest.mark.xdist_group("useradd")
@pytest.mark.parametrize("planted", [True, False], ids=["another-users-agents-dir", "control"])
def test_a_pre_created_agents_dir_of_another_user_is_refused_before_anything_runs(shared_dir, other_user, fake,
                                                                                    planted):
    repo = make_repo(shared_dir)
    agents = shared_dir / "repo-agents"
    if planted:
        subprocess.run(["mkdir", "-m", "0755", str(agents)], user=other_user.pw_name, check=True)
        assert agents.stat().st_uid != os.geteuid()
    claude = fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T", validateCommand="true"))
    if planted:
        assert res.code is Code.UNSAFE_DIRECTORY and res.status is Status.failed, res
        assert str(agents) in res.known_risks[0] and "uid" in res.known_risks[0]
        assert claude.calls() == [] and os.listdir(agents) == [], "something ran or was made in her dir"
    else:
        assert res.status is Status.completed, res.known_risks
        st = agents.stat()
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_worktree_create_refuses_a_writable_agents_dir_and_a_trapped_parent(tmp_path):
    repo = worktree.open_repo(make_repo(tmp_path))
    base = worktree.default_base(repo)
    agents = worktree.agents_dir(repo)
    agents.mkdir(mode=0o777)
    agents.chmod(0o777)
    got = worktree.create(repo, "J1", "T", base)
    assert isinstance(got, worktree.Failure) and got.code == "UNSAFE_DIRECTORY" and str(agents) in got.reason
    assert os.listdir(agents) == []
    agents.chmod(0o700)
    assert isinstance(worktree.create(repo, "J1", "T", base), worktree.Worktree)  # control
    # A TMPDIR under a world-writable dir without the sticky bit: anyone may rename it away.
    trap = tmp_path / "trap"
    trap.mkdir()
    trap.chmod(0o777)
    mine = trap / "proctor-x"
    mine.mkdir(mode=0o700)
    got = worktree.unsafe_dirs(repo, (mine,))
    assert got is not None and str(trap) in got and "sticky" in got
    trap.chmod(0o1777)
    assert worktree.unsafe_dirs(repo, (mine,)) is None  # control: /tmp's shape


def test_a_group_writable_state_dir_refuses_the_job(proctor_home, repo, fake):
    claude = fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    proctor_home.chmod(0o770)
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T", validateCommand="true"))
    assert res.code is Code.UNSAFE_DIRECTORY and str(proctor_home) in res.known_risks[0], res
    assert claude.calls() == [] and not (repo.parent / "repo-agents").exists()
    assert not (proctor_home / "jobs" / res.job_id / "result.json").exists()
    proctor_home.chmod(0o700)
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T", validateCommand="true"))
    assert res.status is Status.completed, res.known_risks  # control
    st = (proctor_home / "jobs" / res.job_id).stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and record.unsafe_dirs(res.job_id) is None


# -- land -------------------------------------------------------------------------------------------------------

def cli(*args: str, check: int | None = 0) -> dict:
    p = subprocess.run([str(PROCTOR), *args, "--json"], capture_output=True, timeout=120, env=os.environ.copy())
    assert b"Traceback" not in p.stderr, p.stderr.decode()
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout.decode()[-2000:], p.stderr.decode()[-2000:])
    return json.loads(p.stdout)


def run_job(repo: Path, ticket: str) -> dict:
    p = subprocess.run([str(PROCTOR), "run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo),
                        "--ticket", ticket, "--validate-cmd", "true"], capture_output=True, timeout=120)
    return json.loads(p.stdout)


@pytest.mark.parametrize("hostile", [True, False], ids=["agent-claims-the-ignored-env", "control"])
def test_land_never_replaces_the_persons_ignored_file(fake, tmp_path, hostile):
    repo = make_repo(tmp_path, {".gitignore": ".env\n", "a.txt": "a\n"})
    (repo / ".env").write_text("MY_SECRET=1\n")  # the developer's: untracked and ignored
    writes = {".gitignore": "", ".env": "AGENT=1\n"} if hostile else {"a.txt": "b\n"}
    fake("claude", Behaviour(writes=writes))
    res = run_job(repo, "T")
    assert res["status"] == "completed", res
    before = sh("git", "rev-parse", "master", cwd=repo)
    # An `.env` crosses the trust line (it is read as the environment): land asks for the flag first; with it,
    # the person's own file still stands.
    if hostile:
        asked = cli("land", res["jobId"], check=1)
        assert asked["code"] == "TRUST_LINE" and ".env" in asked["reason"], asked
    out = cli("land", res["jobId"], *(["--allow-trust-line"] if hostile else []), check=1 if hostile else 0)
    assert (repo / ".env").read_text() == "MY_SECRET=1\n", "land replaced the person's ignored file"
    if hostile:
        assert out["code"] == "CHECKOUT_WOULD_LOSE" and ".env" in out["reason"] and out["would_lose"] == [".env"]
        assert sh("git", "rev-parse", "master", cwd=repo) == before, "the ref moved"
    else:
        assert out["ok"] and (repo / "a.txt").read_text() == "b\n"


def test_land_refuses_an_untracked_file_in_the_way_of_a_new_directory(fake, tmp_path):
    repo = make_repo(tmp_path, {"a.txt": "a\n"})
    (repo / "docs").write_text("my notes\n")  # untracked file where the job makes a directory
    fake("claude", Behaviour(writes={"docs/index.md": "x\n"}))
    res = run_job(repo, "T")
    out = cli("land", res["jobId"], check=1)
    assert out["code"] == "CHECKOUT_WOULD_LOSE" and out["would_lose"] == ["docs"]
    assert (repo / "docs").read_text() == "my notes\n"


@pytest.mark.parametrize("already", [True, False], ids=["target-holds-it", "control"])
def test_land_of_a_change_the_target_holds_makes_no_empty_merge(fake, tmp_path, already):
    repo = make_repo(tmp_path, {"a.txt": "a\n", "b.txt": "b\n"})
    fake("claude", Behaviour(writes={"a.txt": "fixed\n"}))
    res = run_job(repo, "T")
    assert res["status"] == "completed", res
    (repo / ("a.txt" if already else "b.txt")).write_text("fixed\n")  # the same edit made on master
    sh("git", "commit", "-qam", "meanwhile", cwd=repo)
    before = sh("git", "rev-parse", "master", cwd=repo)
    out = cli("land", res["jobId"], check=1 if already else 0)
    if already:
        assert out["code"] == "NOTHING_TO_LAND", out
        assert sh("git", "rev-parse", "master", cwd=repo) == before
    else:
        assert out["ok"] and out["how"] == "merge"
