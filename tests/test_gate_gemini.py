"""Every tool call of the real Gemini CLI (0.61) passes proctor's gate before it runs: run-agent jobs of the
built-in `gemini` adapter, confined, against the scripted model (tests/modelserver.py). A call the
declaration allows runs (the control); one it refuses never executes, and the refusal and its reason are
in the ledger and in the model's next request; a hook that crashes, is killed or hangs denies (gemini
itself runs the tool on a failed hook); a tool call gemini ran with no gate row ends the job BYPASS (a
stand-in CLI speaking gemini's stream-json and hook protocol)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_repo
from modelserver import ERROR_MARK, FINAL_TEXT, ScriptedModel
from test_gate_claude import declaration, gate_rows
from test_real_cli_jobs import ACTION, BIN, CAPS, CI, run_job

from proctor.mechanisms.adapters.output import read_gemini_stream
from proctor.mechanisms.config.load import load_config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.mechanisms.gatekeeper.gemini import GeminiDialect
from proctor.mechanisms.gatekeeper.grant import input_digest
from proctor.mechanisms.gatekeeper.hook import HOOK_CLIENT
from proctor.mechanisms.gatekeeper.task import default_task
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.policy.gate import CallVerdict, Decision, GateCode
from proctor.mechanisms.policy.task import AgentTask
from proctor.mechanisms.policy.trusted import Policy

SHELL = {"name": "run_shell_command", "effect": "shell"}


def calls_of(job) -> list[dict]:
    return [x for x in gate_rows(job) if x["kind"] == "gate.call"]


# -- the real CLI, through proctor ------------------------------------------------------------------------

@pytest.mark.realcli
def test_control_an_allowed_call_is_decided_then_runs(tmp_path):
    job = run_job("gemini", tmp_path)
    r = job.result
    assert r["status"] == "completed" and r["changed_files"] == [ACTION.name], job.explain()
    assert r["summary"] == FINAL_TEXT and r["known_risks"] == [], job.explain()  # the stream-json reader
    assert r["gate"] == {**r["gate"], "gated": True, "cli": "gemini", "armed": True, "refused": 0}, r["gate"]
    rows = gate_rows(job)
    assert rows[0]["kind"] == "gate.armed"
    calls = calls_of(job)
    assert [(c["tool"], c["verdict"], c["code"], c["call_id"]) for c in calls] == \
        [("run_shell_command", "run", "OK", "run_shell_command#1")], calls
    assert len(calls[0]["input_sha256"]) == 64 and calls[0]["latency_ms"] >= 0
    print(f"gate latency {calls[0]['latency_ms']} ms")
    # The policy the job ran under: the default declaration's tools, every other tool denied.
    finals = [q for q in job.model.requests if q.reply == "final"]
    assert "Output:" in (finals[0].tool_result or ""), finals[0].tool_result


@pytest.mark.realcli
@pytest.mark.parametrize("tools, code", [
    ([{"name": "read_file", "effect": "read"}], "TOOL_UNDECLARED"),  # no run_shell_command
    ([SHELL], "PERMISSION"),  # declared, but the declaration grants no shell
])
def test_a_call_the_declaration_refuses_never_runs_and_the_model_hears_why(tmp_path, tools, code):
    decl = declaration(tmp_path, tools)
    job = run_job("gemini", tmp_path, extra=("--task-decl", decl))
    r = job.result
    assert ACTION.name not in r["changed_files"], job.explain()
    assert not (Path(r["worktreePath"]) / ACTION.name).exists()
    assert r["gate"]["refused"] >= 1 and r["gate"]["by_code"].get(code), r["gate"]
    assert any("the gate refused" in k for k in r["known_risks"]) and r["needs_human_review"] is True
    calls = calls_of(job)
    assert calls and calls[0]["tool"] == "run_shell_command" and calls[0]["verdict"] == "refused", calls
    assert calls[0]["code"] == code
    results = [e.tool_result for e in job.model.requests if e.tool_result]
    assert any(f"[proctor {code}]" in t for t in results), job.model.summary()
    assert r["code"] != "BYPASS", job.explain()  # a refused call is reconciled, not a bypass


@pytest.mark.realcli
def test_a_model_error_is_read_from_gemini_stream_json(tmp_path):
    job = run_job("gemini", tmp_path, fail=401)
    r = job.result
    assert r["status"] == "failed" and ERROR_MARK in r["summary"], job.explain()
    assert r["gate"]["armed"] is True and r["gate"]["calls"] == 0, r["gate"]


@pytest.mark.realcli
def test_a_repos_own_settings_cannot_switch_the_gate_off_or_rewrite_the_call(tmp_path):
    """A repo's `.gemini/settings.json` turning hooks off, naming hooks to disable, narrowing the tools, or
    adding a BeforeTool hook that rewrites the call: measured on 0.61 with --skip-trust, the workspace's
    settings are not merged at all, so the gate decides the model's own call (its input digest)."""
    rewrite = json.dumps({"hookSpecificOutput": {"tool_input": {"dir_path": "/"}}})
    repo_settings = {"hooksConfig": {"enabled": False, "disabled": ["proctor-gate", "BeforeTool"]},
                     "tools": {"core": ["read_file"]},
                     "hooks": {"BeforeTool": [{"matcher": "*", "hooks": [{"type": "command",
                                                                          "command": f"echo '{rewrite}'"}]}]}}
    job = run_job("gemini", tmp_path, files={".gemini/settings.json": json.dumps(repo_settings)})
    r = job.result
    assert r["status"] == "completed" and r["gate"]["armed"] is True, job.explain()
    calls = calls_of(job)
    assert [(c["tool"], c["code"]) for c in calls] == [("run_shell_command", "OK")], calls
    asked = next(q.tool_call["input"] for q in job.model.requests if q.reply == "tool_call")
    assert calls[0]["input_sha256"] == input_digest(asked, Path(r["worktreePath"]), tool=calls[0]["tool"]), \
        (asked, calls)


