"""Confined command requests: check 5's refusals beside controls that do run confined, and the OS (not the
command's manners) stopping a write outside the entry's write roots. Skipped where nothing can confine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from proctor.services.commands import ProposalError, RequestCode, run_request
from proctor.mechanisms.confine import Unavailable, choose, detect
from test_commands_support import ACT, PY, home, project  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(isinstance(choose("required", detect()), Unavailable),
                                reason="no confinement on this machine")

EXEC = [os.path.dirname(os.path.realpath(PY)), "/usr"]


def policy(tmp: Path, project: Path, *, writes: str = '["out/**"]', confinement: str | None = None) -> Path:
    conf = confinement or f'{{profile = "confined", exec_paths = {json.dumps(EXEC)}}}'
    act = json.dumps(str(project / "tools" / "act.py"))
    path = tmp / "confined.toml"
    path.write_text(f"""
version = 1
[[agents.codex.commands]]
name = "confined"
argv = [{json.dumps(PY)}, {act}, "write", {{type = "tail", max = 2, item = {{type = "path"}}}}]
writes = {writes}
confinement = {conf}
""")
    return path


@pytest.fixture
def confined_project(project: Path) -> Path:
    # Under bwrap /tmp is private, so the helper script lives in the project, which is bound read-only.
    (project / "tools").mkdir()
    (project / "tools" / "act.py").write_text(ACT)
    return project


def req(project: Path, *args: str, writes: list[str]) -> dict:
    return {"kind": "command-request", "agent": "codex", "argv": [PY, str(project / "tools" / "act.py"), *args],
            "cwd": ".", "purpose": "test", "expected_writes": writes}


def test_a_confined_run_writes_its_roots_and_the_os_stops_the_rest(tmp_path, confined_project) -> None:
    p = confined_project
    result = run_request(req(p, "write", "out/e.txt", writes=["out/e.txt"]), project=p,
                         policy=policy(tmp_path, p), confine=True)
    assert result.ok, (result.code, result.exit, result.stderr, result.leftovers_killed)
    assert result.confinement != "none" and (p / "out" / "e.txt").exists()
    assert result.confinement_details and result.confinement_details["network"] != "open"
    # notes.txt is outside the write roots: the kernel refuses it, so nothing undeclared happened.
    result = run_request(req(p, "write", "notes.txt", writes=["out/e.txt"]), project=p,
                         policy=policy(tmp_path, p), confine=True)
    assert result.ran and result.exit != 0
    assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr
    assert (p / "notes.txt").read_text() == "untracked\n" and result.undeclared_writes == []


CASES = {
    "not_configured": (RequestCode.CONFINEMENT_NOT_CONFIGURED, dict(confinement='{profile = "none"}'), {}),
    "outside_exec_paths": (RequestCode.PROGRAM_OUTSIDE_EXEC_PATHS,
                           dict(confinement='{profile = "confined", exec_paths = ["/opt/nowhere"]}'), {}),
    "root_holds_git": (RequestCode.WRITE_ROOT_PROTECTED, dict(writes='["**"]'), {}),
    "root_missing": (RequestCode.CONFINEMENT_UNAVAILABLE, dict(writes='["gen/**"]'), {"mkdir": "gen"}),
    "root_hard_link": (RequestCode.WRITE_ROOT_PROTECTED, {}, {"link": "out/notes-link"}),
    # a write root planted as a link out of the project: the OS would grant the outside folder
    "root_symlink_out": (RequestCode.WRITE_ROOT_PROTECTED, dict(writes='["out/**", "gen/**"]'), {"symlink": "gen"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_confinement_refusals_beside_a_confined_control(name, tmp_path, confined_project) -> None:
    code, bad, fix = CASES[name]
    p = confined_project
    where = "gen/e.txt" if "mkdir" in fix else "out/e.txt"
    request = req(p, "write", where, writes=[where])
    if "link" in fix:  # a hard link in a write root writes through to its other name, outside the roots
        os.link(p / "notes.txt", p / fix["link"])
    if "symlink" in fix:
        (tmp_path / "victim").mkdir()
        (p / fix["symlink"]).symlink_to(tmp_path / "victim")
    with pytest.raises(ProposalError) as info:
        run_request(request, project=p, policy=policy(tmp_path, p, **bad), confine=True)
    assert info.value.code == code, info.value.message
    assert not (p / where).exists()
    if "link" in fix:
        (p / fix["link"]).unlink()
    if "symlink" in fix:
        assert not os.listdir(tmp_path / "victim")
        (p / fix["symlink"]).unlink()
        (p / fix["symlink"]).mkdir()  # the same entry, its root now a folder of the project's
    if "mkdir" in fix:
        (p / fix["mkdir"]).mkdir()
        good = policy(tmp_path, p, writes='["gen/**"]')
    elif "symlink" in fix:
        good = policy(tmp_path, p, **bad)
    else:
        good = policy(tmp_path, p)
    result = run_request(request, project=p, policy=good, confine=True)
    assert result.ok, (result.code, result.exit, result.stderr, result.leftovers_killed)
    assert result.confinement != "none" and (p / where).exists()


def test_a_required_profile_never_runs_unconfined(tmp_path, confined_project) -> None:
    p = confined_project
    conf = f'{{profile = "confined", exec_paths = {json.dumps(EXEC)}, required = true}}'
    pol = policy(tmp_path, p, confinement=conf)
    request = req(p, "write", "out/e.txt", writes=["out/e.txt"])
    with pytest.raises(ProposalError) as info:
        run_request(request, project=p, policy=pol)
    assert info.value.code == RequestCode.CONFINEMENT_REQUIRED and not (p / "out" / "e.txt").exists()
    result = run_request(request, project=p, policy=pol, confine=True)
    assert result.ok, (result.code, result.exit, result.stderr, result.leftovers_killed)
