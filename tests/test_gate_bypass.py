"""A CLI whose hooks never ran cannot pass as gated: a tool call in its own output stream before its
session-start hook armed the gate ends the run (BYPASS, killed), and one the gate never decided ends the job
BYPASS too; the control runs both hooks and completes. A stand-in CLI speaking claude's stream-json and
hook protocol (the real one is in test_gate_claude.py)."""

from __future__ import annotations

import json
import sys

import pytest

from proctor.mechanisms.config.load import load_config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent

# Runs the hooks from the --settings file it was given (as claude does), when told to, around one tool call.
CLI = r'''
import json, subprocess, sys, time
args = sys.argv[1:]
settings = json.load(open(args[args.index("--settings") + 1]))["hooks"]
mode = next(a for a in args if a in ("both", "no-session", "no-pretool"))
def hook(event, payload):
    cmd = settings[event][0]["hooks"][0]["command"]
    return subprocess.run(cmd, shell=True, input=json.dumps(payload).encode(), capture_output=True)
if mode != "no-session":
    hook("SessionStart", {"hook_event_name": "SessionStart"})
call = {"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {"file_path": "a.txt", "content": "x"}}
print(json.dumps({"type": "assistant", "message": {"content": [call]}}), flush=True)
time.sleep(0.5)
if mode == "both":
    out = hook("PreToolUse", {"hook_event_name": "PreToolUse", "tool_name": "Write", "tool_use_id": "toolu_1",
                              "tool_input": call["input"]})
    if json.loads(out.stdout)["hookSpecificOutput"]["permissionDecision"] == "allow":
        open("a.txt", "w").write("x")
print(json.dumps({"type": "result", "is_error": False, "result": "done"}), flush=True)
'''


@pytest.fixture
def config(tmp_path):
    script = tmp_path / "fakeclaude.py"
    script.write_text(CLI)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'confine = "off"\n[agents.fc]\ncommand = [{json.dumps(sys.executable)}, "{script}", '
                   '"{prompt}"]\noutput = "claude-stream-json"\ngate = "claude"\n'
                   'gate_args = ["--settings", "{gate_settings}"]\n')
    return load_config(cfg)


def job(repo, config, mode: str):
    return run_agent(RunAgentRequest(agent="fc", task=mode, repo=str(repo), ticket="T", validateCommand="true"),
                     config=config)


def test_control_both_hooks_ran_and_the_call_was_decided(repo, config):
    res = job(repo, config, "both")
    assert res.status is Status.completed and res.changed_files == ["a.txt"], res
    assert res.gate["armed"] is True and res.gate["calls"] == 1 and res.gate["refused"] == 0


def test_a_tool_call_before_the_gate_was_armed_kills_the_run(repo, config):
    res = job(repo, config, "no-session")
    assert res.status is Status.failed and res.code is Code.BYPASS and res.attempts == 1, res
    assert res.gate["armed"] is False and res.needs_human_review
    assert any("before the gate's hook was armed" in r for r in res.known_risks), res.known_risks


def test_a_tool_call_the_gate_never_decided_is_a_bypass(repo, config):
    res = job(repo, config, "no-pretool")
    assert res.status is Status.failed and res.code is Code.BYPASS, res
    assert any("never decided" in r and "Write (toolu_1)" in r for r in res.known_risks), res.known_risks
