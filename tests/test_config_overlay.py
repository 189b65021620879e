"""A user table named like a built-in overlays it key by key: a user adds an environment variable, a base
URL or a model to a built-in without copying its command (it was refused: `command: Field required`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proctor.mechanisms.config.load import ConfigError, builtin_agents, load_config
from proctor.contract import RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))
OVERLAY = 'confine = "off"\n[agents.claude]\nenv = { ANTHROPIC_BASE_URL = "http://127.0.0.1:9" }\n'


def test_env_only_table_overlays_the_builtin_and_reaches_the_agent(tmp_path, repo, fake):
    cfg = tmp_path / "c.toml"
    cfg.write_text(OVERLAY)
    config = load_config(cfg)
    spec, builtin = config.adapter("claude"), builtin_agents()["claude"]
    assert spec.command == builtin.command and spec.output == builtin.output
    assert spec.env == {**builtin.env, "ANTHROPIC_BASE_URL": "http://127.0.0.1:9"}
    assert config.overlays["claude"] == ("env.ANTHROPIC_BASE_URL",)
    agent = fake("claude", Behaviour(writes={"a.txt": "1"},
                                     record_env=["ANTHROPIC_BASE_URL", "CLAUDE_CONFIG_DIR", "HOME"]))
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T", validateCommand="true"),
                    config=config)
    assert res.status is Status.completed, res
    env = agent.calls()[-1]["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    assert env["CLAUDE_CONFIG_DIR"] == env["HOME"] + "/.claude"  # the built-in's own, `~` made the agent's HOME


def test_control_a_new_name_with_only_env_is_still_refused_clearly(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[agents.mine]\nenv = { A = "1" }\n')
    with pytest.raises(ConfigError, match=r"agents\.mine\.command: missing"):
        load_config(cfg)


def test_adapters_show_names_the_overlaid_keys(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(OVERLAY + 'output = "claude-json"\n')
    p = subprocess.run([PROCTOR, "adapters", "show", "claude", "--config", str(cfg)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    shown = json.loads(p.stdout)
    assert shown["overlaid"] == ["env.ANTHROPIC_BASE_URL", "output"] and shown["output"] == "claude-json"
    assert "built-in with env.ANTHROPIC_BASE_URL, output" in p.stderr
    listed = json.loads(subprocess.run([PROCTOR, "adapters", "list", "--config", str(cfg)], capture_output=True,
                                       text=True, check=True).stdout)
    assert {a["name"]: a["overlaid"] for a in listed}["codex"] == []
