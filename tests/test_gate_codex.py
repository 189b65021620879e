"""Every tool call of the real Codex CLI (0.171) passes proctor's gate before it runs: run-agent jobs of the
built-in `codex` adapter, confined, against the scripted model (code mode's nested `tools.exec_command`, and
a plain `exec_command` with `--model`). A call the declaration allows runs (the control) and is one gate
row; one it refuses never executes, the row says why and the model's next request carries the reason; a
hook that cannot reach its gate (or cannot run at all) denies, although codex runs the tool on any other
hook failure; the unhooked `write_stdin` cannot type into a shell (no tty). Reconciliation of codex's
`--json` items with a stand-in CLI speaking codex's hook config and stream: a tool item with no gate row,
before the hook armed, or run although refused, ends the job BYPASS."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from modelserver import ScriptedModel
from test_gate_claude import declaration, gate_rows
from test_real_cli_jobs import ACTION, BIN, CI, run_job

from proctor.mechanisms.adapters.spec import build
from proctor.mechanisms.config.load import builtin_agents, load_config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.mechanisms.gatekeeper.codex import CodexDialect, command_key
from proctor.mechanisms.gatekeeper.hook import HOOK_CLIENT
from proctor.mechanisms.gatekeeper.service import DIALECTS
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.policy.gate import CallVerdict, Decision, GateCode


def calls(job) -> list[dict]:
    return [x for x in gate_rows(job) if x["kind"] == "gate.call"]


# -- the real CLI, through proctor run-agent ------------------------------------------------------------

@pytest.mark.realcli
@pytest.mark.parametrize("case", ["codex", "codex-model"])
def test_control_an_allowed_call_is_decided_then_runs(case, tmp_path):
    job = run_job(case, tmp_path)
    r = job.result
    assert r["status"] == "completed" and r["changed_files"] == [ACTION.name], job.explain()
    assert r["gate"] == {**r["gate"], "gated": True, "cli": "codex", "armed": True, "calls": 1, "refused": 0}, r["gate"]
    assert r["known_risks"] == [] and r["needs_human_review"] is False, job.explain()
    rows = gate_rows(job)
    assert rows[0]["kind"] == "gate.armed", rows
    got = calls(job)
    assert [(c["tool"], c["verdict"], c["code"]) for c in got] == [("Bash", "run", "OK")], got
    assert len(got[0]["input_sha256"]) == 64 and got[0]["latency_ms"] >= 0
    # Code mode's nested call has an id of codex's own; a plain function call keeps the model's.
    assert got[0]["call_id"].startswith("exec-" if case == "codex" else "call_"), got[0]
    print(f"{case}: gate latency {got[0]['latency_ms']} ms")


@pytest.mark.realcli
@pytest.mark.parametrize("case, tools, perms, code", [
    ("codex", [{"name": "apply_patch", "effect": "write"}], {}, "TOOL_UNDECLARED"),  # no shell tool declared
    ("codex-model", [{"name": "Bash", "effect": "shell"}], {"shell": False}, "PERMISSION"),  # shell not granted
])
def test_a_call_the_declaration_refuses_never_runs_and_the_model_hears_why(case, tools, perms, code, tmp_path):
    decl = Path(declaration(tmp_path, tools))
    data = json.loads(decl.read_text())
    data["permissions"].update(perms)
    decl.write_text(json.dumps(data))
    job = run_job(case, tmp_path, extra=("--task-decl", str(decl)))
    r = job.result
    assert ACTION.name not in r["changed_files"], job.explain()
    assert not (Path(r["worktreePath"]) / ACTION.name).exists()
    assert r["gate"]["armed"] is True and r["gate"]["refused"] == 1 and r["gate"]["by_code"] == {code: 1}, r["gate"]
    assert any("the gate refused" in k for k in r["known_risks"]) and r["needs_human_review"] is True
    got = calls(job)
    assert [(c["tool"], c["verdict"], c["code"]) for c in got] == [("Bash", "refused", code)], got
    results = [e.tool_result for e in job.model.requests if e.tool_result]
    assert any(f"[proctor {code}]" in t and "blocked by PreToolUse hook" in t for t in results), job.model.summary()
    assert r["code"] != "BYPASS", job.explain()  # a refused call shows no item: nothing to reconcile


@pytest.mark.realcli
def test_a_users_config_cannot_switch_the_gate_off(tmp_path):
    """~/.codex is a state dir, the agent's to write. Measured: a `hooks.state` entry there with `enabled =
    false` for the job's PreToolUse hook silently switched it off, trust bypass or not (the tool ran). The
    adapter's own session-flag overrides win; a repo's `.codex/` is not read (an untrusted project)."""
    state = Path(os.environ["HOME"]) / ".codex"
    state.mkdir(parents=True, exist_ok=True)
    off = "".join(f'[hooks.state."/<session-flags>/config.toml:{e}:0:0"]\nenabled = false\n'
                  for e in ("session_start", "pre_tool_use"))
    (state / "config.toml").write_text(f"[features]\nhooks = false\nunified_exec_tty = true\n{off}")
    job = run_job("codex", tmp_path, files={".codex/config.toml": f"[features]\nhooks = false\n{off}"})
    r = job.result
    assert r["status"] == "completed" and r["gate"]["armed"] is True and r["gate"]["calls"] == 1, job.explain()
    assert [(c["tool"], c["verdict"]) for c in calls(job)] == [("Bash", "run")]


class TtyShell(ScriptedModel):
    """Asks for an interactive bash (a tty), then types a command into it with `write_stdin`, which no hook
    sees: the way around the gate research/gating.md found."""

    def _openai(self, body, path, entry):
        items = [i for i in body.get("input") or [] if isinstance(i, dict)]
        outs = [i for i in items if i.get("type") == "function_call_output" and i.get("call_id") in self.call_ids]
        if len(outs) == 1:  # the shell's answer: now write to it (a tool call again, not the final answer)
            found = re.search(r"session ID (\d+)", json.dumps(outs[0]))
            self.step = {"session_id": int(found.group(1)) if found else 1, "yield_time_ms": 1000,
                         "chars": f"printf hi > {ACTION.name}\n"}
            answer = super()._openai({**body, "input": [i for i in items if i is not outs[0]]}, path, entry)
            entry.tool_result = json.dumps(outs[0].get("output"))
            return answer
        return super()._openai(body, path, entry)

    def _codex_call(self, tools):
        step = getattr(self, "step", None)
        name, args = ("write_stdin", step) if step else ("exec_command", {"cmd": "bash", "tty": True,
                                                                           "yield_time_ms": 500})
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:12]}", "status": "completed",
                "call_id": self._new_call_id("call_"), "name": name, "arguments": json.dumps(args)}


@pytest.mark.realcli
def test_write_stdin_cannot_type_into_a_shell_the_gate_let_start(tmp_path):
    """Measured on 0.171 without the gate's args: `exec_command(bash, tty)` then `write_stdin` wrote the file
    with no hook call. `--disable unified_exec_tty` refuses the tty; without one, stdin is closed."""
    job = run_job("codex-model", tmp_path, model_type=TtyShell)
    r = job.result
    assert not (Path(r["worktreePath"]) / ACTION.name).exists() and r["changed_files"] == [], job.explain()
    assert [(c["tool"], c["verdict"]) for c in calls(job)] == [("Bash", "run")]
    said = [q.tool_result or "" for q in job.model.requests]
    assert any("TTY execution is disabled" in t for t in said), job.model.summary()
    assert [q.tool_call["name"] for q in job.model.requests if q.tool_call] == ["exec_command", "write_stdin"]


# -- the real CLI, run directly with the adapter's gate args and a gate that is not there -----------------

def codex_direct(tmp_path: Path, gate_dir: Path) -> tuple[ScriptedModel, Path, subprocess.CompletedProcess]:
    """The built-in adapter's argv (its gate args with `gate_dir`) against the scripted model, unconfined."""
    exe = BIN / "codex"
    if not (exe.exists() and os.access(exe, os.X_OK)):
        if CI:
            pytest.fail(f"codex is not installed in {BIN}")
        pytest.skip(f"codex is not installed in {BIN} (scripts/install-agent-clis.sh)")
    wt = tmp_path / "wt"
    wt.mkdir()
    subprocess.run(["git", "init", "-q", str(wt)], check=True)
    model = ScriptedModel(tmp_path / "model", ACTION)
    home = Path(os.environ["HOME"])
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[agents.codex]\nbase_url = "{model.url}/v1"\napi_key_env = "SCRIPTED_MODEL_KEY"\n')
    inv = build(load_config(cfg).adapter("codex"), "Create hello.txt saying hello.", wt, None, {}, gate_dir=gate_dir)
    argv = [str(exe), *inv.argv[1:]]
    env = {"HOME": str(home), "PATH": f"{BIN}:/usr/bin:/bin", "SCRIPTED_MODEL_KEY": "k",
           "CODEX_CA_CERTIFICATE": str(model.ca_file)}
    with model:
        done = subprocess.run(argv, input=inv.stdin, env=env, capture_output=True, timeout=60)
    return model, wt, done


@pytest.mark.realcli
@pytest.mark.parametrize("installed", [True, False], ids=["socket-gone", "hook-script-missing"])
def test_a_hook_that_cannot_reach_its_gate_denies_in_the_real_codex(installed, tmp_path):
    """Codex 0.171 runs the tool when its hook crashes, times out or prints garbage; exit 2 is its only
    block. The client answers exit 2 when its gate is gone; the command line, when the script cannot run."""
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    if installed:
        hook = [sys.executable, "-I", "-S", str(HOOK_CLIENT), str(gate_dir / "gate.sock"), "codex"]
        for rel, text in CodexDialect().files(hook, gate_dir).items():
            (gate_dir / rel).write_text(text)
    model, wt, done = codex_direct(tmp_path, gate_dir)
    assert not (wt / ACTION.name).exists(), done.stdout.decode()[-2000:]
    results = [q.tool_result or "" for q in model.requests]
    assert any("blocked by PreToolUse hook" in t and "[proctor GATE_UNAVAILABLE]" in t for t in results), \
        (model.summary(), results, done.stderr.decode()[-1500:])
    assert b'"command_execution"' not in done.stdout


def test_the_hook_client_denies_in_codexs_form_when_its_gate_is_unreachable(tmp_path):
    """Exit 2 with the reason on stderr: the one hook result codex 0.171 blocks on (measured)."""
    p = subprocess.run([sys.executable, "-I", "-S", str(HOOK_CLIENT), str(tmp_path / "gone.sock"), "codex",
                        "PreToolUse"], input=b'{"tool_name": "Bash"}', capture_output=True, timeout=30)
    assert p.returncode == 2 and b"[proctor GATE_UNAVAILABLE]" in p.stderr and p.stdout == b""


# -- the dialect, without a CLI ------------------------------------------------------------------------

def decided(d: CodexDialect, payload: dict, verdict: CallVerdict = CallVerdict.run):
    call = d.call(payload, Path("/wt"))
    code = GateCode.OK if verdict is not CallVerdict.refused else GateCode.TOOL_UNDECLARED
    return call, d.answer(Decision(verdict=verdict, code=code, reason="why", tool=call["tool"],
                                   call_id=call["call_id"]))


def test_the_dialect_maps_codexs_hook_input_and_answers_in_its_form():
    assert DIALECTS["codex"] is CodexDialect and builtin_agents()["codex"].gate == "codex"
    d = CodexDialect()
    patch = ("*** Begin Patch\n*** Add File: a.txt\n+x\n*** Update File: sub/b.py\n*** Move to: c.py\n@@\n"
             "-old\n+new\n*** End Patch\n")  # (an update chunk with no lines is no patch to codex)
    call, ok = decided(d, {"tool_name": "apply_patch", "tool_input": {"command": patch}, "cwd": "/wt/pkg",
                           "tool_use_id": "exec-1"})
    assert call == {"tool": "apply_patch", "arguments": {"command": patch}, "call_id": "exec-1",
                    "paths": ["/wt/pkg/a.txt", "/wt/pkg/sub/b.py", "/wt/pkg/c.py"]}
    assert (ok.stdout, ok.exit) == ("", 0)  # granted: no output (0.171 takes a bare "allow" for a failure)
    # A shell command carrying a patch (codex applies `apply_patch <<'EOF'` itself) has its paths checked.
    call, _ = decided(d, {"tool_name": "Bash", "tool_input": {"command": f"apply_patch <<'EOF'\n{patch}EOF\n"}})
    assert call["tool"] == "Bash" and call["paths"] == ["/wt/a.txt", "/wt/sub/b.py", "/wt/c.py"]
    assert call["call_id"] == "codex-call-1"  # none given: one of its own, never reused
    _, no = decided(d, {"tool_name": "Bash", "tool_input": {"command": "rm -rf /"}, "tool_use_id": "c2"},
                    CallVerdict.refused)
    assert no.exit == 0 and json.loads(no.stdout) == {"hookSpecificOutput": {
        "hookEventName": "PreToolUse", "permissionDecision": "deny",
        "permissionDecisionReason": "[proctor TOOL_UNDECLARED] why"}}


def test_a_commands_workdir_is_part_of_the_call_a_grant_names():
    """issue 41: a grant covered codex's exec_command `command` but not its `workdir`, which reaches the hook
    only as the payload's `cwd` (measured, below): the same approved command ran elsewhere. Now the workdir is
    in the call's input (so in its digest) and, when it is not the session's directory, a path the gate checks."""
    from proctor.mechanisms.gatekeeper.grant import input_digest

    d, wt = CodexDialect(), Path("/wt")
    here = d.call({"tool_name": "Bash", "tool_input": {"command": "make"}, "cwd": "/wt", "tool_use_id": "a"}, wt)
    there = d.call({"tool_name": "Bash", "tool_input": {"command": "make"}, "cwd": "/etc", "tool_use_id": "b"}, wt)
    assert here["arguments"] == {"command": "make", "workdir": "/wt"} and here["paths"] == []
    assert there["arguments"] == {"command": "make", "workdir": "/etc"} and there["paths"] == ["/etc"]
    assert input_digest(here["arguments"], wt, tool="Bash") != input_digest(there["arguments"], wt, tool="Bash")
    # The same command in the next job's worktree is the same call to a grant (the worktree is cut out).
    other = d.call({"tool_name": "Bash", "tool_input": {"command": "make"}, "cwd": "/wt2", "tool_use_id": "c"},
                   Path("/wt2"))
    assert input_digest(other["arguments"], Path("/wt2"), tool="Bash") == input_digest(here["arguments"], wt, tool="Bash")


class WorkdirModel(ScriptedModel):
    """exec_command with `workdir` outside the job's worktree."""

    def _codex_call(self, tools: dict) -> dict:
        call = super()._codex_call(tools)
        if call.get("name") == "exec_command":
            call["arguments"] = json.dumps({**json.loads(call["arguments"]), "workdir": "/etc"})
        return call


@pytest.mark.realcli
def test_a_command_run_in_a_workdir_outside_the_worktree_is_refused(tmp_path):
    job = run_job("codex-model", tmp_path, model_type=WorkdirModel)
    r = job.result
    asked = next(q.tool_call for q in job.model.requests if q.reply == "tool_call")
    assert json.loads(asked["input"])["workdir"] == "/etc", asked  # the model did ask for it
    calls = [x for x in gate_rows(job) if x["kind"] == "gate.call"]
    assert [(c["tool"], c["code"]) for c in calls] == [("Bash", "OUTSIDE_WORKSPACE")], calls
    assert ACTION.name not in r["changed_files"] and not (Path("/etc") / ACTION.name).exists(), job.explain()


def item(n: int, **fields) -> str:
    return json.dumps({"type": "item.completed", "item": {"id": f"item_{n}", **fields}})


def test_codexs_items_are_matched_to_the_calls_the_gate_granted():
    d = CodexDialect()
    cmd = """printf '%s' "it's $HOME" > a.txt"""
    decided(d, {"tool_name": "Bash", "tool_input": {"command": cmd}, "tool_use_id": "call_a"})
    decided(d, {"tool_name": "Bash", "tool_input": {"command": "ls"}, "tool_use_id": "call_b"})
    decided(d, {"tool_name": "Bash", "tool_input": {"command": "touch no"}, "tool_use_id": "call_r"},
            CallVerdict.refused)
    decided(d, {"tool_name": "mcp__pm__echo", "tool_input": {"x": 1}, "tool_use_id": "call_m"})
    # The item re-quotes the command in a shell of codex's choosing; its ids are codex's own.
    shown = "/bin/bash -lc " + "'" + cmd.replace("'", "'\"'\"'") + "'"
    assert command_key(shown) == command_key(cmd)
    stream = "\n".join([
        json.dumps({"type": "item.started",
                    "item": {"id": "item_1", "type": "command_execution", "command": "/bin/bash -lc ls"}}),
        item(2, type="command_execution", command=shown, exit_code=0),
        item(1, type="command_execution", command="/bin/bash -lc ls", exit_code=0),
        item(3, type="mcp_tool_call", server="pm", tool="echo", arguments={"x": 1}),
        item(4, type="agent_message", text="done"),
        item(5, type="command_execution", command="/bin/bash -lc 'touch no'"),  # refused, ran anyway
        "not json", '{"type": "item.completed", "item": 3}',
    ])
    assert d.tool_uses(stream) == [("call_b", "Bash"), ("call_a", "Bash"), ("call_b", "Bash"),
                                   ("call_m", "mcp__pm__echo"), ("item_5", "Bash")]
    # A patched file (a file_change item) is the granted patch that names it.
    decided(d, {"tool_name": "apply_patch", "tool_input": {"command": "*** Begin Patch\n*** Add File: n.txt\n"
                                                                      "+n\n*** End Patch\n"}, "tool_use_id": "p"})
    assert d.tool_uses(item(6, type="file_change", changes=[{"path": "/wt/n.txt", "kind": "add"}])) == \
        [("p", "apply_patch")]
    assert d.tool_uses(item(7, type="file_change", changes=[{"path": "/wt/z", "kind": "add"}])) == \
        [("item_7", "apply_patch")]


def test_a_gate_dir_the_hook_command_cannot_carry_is_refused(tmp_path):
    with pytest.raises(OSError, match="cannot carry"):
        CodexDialect().files(["python3"], tmp_path / 'it"s')


# -- reconciliation, with a stand-in CLI speaking codex's hook config and --json stream --------------------

# Runs the hooks the `-c hooks.<Event>=[...]` overrides name (as codex does: bash, stdin the hook JSON, exit 2
# or a deny blocks), around one shell call, as told by its prompt.
CLI = r'''
import json, subprocess, sys, time, tomllib
args = sys.argv[1:]
hooks = {}
for i, a in enumerate(args[:-1]):
    if a == "-c" and args[i + 1].startswith(("hooks.SessionStart=", "hooks.PreToolUse=")):
        key, value = args[i + 1].split("=", 1)
        hooks[key.split(".", 1)[1]] = tomllib.loads("v = " + value)["v"][0]["hooks"][0]["command"]
mode = next(a for a in args if a in ("both", "no-session", "no-pretool", "ignores-deny"))
def hook(event, payload):
    p = subprocess.run(hooks[event], shell=True, executable="/bin/bash", capture_output=True,
                       input=json.dumps({"hook_event_name": event, "cwd": ".", **payload}).encode())
    return p.returncode == 0 and not p.stdout.strip()
def out(ev):
    print(json.dumps(ev), flush=True)
out({"type": "thread.started", "thread_id": "t"})
if mode != "no-session":
    hook("SessionStart", {"source": "startup"})
out({"type": "turn.started"})
cmd = "printf x > a.txt"
allowed = mode == "no-pretool" or hook("PreToolUse", {"tool_name": "Bash", "tool_input": {"command": cmd},
                                                      "tool_use_id": "call_1"})
if allowed or mode == "ignores-deny":
    item = {"id": "item_0", "type": "command_execution", "command": f"/bin/bash -lc '{cmd}'"}
    out({"type": "item.started", "item": {**item, "status": "in_progress"}})
    time.sleep(0.3)
    open("a.txt", "w").write("x")
    out({"type": "item.completed", "item": {**item, "exit_code": 0, "status": "completed"}})
out({"type": "item.completed", "item": {"id": "item_1", "type": "agent_message", "text": "done"}})
out({"type": "turn.completed", "usage": {}})
'''


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "fakecodex.py"
    script.write_text(CLI)
    cfg = tmp_path / "c.toml"
    gate_args = json.dumps(list(builtin_agents()["codex"].gate_args))
    cfg.write_text(f'confine = "off"\n[agents.fx]\ncommand = [{json.dumps(sys.executable)}, "{script}", '
                   f'"{{prompt}}"]\noutput = "codex-jsonl"\ngate = "codex"\ngate_args = {gate_args}\n')
    return load_config(cfg)


def fake_job(repo, config, mode: str, decl: dict | None = None):
    return run_agent(RunAgentRequest(agent="fx", task=mode, repo=str(repo), ticket="T", validateCommand="true",
                                     taskDecl=decl), config=config)


def test_stand_in_control_both_hooks_ran_and_the_item_matches_its_row(repo, stand_in):
    res = fake_job(repo, stand_in, "both")
    assert res.status is Status.completed and res.changed_files == ["a.txt"], res
    assert res.gate["armed"] is True and res.gate["calls"] == 1 and res.gate["refused"] == 0, res.gate


def test_a_tool_item_before_the_gate_was_armed_kills_the_run(repo, stand_in):
    res = fake_job(repo, stand_in, "no-session")
    assert res.status is Status.failed and res.code is Code.BYPASS and res.attempts == 1, res
    assert res.gate["armed"] is False and res.needs_human_review
    assert any("before the gate's hook was armed" in r for r in res.known_risks), res.known_risks


def test_a_tool_item_the_gate_never_decided_is_a_bypass(repo, stand_in):
    res = fake_job(repo, stand_in, "no-pretool")
    assert res.status is Status.failed and res.code is Code.BYPASS, res
    assert any("never decided" in r and "Bash (item_0)" in r for r in res.known_risks), res.known_risks


def test_a_tool_item_the_gate_refused_is_a_bypass(repo, stand_in):
    decl = {"goal": "g", "tools": [{"name": "apply_patch", "effect": "write"}],
            "permissions": {"workspace": "/ignored", "read_files": True, "write_files": True}}
    res = fake_job(repo, stand_in, "ignores-deny", decl)
    assert res.gate["refused"] == 1 and res.gate["by_code"] == {"TOOL_UNDECLARED": 1}, res.gate
    assert res.status is Status.failed and res.code is Code.BYPASS, res
    assert any("never decided" in r and "Bash (item_0)" in r for r in res.known_risks), res.known_risks

