"""Each built-in adapter driven through the host against a fake executable of the same name.

The built-ins are declared in builtin.toml through the same loader as a user's config, so these also
exercise the TOML path. The argv itself is checked against the real CLIs in test_real_clis.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import ConfigError, builtin_agents, load_config
from proctor.mechanisms.adapters.testing import real_version, Behaviour

CODEX_OUT = "\n".join(json.dumps(e) for e in [
    {"type": "thread.started", "thread_id": "t"},
    {"type": "item.completed", "item": {"id": "i0", "type": "agent_message", "text": "Fixed the bug."}},
    {"type": "turn.completed", "usage": {"input_tokens": 10, "output_tokens": 5}},
]) + "\n"
CLAUDE_OUT = "\n".join(json.dumps(e) for e in [
    {"type": "system", "subtype": "init"},
    {"type": "assistant", "message": {"content": [{"type": "text", "text": "working"}]}},
    {"type": "result", "subtype": "success", "is_error": False, "result": "Done: fixed it."},
]) + "\n"
GEMINI_OUT = json.dumps({"response": "All good.", "stats": {"models": {}}})
OPENCODE_OUT = json.dumps({"type": "text", "part": {"type": "text", "text": "opencode did it"}}) + "\n"

CASES = {
    # name: (stdout, expected summary, expected claim)
    "codex": (CODEX_OUT, "Fixed the bug.", "completed"),
    "claude": (CLAUDE_OUT, "Done: fixed it.", "completed"),
    "gemini": (GEMINI_OUT, "All good.", "completed"),
    "grok": ("I changed main.py\n", "I changed main.py", None),
    "opencode": (OPENCODE_OUT, "opencode did it", None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_builtin_adapter_argv_cwd_stdin_and_output(repo, fake, name):
    stdout, summary, claim = CASES[name]
    agent = fake(name, Behaviour(stdout=stdout, writes={"touched.txt": name}))
    res = run_agent(RunAgentRequest(agent=name, task="the task", repo=str(repo), ticket="T", validateCommand="true"))
    assert res.status is Status.completed, res
    call = agent.calls()[0]
    wt = res.worktree_path
    # The argv itself is checked against the real CLIs (test_real_clis.py); here: the host passes exactly
    # the declared template, placeholders filled, the workspace where the CLI reads it.
    spec = builtin_agents()[name]
    # A gated CLI gets its gate's install args (the job's own settings file) before its first option.
    gate = []
    if spec.gate:
        d = str(Path(res.gate["settings"]).parent)
        gate = [a.replace("{gate_settings}", res.gate["settings"]).replace("{gate_dir}", d) for a in spec.gate_args]
    at = next((i for i, t in enumerate(spec.command) if i and t.startswith("-")), len(spec.command))
    template = [*spec.command[:at], *gate, *spec.command[at:]]
    assert call["argv"][1:] == [a.replace("{worktree}", wt).replace("{prompt}", "the task") for a in template[1:]]
    assert res.gate["gated"] is bool(spec.gate)
    assert call["cwd"] == wt
    prompt_on_stdin = builtin_agents()[name].prompt == "stdin"
    assert call["stdin_devnull"] is (not prompt_on_stdin)
    assert call["stdin"] == ("the task" if prompt_on_stdin else "")
    assert res.summary == summary and res.claimed_status == claim
    assert res.agent_version == real_version(name)
    assert (Path(wt) / "touched.txt").read_text() == name
    assert res.known_risks == ["confinement is off by request: the agent and its validation ran unconfined",
                     "the verdict on `true` rests on its exit code alone: no per-test evidence "
                     "(docs/concepts/verdict.md: What the verdict rests on)"]


def test_claude_is_error_beats_subtype_success(repo, fake):
    out = json.dumps({"type": "result", "subtype": "success", "is_error": True, "result": "Not logged in · Please run /login"})
    fake("claude", Behaviour(stdout=out + "\n", exit_codes=[1]))
    res = run_agent(RunAgentRequest(agent="claude", task="t", repo=str(repo), ticket="T"))
    assert res.status is Status.failed and res.claimed_status == "failed" and "Not logged in" in res.summary


def test_gemini_error_json_on_stderr(repo, fake):
    err = json.dumps({"error": {"type": "Error", "message": "Please set an Auth method", "code": 41}})
    fake("gemini", Behaviour(stderr=err, exit_codes=[41]))
    res = run_agent(RunAgentRequest(agent="gemini", task="t", repo=str(repo), ticket="T"))
    assert res.status is Status.failed and res.claimed_status == "failed" and "Auth method" in res.summary


def test_grok_exit_zero_on_429_is_not_rate_limited_and_claim_is_failed(repo, fake):
    fake("grok", Behaviour(stdout="Sorry, I encountered an error: Grok API error: 429\n"))
    res = run_agent(RunAgentRequest(agent="grok", task="t", repo=str(repo), ticket="T", validateCommand="true"))
    assert res.status is Status.completed and res.claimed_status == "failed"
    assert res.needs_human_review and "the agent changed no files" in res.known_risks


def test_user_adapter_overrides_and_patterns(tmp_path, repo, fake):
    fake("mine", Behaviour(exit_codes=[7], stderr="BACKOFF-PLEASE"))
    cfg = tmp_path / "c.toml"
    cfg.write_text('confine = "off"\n[agents.mine]\ncommand = ["mine", "{prompt}"]\nrate_limit_patterns = ["BACKOFF-PLEASE"]\n')
    res = run_agent(RunAgentRequest(agent="mine", task="t", repo=str(repo), ticket="T"), config=load_config(cfg))
    assert res.status is Status.rate_limited


@pytest.mark.parametrize("retry", [False, True])
def test_an_adapter_that_declares_retry_false_runs_once(tmp_path, repo, fake, retry):
    agent = fake("mine", Behaviour(exit_codes=[1]))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'confine = "off"\n[agents.mine]\ncommand = ["mine", "{{prompt}}"]\nretry = {str(retry).lower()}\n')
    res = run_agent(RunAgentRequest(agent="mine", task="t", repo=str(repo), ticket="T"), config=load_config(cfg))
    assert res.status is Status.failed and res.code.value == "AGENT_FAILED"
    # control: retry = true (the default) is the usual second attempt
    assert len(agent.calls()) == res.attempts == len(res.exit_codes) == (2 if retry else 1)
    said = [r for r in res.known_risks if "retry = false" in r]
    assert said == ([] if retry else ["agent exited 1; not retried: adapter 'mine' declares retry = false"])


def test_builtin_patch_does_not_retry_a_diff_that_did_not_apply(repo):
    assert builtin_agents()["patch"].retry is False and builtin_agents()["claude"].retry is True
    diff = "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-absent\n+patched\n"
    res = run_agent(RunAgentRequest(agent="patch", task=diff, repo=str(repo), ticket="T"))
    assert res.status is Status.failed and res.code.value == "AGENT_FAILED"
    assert res.attempts == 1 and res.exit_codes == [1] and "patch does not apply" in res.summary + str(res.known_risks)
    assert not any("retried once" in r for r in res.known_risks)


@pytest.mark.parametrize("text,needle", [
    ('[agents.a]\ncommand = []\n', "command"),
    ('[agents.a]\ncommand = ["x"]\n', "needs a {prompt} placeholder"),
    ('[agents.a]\ncommand = ["x", "{nope}"]\n', "unknown placeholder {nope}"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\nprompt = "carrier-pigeon"\n', "prompt"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\nrate_limit_patterns = ["("]\n', "not a valid regular expression"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\napproved = true\n', "approved"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\noutput = "xml"\n', "output 'xml'"),
    ('agents = 3\n', "must be a table"),
    ('this is not toml = = =\n', "not valid TOML"),
    ('confine = "maybe"\n', "confine"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\negress = ["https://api.example.com"]\n', "no scheme"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\negress = ["*.example.com"]\n', "wildcard"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\negress = ["api.example.com:99999"]\n', "port must be"),
    ('[agents.a]\ncommand = ["x", "{prompt}"]\nnetwork = false\negress = ["api.example.com"]\n', "network = true"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, needle):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert needle in str(info.value) and str(p) in str(info.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "nope.toml")


def test_config_found_via_env_and_home(tmp_path, monkeypatch, proctor_home):
    (proctor_home / "config.toml").write_text('[agents.homeagent]\ncommand = ["x", "{prompt}"]\n')
    assert "homeagent" in load_config().agents
    other = tmp_path / "env.toml"
    other.write_text('[agents.envagent]\ncommand = ["x", "{prompt}"]\n')
    monkeypatch.setenv("PROCTOR_CONFIG", str(other))
    agents = load_config().agents
    assert "envagent" in agents and "homeagent" not in agents and "codex" in agents


def test_gemini_pretty_printed_error_after_a_banner():
    from proctor.mechanisms.adapters.output import read_gemini

    err = 'YOLO mode is enabled. All tool calls will be automatically approved.\n{\n  "error": {\n    "type": "Error",\n' \
          '    "message": "Please set an Auth method",\n    "code": 41,\n    "details": [\n      {\n        "x": 1\n      }\n    ]\n  }\n}\n'
    reading = read_gemini("", err)
    assert reading.claimed_status == "failed" and reading.summary == "Please set an Auth method"


# Each CLI's model API (and the auth hosts its login refreshes against): its whole network under confinement.
MODEL_HOSTS = {"codex": "api.openai.com:443", "claude": "api.anthropic.com:443",
               "gemini": "generativelanguage.googleapis.com:443", "grok": "api.x.ai:443",
               "opencode": "api.anthropic.com:443"}


@pytest.mark.parametrize("name", sorted(MODEL_HOSTS))
def test_builtin_network_adapters_declare_their_model_hosts(name):
    spec = builtin_agents()[name]
    assert spec.network and MODEL_HOSTS[name] in spec.egress
    assert all(e.rsplit(":", 1)[1].isdigit() for e in spec.egress)  # normalised: port always spelled out
    assert not builtin_agents()["patch"].network and builtin_agents()["patch"].egress == ()


def test_user_adapter_egress_is_normalised(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[agents.mine]\ncommand = ["x", "{prompt}"]\negress = ["API.Example.com", "127.0.0.1:11434", '
                   '"[::1]:8080"]\n')
    assert load_config(cfg).agents["mine"].egress == ("api.example.com:443", "127.0.0.1:11434", "[::1]:8080")


def test_the_version_answer_is_kept_across_hosts_until_the_cli_changes(tmp_path, repo, monkeypatch):
    """Each `proctor run-agent` is a process of its own: the CLI's `--version` answer is kept in the state dir,
    keyed on the executable's identity, so the next host does not ask again (a real gemini took 1.7 s to
    answer); a changed executable is asked again (the control: the probe still runs when it must)."""
    from proctor.services.job import agent_version

    bin_dir, probes = tmp_path / "bin", tmp_path / "probes"
    bin_dir.mkdir()
    exe = bin_dir / "vcli"

    def install(version: str) -> None:
        exe.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo x >> {probes}; echo "vcli {version}"; }}\n'
                       "exit 0\n")
        exe.chmod(0o755)

    install("1.0")
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    cfg = tmp_path / "vcli.toml"
    cfg.write_text('confine = "off"\n[agents.vcli]\ncommand = ["vcli"]\nprompt = "stdin"\nnetwork = false\n'
                   'version_args = ["--version"]\n')

    def job(i: int) -> str | None:
        agent_version._cache.clear()  # what a new host process starts with
        req = RunAgentRequest(agent="vcli", task="t", repo=str(repo), ticket=f"V{i}", validateCommand="true")
        return run_agent(req, config=load_config(cfg)).agent_version

    assert job(1) == "vcli 1.0" and probes.read_text().count("x") == 1
    assert job(2) == "vcli 1.0" and probes.read_text().count("x") == 1  # kept: not asked again
    install("2.0")  # an upgrade: another file (its ctime moves even where the size and mtime would not)
    assert job(3) == "vcli 2.0" and probes.read_text().count("x") == 2
    assert job(4) == "vcli 2.0" and probes.read_text().count("x") == 2
