"""A newcomer's paper cuts (issue 43), each beside its control: a flag typo is an invalid request like any
other (a failed result JSON naming it, exit 1); a declared agent whose program lives in a folder holding more
than an install is warned about (the whole folder is readable to the job); per-repo tables naming a path that
no longer exists say so when the repo has none; a job's closing lines say what to do next."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from proctor import RunAgentRequest, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.surfaces.cli.main import main
from tests.conftest import make_repo


def test_a_flag_typo_is_a_failed_result_json_naming_it(tmp_path):
    repo = make_repo(tmp_path)
    got = CliRunner().invoke(main, ["run-agent", "--agnet", "patch", "--task", "t", "--repo", str(repo),
                                    "--ticket", "T"])
    out = json.loads(got.stdout)
    assert got.exit_code == 1 and out["code"] == "INVALID_REQUEST", got.output
    assert "--agnet" in out["known_risks"][0] and "Did you mean '--agent'" in out["known_risks"][0]
    missing = CliRunner().invoke(main, ["run-agent", "--agent"])
    assert missing.exit_code == 1 and "requires an argument" in json.loads(missing.stdout)["summary"]
    helped = CliRunner().invoke(main, ["run-agent", "--help"])  # the control: help is help, not a refusal
    assert helped.exit_code == 0 and "--continue" in helped.stdout


def _declared(tmp_path: Path, monkeypatch, program: Path, extra: str = "") -> tuple:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    program.parent.mkdir(parents=True, exist_ok=True)
    tmp_path.mkdir(parents=True, exist_ok=True)
    program.write_text("#!/bin/sh\ncat >/dev/null\necho hi > out.txt\n")
    program.chmod(0o755)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'{extra}[agents.mine]\ncommand = ["{program}"]\nprompt = "stdin"\nnetwork = false\n')
    repo = make_repo(tmp_path / "r")
    return repo, load_config(cfg)


def test_a_declared_agent_kept_in_a_folder_with_more_than_an_install_is_warned_about(tmp_path, monkeypatch):
    home = tmp_path / "home"
    work = home / "work"
    (work / "notes").mkdir(parents=True)
    (work / "secrets.txt").write_text("x")
    repo, config = _declared(tmp_path, monkeypatch, work / "bin" / "agent.sh")
    res = run_agent(RunAgentRequest(agent="mine", task="t", repo=str(repo), ticket="T"), config=config)
    assert any(str(work) in w and "notes, secrets.txt" in w for w in res.warnings), (res.warnings, res.known_risks)
    assert not any(str(work) in r for r in res.known_risks)  # a warning, not a risk on the verdict
    # The control: a folder of its own (bin/ alone) is not warned about.
    tidy = tmp_path / "two" / "home" / "tools" / "mine" / "bin" / "agent.sh"
    repo2, config2 = _declared(tmp_path / "two", monkeypatch, tidy)
    res2 = run_agent(RunAgentRequest(agent="mine", task="t", repo=str(repo2), ticket="T"), config=config2)
    assert res2.attempts == 1 and not res2.warnings, res2.warnings


def test_per_repo_tables_of_a_moved_repo_say_so(tmp_path, monkeypatch):
    gone = tmp_path / "old-place" / "repo"
    program = tmp_path / "tools" / "bin" / "agent.sh"
    extra = f'[repos."{gone}"]\nvalidate = "true"\n'
    repo, config = _declared(tmp_path, monkeypatch, program, extra)
    res = run_agent(RunAgentRequest(agent="mine", task="t", repo=str(repo), ticket="T"), config=config)
    assert any(f'[repos."{gone}"]' in w and "re-key" in w for w in res.warnings), res.warnings
    # The control: the same config with the table keyed to this repo says nothing of the kind.
    (tmp_path / "cfg.toml").write_text((tmp_path / "cfg.toml").read_text().replace(str(gone), str(repo)))
    res2 = run_agent(RunAgentRequest(agent="mine", task="t", repo=str(repo), ticket="T2"),
                     config=load_config(tmp_path / "cfg.toml"))
    assert not res2.warnings, res2.warnings
