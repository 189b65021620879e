"""Every tool call of the real Claude Code passes proctor's gate before it runs, fail-closed: run-agent
jobs of the built-in `claude` adapter, confined, against the scripted model. A call the declaration allows
runs (the control); one it refuses never executes, and the refusal and its reason are in the ledger and in
the model's next request; a repo's `disableAllHooks` cannot switch the gate off; a hook that cannot reach
its gate denies."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from modelserver import SubagentScriptedModel, WorkflowScriptedModel
from test_real_cli_jobs import ACTION, run_job

from proctor.mechanisms.gatekeeper.hook import HOOK_CLIENT


def gate_rows(job) -> list[dict]:
    with sqlite3.connect(job.proctor_home / "ledger.sqlite3") as db:
        rows = db.execute("SELECT kind, payload FROM rows WHERE kind LIKE 'gate.%' AND job_id = ?",
                          (job.result["jobId"],)).fetchall()
    return [{"kind": k, **json.loads(p)} for k, p in rows]


def declaration(tmp_path: Path, tools: list[dict]) -> str:
    path = tmp_path / "decl.json"
    path.write_text(json.dumps({"goal": "write hello.txt", "tools": tools,
                                "permissions": {"workspace": "/ignored", "read_files": True, "write_files": True}}))
    return str(path)


@pytest.mark.realcli
def test_control_an_allowed_call_is_decided_then_runs(tmp_path):
    job = run_job("claude", tmp_path)
    r = job.result
    assert r["status"] == "completed" and r["changed_files"] == [ACTION.name], job.explain()
    assert r["gate"] == {**r["gate"], "gated": True, "armed": True, "refused": 0}, r["gate"]
    rows = gate_rows(job)
    assert rows[0]["kind"] == "gate.armed"
    calls = [x for x in rows if x["kind"] == "gate.call"]
    assert [(c["tool"], c["verdict"], c["code"]) for c in calls] == [("Write", "run", "OK")], calls
    assert len(calls[0]["input_sha256"]) == 64 and calls[0]["latency_ms"] >= 0


@pytest.mark.realcli
def test_a_call_the_declaration_refuses_never_runs_and_the_model_hears_why(tmp_path):
    decl = declaration(tmp_path, [{"name": "Read", "effect": "read"}])  # no Write: undeclared
    job = run_job("claude", tmp_path, extra=("--task-decl", decl))
    r = job.result
    assert ACTION.name not in r["changed_files"], job.explain()
    assert not (Path(r["worktreePath"]) / ACTION.name).exists()
    assert r["gate"]["refused"] >= 1 and r["gate"]["by_code"].get("TOOL_UNDECLARED"), r["gate"]
    assert any("the gate refused" in k for k in r["known_risks"]) and r["needs_human_review"] is True
    calls = [x for x in gate_rows(job) if x["kind"] == "gate.call"]
    assert calls and calls[0]["tool"] == "Write" and calls[0]["verdict"] == "refused"
    assert calls[0]["code"] == "TOOL_UNDECLARED"
    results = [e.tool_result for e in job.model.requests if e.tool_result]
    assert any("[proctor TOOL_UNDECLARED]" in t for t in results), job.model.summary()


@pytest.mark.realcli
def test_a_repos_disable_all_hooks_does_not_switch_the_gate_off(tmp_path):
    """research/gating.md: a workspace `.claude/settings.json` with disableAllHooks silently disabled the
    --settings hooks; `--setting-sources ''` keeps the repo's settings out, so the call is still decided."""
    job = run_job("claude", tmp_path, files={".claude/settings.json": json.dumps({"disableAllHooks": True})})
    r = job.result
    assert r["gate"]["armed"] is True and r["gate"]["calls"] >= 1, job.explain()
    assert [x["tool"] for x in gate_rows(job) if x["kind"] == "gate.call"] == ["Write"]


def test_the_hook_client_denies_when_its_gate_is_unreachable(tmp_path):
    """Every CLI's hook layer fails open on a crashed hook; proctor's client never crashes into an allow:
    a gone socket is exit 2 with [proctor GATE_UNAVAILABLE] (claude and gemini block on exit 2)."""
    p = subprocess.run([sys.executable, "-I", "-S", str(HOOK_CLIENT), str(tmp_path / "gone.sock"), "claude",
                        "PreToolUse"], input=b'{"tool_name": "Bash"}', capture_output=True, timeout=30)
    assert p.returncode == 2 and b"[proctor GATE_UNAVAILABLE]" in p.stderr and p.stdout == b""
    garbage = subprocess.run([sys.executable, "-I", "-S", str(HOOK_CLIENT)], input=b"x", capture_output=True)
    assert garbage.returncode == 2 and b"GATE_UNAVAILABLE" in garbage.stderr