# -- the real CLI, run directly in a sandbox like the job's: what a broken hook does ---------------------

def need_gemini() -> None:
    from test_real_cli_jobs import CLIS, need

    need(CLIS["gemini"])
    if os.geteuid() != 0:
        why = ("gemini reads the job's hook settings only from a root-owned path (GEMINI_CLI_SYSTEM_SETTINGS_PATH); "
               "proctor runs as root in CI")
        pytest.fail(why) if CI else pytest.skip(why)


def gemini_direct(tmp_path: Path, hook: list[str], task: AgentTask | None = None, *, hooks: bool = True,
                  kill_after_s: float | None = None):
    """The built-in adapter's argv (gate args included) under bubblewrap the way a job has it: the gate dir
    bound read-only on a private /tmp, so it and its ancestors are root's. `hook` replaces the hook client."""
    need_gemini()
    from proctor.mechanisms.adapters.spec import Invocation, build
    from proctor.mechanisms.config.load import builtin_agents

    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    home, gate = tmp_path / "home", tmp_path / "gate"
    (home / ".gemini").mkdir(parents=True)
    auth = {"security": {"auth": {"selectedType": "gemini-api-key"}}}  # the user's own settings: they still load
    (home / ".gemini" / "settings.json").write_text(json.dumps(auth))
    gate.mkdir(mode=0o700)
    shutil.copyfile(HOOK_CLIENT, gate / "hook_client.py")  # where GateService.start puts it
    dialect = GeminiDialect()
    if kill_after_s is not None:
        dialect.kill_after_s = kill_after_s
    dialect.bind(task or default_task("t", repo, False, dialect.tools), Policy.load())
    for rel, text in dialect.files(hook, gate).items():
        (gate / rel).write_text(text)
    model = ScriptedModel(tmp_path / "model", ACTION)
    shutil.copy(model.ca_file, home / "ca.pem")
    spec = builtin_agents()["gemini"]
    inv = build(spec, "Create hello.txt saying hello.", repo, None, {}, gate_dir=gate)
    assert isinstance(inv, Invocation), inv
    node = shutil.which("node")
    env = {"PATH": os.pathsep.join([str(BIN), *([str(Path(node).parent)] if node else []), "/usr/bin", "/bin"]),
           "HOME": str(home), "GEMINI_API_KEY": "k", "GOOGLE_GEMINI_BASE_URL": model.url,
           "NODE_EXTRA_CA_CERTS": str(home / "ca.pem"), **(dialect.env(gate) if hooks else {})}
    bwrap = [str(CAPS.bwrap), "--die-with-parent", "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/",
             "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", str(repo), str(repo),
             "--bind", str(home), str(home), "--ro-bind", str(gate), str(gate), "--chdir", str(repo), "--"]
    with model:
        done = subprocess.run([*bwrap, str(BIN / "gemini"), *inv.argv[1:]], env=env, capture_output=True, text=True,
                              timeout=90)
    results = [json.loads(ln) for ln in done.stdout.splitlines() if '"tool_result"' in ln]
    return done, model, results, repo


