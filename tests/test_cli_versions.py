"""The compatibility matrix on a job: a built-in lists the CLI versions proctor's suite passed with
(`tested`); a CLI whose --version is another is a risk on the job naming the tested ones, and under
`cli_versions = "strict"` the job is refused (AGENT_UNTESTED) before the agent launches. A stand-in CLI that
answers --version as told and records each real launch; the control launches."""

from __future__ import annotations

import sys

import pytest

from proctor.contract import Code, RunAgentRequest, Status
from proctor.mechanisms.adapters.versions import untested, version_of
from proctor.mechanisms.config.load import builtin_agents, load_config
from proctor.services.job.run_agent import run_agent

CLI = r'''
import sys
if sys.argv[1:] == ["--version"]:
    print(sys.argv[0].rsplit("-", 1)[-1].removesuffix(".py") + " (Stand-in CLI)")
    sys.exit(0)
open(sys.argv[1], "a").write("launched\n")
'''


@pytest.mark.parametrize("said, want", [("2.1.332 (Claude Code)", "2.1.332"), ("codex-cli 0.171.0", "0.171.0"),
                                        ("v1.18.33", "1.18.33"), ("1.0.0-beta.2", "1.0.0-beta.2"),
                                        ("version 12", None), ("", None), (None, None), ("10.1.2.3", None)])
def test_the_version_in_a_clis_answer(said, want):
    assert version_of(said) == want


def test_untested_says_which_versions_were_tested():
    assert untested("claude", ("2.1.197", "2.1.332"), "2.1.332 (Claude Code)") is None
    why = untested("claude", ("2.1.197", "2.1.332"), "2.1.400 (Claude Code)")
    assert why and "claude 2.1.400" in why and "2.1.197, 2.1.332" in why
    assert "could not be read" in (untested("claude", ("2.1.332",), None) or "")
    assert untested("mine", (), "0.0.1") is None  # a user's adapter lists none: nothing to compare


def test_every_built_in_with_a_version_probe_lists_tested_versions():
    for name, spec in builtin_agents().items():
        assert spec.version_args is None or spec.tested, name


def _config(tmp_path, version: str, strict: bool):
    script = tmp_path / f"cli-{version}.py"  # the probe runs the command's program: the script itself
    script.write_text(f"#!{sys.executable}\n{CLI}")
    script.chmod(0o755)
    record = tmp_path / "launches"
    cfg = tmp_path / "c.toml"
    cfg.write_text(('cli_versions = "strict"\n' if strict else "") + 'confine = "off"\n[agents.fake]\n'
                   f'command = ["{script}", "{record}"]\nprompt = "stdin"\n'
                   f'version_args = ["--version"]\ntested = ["1.0.0"]\nnetwork = false\n')
    return load_config(cfg), record


def _run(repo, config):
    return run_agent(RunAgentRequest(agent="fake", task="t", repo=str(repo), ticket="T", validateCommand="true"),
                     config=config)


def test_an_untested_version_is_a_risk_and_the_job_runs(repo, tmp_path):
    config, record = _config(tmp_path, "9.9.9", strict=False)
    res = _run(repo, config)
    assert res.agent_version == "9.9.9 (Stand-in CLI)" and record.read_text() == "launched\n", res
    assert any("fake 9.9.9 is not a version proctor was tested with (1.0.0)" in k for k in res.known_risks)
    assert res.needs_human_review


def test_strict_refuses_an_untested_version_before_the_agent_launches(repo, tmp_path):
    config, record = _config(tmp_path, "9.9.9", strict=True)
    res = _run(repo, config)
    assert res.status is Status.failed and res.code is Code.AGENT_UNTESTED, res
    assert "9.9.9" in res.summary and "1.0.0" in res.summary
    assert not record.exists() and res.exit_codes == []


def test_control_strict_launches_a_tested_version(repo, tmp_path):
    config, record = _config(tmp_path, "1.0.0", strict=True)
    res = _run(repo, config)
    assert record.exists() and record.read_text() == "launched\n" and res.code is not Code.AGENT_UNTESTED, res
    assert not any("tested with" in k for k in res.known_risks), res.known_risks