def drive_claude(tmp_path: Path, hook: str, install: list[str] | None) -> tuple[Path, list[str]]:
    """The real claude, one PreToolUse hook running `hook`, against the scripted model: the work dir and the
    tool results the model was sent. `install`: the job's gate args (None: acceptEdits, no gate)."""
    import os
    import shutil

    from modelserver import ScriptedModel
    from test_real_cli_jobs import BIN, CLIS, KEY, TASK, need

    from proctor.mechanisms.config.load import builtin_agents

    need(CLIS["claude"])
    spec = builtin_agents()["claude"]
    work = tmp_path / "work"
    work.mkdir()
    settings = tmp_path / "claude-settings.json"
    entry = {"matcher": "*", "hooks": [{"type": "command", "command": hook, "timeout": 2}]}
    settings.write_text(json.dumps({"hooks": {"PreToolUse": [entry]}}))
    args = ([a.replace("{gate_settings}", str(settings)) for a in spec.gate_args] if install is not None
            else ["--settings", str(settings), "--permission-mode", "acceptEdits"])
    home = tmp_path / "home"
    home.mkdir()
    with ScriptedModel(tmp_path / "model", ACTION) as model:
        shutil.copy(model.ca_file, home / "ca.pem")
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_API_KEY": KEY,
               "ANTHROPIC_BASE_URL": model.url, "NODE_EXTRA_CA_CERTS": str(home / "ca.pem"),
               "CLAUDE_CODE_MAX_RETRIES": "0", **spec.env_under(str(home))}
        subprocess.run([str(BIN / "claude"), *args, "-p", "--output-format", "stream-json", "--verbose", "--",
                        TASK], cwd=work, env=env, capture_output=True, timeout=120)
        return work, [e.tool_result for e in model.requests if e.tool_result]


@pytest.mark.realcli
@pytest.mark.parametrize("hook", ["exit 1", "sleep 30", "echo not-json", "/nonexistent/hook"])
def test_claudes_fail_open_hook_paths_are_denies_under_the_jobs_install_args(tmp_path, hook):
    """research/gating.md: every claude hook failure is non-blocking (crash, timeout, garbage, a hook that
    cannot start) and the tool runs; under the install args a job uses (`dontAsk`, `--setting-sources ''`)
    the same failures leave the tool not run."""
    work, results = drive_claude(tmp_path, hook, install=[])
    assert not (work / ACTION.name).exists(), hook
    assert results and not any("File created successfully" in r for r in results), results


@pytest.mark.realcli
def test_control_the_same_crashing_hook_under_accept_edits_lets_the_tool_run(tmp_path):
    work, results = drive_claude(tmp_path, "exit 1", install=None)
    assert (work / ACTION.name).exists() and any("File created successfully" in r for r in results), results


# -- sub-agents and the tools a newer claude has -------------------------------------------------------------

def _shell_declaration(tmp_path: Path) -> str:
    """Agent, Workflow and Write declared, with `shell` allowed (Workflow is `shell`), Bash not declared."""
    path = tmp_path / "decl.json"
    path.write_text(json.dumps({"goal": "write hello.txt", "tools": [
        {"name": "Agent", "effect": "none"}, {"name": "Workflow", "effect": "shell"}, {"name": "Write", "effect": "write"}],
        "permissions": {"workspace": "/ignored", "read_files": True, "write_files": True, "shell": True}}))
    return str(path)


@pytest.mark.realcli
@pytest.mark.parametrize("model_type", [SubagentScriptedModel, WorkflowScriptedModel], ids=["Agent", "Workflow"])
def test_a_sub_agents_calls_are_decided_and_counted_not_called_forged(tmp_path, model_type):
    """The main agent starts a sub-agent (by Agent, or by a Workflow script), whose own Bash (undeclared:
    refused) and Write (granted) pass the hook. claude's stream shows an Agent's calls and never a
    Workflow's; the sub-agents' transcripts show both, so every call is a decision like any other: counted,
    none forged, no bypass, and the granted Write is the change."""
    job = run_job("claude", tmp_path, extra=("--task-decl", _shell_declaration(tmp_path)), model_type=model_type)
    r, why = job.result, job.explain()
    subs = set(job.model.sub_calls)
    calls = [(c["tool"], c["verdict"], c["code"]) for c in gate_rows(job) if c["kind"] == "gate.call"]
    assert calls == [(model_type.via, "run", "OK"), ("Bash", "refused", "TOOL_UNDECLARED"), ("Write", "run", "OK")], why
    assert len(subs) == 2 and {c["call_id"] for c in gate_rows(job) if c["kind"] == "gate.call"} >= subs
    assert r["gate"]["forged"] == 0 and r["gate"]["calls"] == 3 and r["gate"]["refused"] == 1, r["gate"]
    assert r["code"] == "OK" and r["changed_files"] == [ACTION.name], why
    assert not (Path(r["worktreePath"]) / "bash.txt").exists()
    assert not any("forged" in k or "never decided" in k for k in r["known_risks"]), r["known_risks"]


def test_an_unlisted_tool_declared_none_is_refused(tmp_path):
    """claude's ListAgents-like newcomers: a tool the table lacks is decided as `shell` and online whatever
    the declaration says; with shell and network off it never runs. Control: Write, declared the same way
    beside it, is decided by its table row and runs."""
    from proctor.mechanisms.gatekeeper.claude import CLAUDE_TOOLS
    from proctor.mechanisms.gatekeeper.task import measured
    from proctor.mechanisms.policy.gate import CallVerdict, Gate
    from proctor.mechanisms.policy.task import AgentTask
    from proctor.mechanisms.policy.trusted import Policy
    task = AgentTask.model_validate({"goal": "g", "tools": [{"name": "NewThing", "effect": "none"},
                                                            {"name": "Write", "effect": "write"}],
                                     "permissions": {"workspace": str(tmp_path), "read_files": True,
                                                     "write_files": True, "shell": False, "network": False}})
    gate = Gate(measured(task, CLAUDE_TOOLS), policy=Policy(), dry_run=False, stop=lambda: None)
    new = gate.decide({"tool": "NewThing", "arguments": {}, "paths": [], "call_id": "1"})
    write = gate.decide({"tool": "Write", "arguments": {"file_path": str(tmp_path / "a")},
                         "paths": [str(tmp_path / "a")], "call_id": "2"})
    assert new.verdict is CallVerdict.refused and write.verdict is CallVerdict.run, (new, write)