# The interpreter as GateService.hook_command names it (its real path): a venv's python in a clone under
# /tmp is hidden by the sandbox's private /tmp, and every broken hook would fail as "cannot start" (issue 24).
PYTHON = os.path.realpath(sys.executable)
BROKEN = {
    "crashes": [PYTHON, "-c", "import sys; sys.exit(1)"],  # gemini alone: "non-blocking", the tool runs
    "is killed": [PYTHON, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
    "hangs": [PYTHON, "-c", "import time; time.sleep(600)"],
    "cannot start": ["/nonexistent/python3"],
}


@pytest.mark.realcli
@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_hook_that_fails_denies_the_call(tmp_path, how):
    done, model, results, repo = gemini_direct(tmp_path, BROKEN[how], kill_after_s=2)
    assert not (repo / ACTION.name).exists(), done.stdout[-2000:] + done.stderr[-2000:]
    assert [r["status"] for r in results] == ["error"], results
    assert results[0]["error"]["type"] == "policy_violation", results
    heard = [q.tool_result for q in model.requests if q.tool_result]
    assert any("[proctor GATE_UNAVAILABLE]" in t for t in heard), model.summary()


@pytest.mark.realcli
def test_the_hook_client_with_its_gate_gone_denies_in_the_real_cli(tmp_path):
    client = tmp_path / "gate" / "hook_client.py"  # gemini_direct copies it there, as a job has it
    hook = [PYTHON, "-I", "-S", str(client), str(tmp_path / "gone.sock"), "gemini"]
    done, model, results, repo = gemini_direct(tmp_path, hook)
    assert not (repo / ACTION.name).exists() and [r["status"] for r in results] == ["error"], results
    assert "[proctor GATE_UNAVAILABLE] FileNotFoundError" in results[0]["error"]["message"], results


@pytest.mark.realcli
def test_without_its_hooks_the_policy_still_denies_what_was_not_declared(tmp_path):
    """The static backstop: no hook ran at all (the settings layer skipped), and the compiled --policy alone
    refuses a tool the declaration does not name, in the gate's words."""
    task = AgentTask.model_validate({"goal": "g", "tools": [{"name": "read_file", "effect": "read"}],
                                     "permissions": {"workspace": str(tmp_path), "read_files": True}})
    done, model, results, repo = gemini_direct(tmp_path, ["false"], task, hooks=False)
    assert not (repo / ACTION.name).exists() and [r["status"] for r in results] == ["error"], results
    assert "[proctor TOOL_UNDECLARED]" in results[0]["error"]["message"], results


# -- reconciliation: a stand-in CLI speaking gemini's stream-json and hook protocol ----------------------

# Runs the hooks of the system settings file it is pointed at (as gemini does, through bash), when told to,
# around one shell call; `unregistered` is a call gemini rejects before any hook (an unknown tool).
CLI = r'''
import json, os, subprocess, sys, time
mode = next(a for a in sys.argv if a in ("both", "no-session", "no-pretool", "unregistered"))
hooks = json.load(open(os.environ["GEMINI_CLI_SYSTEM_SETTINGS_PATH"]))["hooks"]
assert "--policy" in sys.argv and os.path.exists(sys.argv[sys.argv.index("--policy") + 1])
def hook(event, payload):
    cmd = hooks[event][0]["hooks"][0]["command"]
    return subprocess.run(["bash", "-c", cmd], input=json.dumps(payload).encode(), capture_output=True)
def emit(ev):
    print(json.dumps(ev), flush=True)
emit({"type": "init", "session_id": "s"})
if mode != "no-session":
    hook("SessionStart", {"hook_event_name": "SessionStart", "source": "startup"})
args = {"command": "echo x > a.txt"}
if mode == "unregistered":
    emit({"type": "tool_use", "tool_name": "no_such_tool", "tool_id": "no_such_tool__1", "parameters": {}})
    emit({"type": "tool_result", "tool_id": "no_such_tool__1", "status": "error",
          "error": {"type": "tool_not_registered", "message": "Tool \"no_such_tool\" not found."}})
emit({"type": "tool_use", "tool_name": "run_shell_command", "tool_id": "run_shell_command__1", "parameters": args})
allowed = True
if mode != "no-pretool":
    out = hook("BeforeTool", {"hook_event_name": "BeforeTool", "tool_name": "run_shell_command", "tool_input": args})
    allowed = out.returncode == 0 and json.loads(out.stdout or "{}").get("decision") != "deny"
if allowed:
    open("a.txt", "w").write("x\n")
emit({"type": "tool_result", "tool_id": "run_shell_command__1", "status": "success" if allowed else "error"})
time.sleep(0.5)  # gemini asks its model next
emit({"type": "message", "role": "assistant", "content": "done", "delta": True})
emit({"type": "result", "status": "success"})
'''


@pytest.fixture
def standin(tmp_path):
    script = tmp_path / "fakegemini.py"
    script.write_text(CLI)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'confine = "off"\n[agents.fg]\ncommand = [{json.dumps(sys.executable)}, "{script}", '
                   '"{prompt}"]\noutput = "gemini-stream-json"\ngate = "gemini"\n'
                   'gate_args = ["--policy", "{gate_dir}/gemini-policy.toml"]\n')
    return load_config(cfg)


def standin_job(repo, config, mode: str):
    return run_agent(RunAgentRequest(agent="fg", task=mode, repo=str(repo), ticket="T", validateCommand="true"),
                     config=config)


@pytest.mark.parametrize("mode", ["both", "unregistered"])
def test_control_every_call_that_reached_the_hook_stage_was_decided(repo, standin, mode):
    res = standin_job(repo, standin, mode)
    assert res.status is Status.completed and res.changed_files == ["a.txt"], res
    assert res.gate["armed"] is True and res.gate["calls"] == 1 and res.summary == "done", res.gate


def test_a_call_gemini_ran_without_a_gate_row_is_a_bypass(repo, standin):
    res = standin_job(repo, standin, "no-pretool")
    assert res.status is Status.failed and res.code is Code.BYPASS and res.needs_human_review, res
    assert any("never decided" in r and "run_shell_command (run_shell_command#1)" in r for r in res.known_risks), \
        res.known_risks


def test_a_call_before_the_gate_was_armed_kills_the_run(repo, standin):
    res = standin_job(repo, standin, "no-session")
    assert res.status is Status.failed and res.code is Code.BYPASS and res.gate["armed"] is False, res
    assert any("before the gate's hook was armed" in r for r in res.known_risks), res.known_risks


# -- the dialect itself, without a CLI --------------------------------------------------------------------

def test_hook_json_becomes_the_gates_call_with_paths(tmp_path):
    d, wt = GeminiDialect(), tmp_path

    def call(tool, args):
        return d.call({"hook_event_name": "BeforeTool", "tool_name": tool, "tool_input": args}, wt)

    assert call("write_file", {"file_path": "a.txt", "content": "x"})["paths"] == ["a.txt"]
    assert call("replace", {"file_path": "/etc/passwd", "old_string": "a"})["paths"] == ["/etc/passwd"]
    assert call("run_shell_command", {"command": "ls", "dir_path": "/tmp"})["paths"] == ["/tmp"]
    assert call("run_shell_command", {"command": "ls"})["paths"] == []
    assert call("list_directory", {})["paths"] == [str(wt)]
    # A glob is checked where its walk starts, and as the literal path it is when one exists.
    assert call("glob", {"pattern": "/etc/*"})["paths"] == ["/etc", "/etc/*"]
    assert call("read_many_files", {"include": ["a", "../b"]})["paths"] == [f"{wt}/a", f"{wt.parent}/b"]
    assert call("web_fetch", {"prompt": "https://x"})["paths"] == []
    # No call id in gemini's hook input: the n-th hooked call of a tool, as its stream names them.
    assert call("run_shell_command", {"command": "ls"})["call_id"] == "run_shell_command#3"
    stream = "\n".join(json.dumps(e) for e in [
        {"type": "tool_use", "tool_name": "run_shell_command", "tool_id": "a", "parameters": {}},
        {"type": "tool_use", "tool_name": "nope", "tool_id": "b", "parameters": {}},
        {"type": "tool_result", "tool_id": "b", "status": "error", "error": {"type": "tool_not_registered"}},
        {"type": "tool_result", "tool_id": "a", "status": "error", "error": {"type": "policy_violation"}},
    ])
    assert d.tool_uses(stream) == [("run_shell_command#1", "run_shell_command")]


def test_the_answer_is_gemini_s_own_form():
    d = GeminiDialect()
    ok = Decision(verdict=CallVerdict.run, code=GateCode.OK, reason="granted", tool="t")
    no = Decision(verdict=CallVerdict.refused, code=GateCode.PATHS_REQUIRED, reason="no path", tool="t")
    assert json.loads(d.answer(ok).stdout) == {"decision": "allow"} and d.answer(ok).exit == 0
    assert json.loads(d.answer(no).stdout) == {"decision": "deny", "reason": "[proctor PATHS_REQUIRED] no path"}


def test_the_policy_is_compiled_from_the_declaration(tmp_path):
    import tomllib

    task = AgentTask.model_validate({"goal": "g", "permissions": {"workspace": str(tmp_path), "read_files": True},
                                     "tools": [{"name": "read_file", "effect": "read"}, SHELL,
                                               {"name": "*", "effect": "read"}, {"name": 'x"y', "effect": "read"}]})
    d = GeminiDialect()
    d.bind(task, Policy.load())
    files = d.files(["python3", "hook_client.py", "/g/gate.sock", "gemini"], tmp_path)
    rules = tomllib.loads(files["gemini-policy.toml"])["rule"]
    by = {(r["toolName"], r["decision"]): r for r in rules}
    assert by["*", "deny"]["priority"] == 990 and "[proctor TOOL_UNDECLARED]" in by["*", "deny"]["denyMessage"]
    assert by["read_file", "allow"]["priority"] == 995
    assert by["run_shell_command", "deny"]["priority"] == 999
    assert by["run_shell_command", "deny"]["denyMessage"].startswith("[proctor PERMISSION]")
    # A declared name gemini would read as a wildcard is never allowed; every rule keeps the tool registered.
    assert ("*", "allow") not in by and len(rules) == 3
    assert all(r.get("argsPattern") == (".*" if r["decision"] == "deny" else None) for r in rules), rules
    assert by["read_file", "allow"]["allowRedirection"] is True
    settings = json.loads(files["gemini-settings.json"])
    assert settings["hooksConfig"] == {"enabled": True} and settings["hooks"]["BeforeTool"][0]["sequential"] is True
    assert d.env(tmp_path) == {"GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(tmp_path / "gemini-settings.json")}


@pytest.mark.parametrize("script, says", [
    ("import sys; sys.exit(1)", "(exit 1)"),  # gemini's "non-blocking warning": the tool would run
    ("print('garbage'); import sys; sys.exit(3)", "(exit 3)"),
    ("import sys; sys.stderr.write('[proctor GATE_UNAVAILABLE] its own reason'); sys.exit(2)", "its own reason"),
])
def test_the_guard_turns_every_failure_of_the_hook_into_exit_2(script, says):
    command = GeminiDialect().guarded([sys.executable, "-c", script])
    p = subprocess.run(["bash", "-c", command], input=b"{}", capture_output=True, timeout=30)
    assert p.returncode == 2 and says.encode() in p.stderr, (p.returncode, p.stderr)
    ok = subprocess.run(["bash", "-c", GeminiDialect().guarded([sys.executable, "-c", "print('{}')"])],
                        input=b"{}", capture_output=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout.strip() == b"{}"


def test_the_hook_client_gives_up_on_a_gate_that_never_answers(tmp_path):
    import socket

    client = Path(__file__).resolve().parents[1] / "src" / "proctor" / "mechanisms" / "gatekeeper" / "hook_client.py"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(tmp_path / "g.sock"))
        srv.listen(1)  # accepts (the kernel does), never answers
        code = (f"import sys; sys.path.insert(0, {str(client.parent)!r}); import hook_client as h; "
                f"h.DEADLINE_S = 0.5; sys.exit(h.main(sys.argv))")
        # Its own deadline ends the wait: a TimeoutError it names, exit 2. A client that waited on would be
        # ended by subprocess's timeout (TimeoutExpired here), a bound for a broken run only.
        p = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path / "g.sock"), "gemini", "PreToolUse"],
                           input=b'{"tool_name": "run_shell_command"}', capture_output=True, timeout=120)
    assert p.returncode == 2 and b"[proctor GATE_UNAVAILABLE] TimeoutError" in p.stderr, p.stderr


def test_gemini_stream_json_is_read_for_summary_claim_and_backend():
    lines = [{"type": "init"}, {"type": "message", "role": "assistant", "content": "Let me ", "delta": True},
             {"type": "message", "role": "assistant", "content": "look.", "delta": True},
             {"type": "tool_use", "tool_id": "a", "tool_name": "read_file"},
             {"type": "tool_result", "tool_id": "a", "status": "success"},
             {"type": "message", "role": "assistant", "content": FINAL_TEXT, "delta": True},
             {"type": "result", "status": "success", "stats": {}}]
    r = read_gemini_stream("\n".join(map(json.dumps, lines)), "")
    assert (r.summary, r.claimed_status) == (FINAL_TEXT, "completed")
    api = json.dumps({"error": {"code": 429, "message": "RESOURCE_EXHAUSTED", "status": "RESOURCE_EXHAUSTED"}})
    failed = {"type": "result", "status": "error", "error": {"type": "unknown", "message": f"[API Error: {api}]"}}
    r = read_gemini_stream(json.dumps(failed), "")
    assert r.claimed_status == "failed" and r.backend and r.backend.status == 429
    assert "RESOURCE_EXHAUSTED" in r.error_text  # what the adapter's rate_limit_patterns read
    # `--output-format json` (a user's own adapter) and a startup failure on stderr read as before.
    assert read_gemini_stream(json.dumps({"response": "All good.", "stats": {}}), "").summary == "All good."
    early = read_gemini_stream("", "YOLO mode is enabled.\nPlease set an Auth method in x\n")  # measured, exit 41
    assert "Please set an Auth method" in early.summary and early.claimed_status == "failed"
