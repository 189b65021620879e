"""End to end, confined (`--confine required`): the real codex, claude and gemini against a scripted model
served over plain HTTP on loopback (tests/modelserver.py, `tls=False`: a local model server as most people
run one — Ollama, vLLM, LM Studio — streaming chunked), and the job's whole network counted.

What a user configures, and nothing else: `base_url = "http://127.0.0.1:PORT..."` and `egress =
["127.0.0.1:PORT"]` in `[agents.NAME]` (plus codex's `api_key_env`); no CA, no TLS in front. The host's
egress proxy forwards the CLI's absolute-form requests to the declared literal.

- Each success test: the job completes with the model's file, and **every** `egress.decision` row of the
  job — allowed or refused, CONNECT or plain — names the model's host:port: no telemetry, analytics, update
  check or error report left the sandbox, nor was tried (the built-ins switch them off, builtin.toml).
- Control (plain HTTP): the same model with its port not declared: the proxy refuses the CLI's plain
  request with a row naming it and a 403 whose reason the job's summary shows; the model never hears from
  the CLI, and the job fails.
- Control (the count): codex with its analytics switch taken out of the adapter, as before it was there:
  the count sees its metrics exporter try `ab.chatgpt.com:443` — the check above can fail.

Skips as tests/test_real_cli_jobs.py does when a CLI or bubblewrap is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import make_repo
from modelserver import FINAL_TEXT, ScriptedModel
from test_real_cli_jobs import (
    ACTION,
    CLIS,
    Job,
    launch,
    need,
    repo_state,
)

from proctor.mechanisms.config.load import builtin_agents

# codex's argv with the analytics switch removed: the control's adapter, as 0.171 ran before the switch.
ANALYTICS = ("-c", "analytics.enabled=false")


def codex_command_without_analytics() -> list[str]:
    command = list(builtin_agents()["codex"].command)
    at = next(i for i in range(len(command)) if tuple(command[i:i + 2]) == ANALYTICS)
    return command[:at] + command[at + 2:]


def run_plain(case: str, tmp_path: Path, *, declare: str | None = None, overlay: str = "") -> Job:
    """One `proctor run-agent` job against a plain-HTTP scripted model; `declare` replaces the egress entry."""
    cli = CLIS[case]
    need(cli)
    repo = make_repo(tmp_path, {"README.md": "hello\n"})
    home = Path(os.environ["HOME"])
    model = ScriptedModel(tmp_path / "model", ACTION, log_file=tmp_path / "model.jsonl", tls=False)
    if cli.name == "gemini":
        # As in test_real_cli_jobs: a base URL needs gemini's auth type in its own settings (this HOME is the test's).
        (home / ".gemini").mkdir(parents=True, exist_ok=True)
        (home / ".gemini" / "settings.json").write_text(
            json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in cli.config_env.items())
    config = tmp_path / "config.toml"
    config.write_text(f'confine = "required"\n\n[agents.{cli.name}]\nbase_url = "{model.url}{cli.base_path}"\n'
                      f'egress = ["{declare or model.endpoint}"]\n{cli.overlay}env = {{ {env_toml} }}\n'
                      + (f'model = "{cli.model}"\n' if cli.model else "") + overlay)
    job = launch(cli, repo, config, model, Path(os.environ["PROCTOR_HOME"]), ("--validate-cmd", "true"))
    seconds = job.seconds
    rows = job.egress()
    print(f"{case} plain http: {seconds:.1f} s, {len(rows)} egress rows: "
          f"{sorted({(d['host'], d['port'], d.get('scheme', 'connect'), d['allowed']) for d in rows})}")
    return job


def elsewhere(job: Job) -> list[dict]:
    """Every egress row of the job that is not the model's own host:port, allowed or not."""
    return [d for d in job.egress() if (d["host"], d["port"]) != ("127.0.0.1", job.model.port)]


@pytest.mark.realcli
@pytest.mark.parametrize("case", ["claude", "codex", "gemini"])
def test_a_plain_http_model_on_loopback_and_no_other_outbound_attempt(case, tmp_path):
    job = run_plain(case, tmp_path)
    r, why = job.result, job.explain()
    assert job.exit_code == 0 and r["status"] == "completed" and r["code"] == "OK", why
    assert r["summary"] == FINAL_TEXT and r["changed_files"] == [ACTION.name], why
    assert (Path(r["worktreePath"]) / ACTION.name).read_text() == ACTION.content
    assert repo_state(job.repo) == job.before
    replies = [q.reply for q in job.model.requests]
    assert "tool_call" in replies and "final" in replies, job.model.summary()
    rows = job.egress()
    assert rows and all(d["allowed"] for d in rows), rows
    # Every row is the model's: the CLI tried nothing else, not even to be refused. (claude and codex send
    # the plain requests in absolute form, `scheme` "http"; gemini 0.61 tunnels them with CONNECT.)
    assert elsewhere(job) == [], elsewhere(job)


@pytest.mark.realcli
@pytest.mark.parametrize("case", ["claude", "codex"])
def test_an_undeclared_plain_http_model_is_refused_with_a_row(case, tmp_path):
    """The control: the same model, its port not declared (the next one is)."""
    probe = ScriptedModel(tmp_path / "probe", tls=False)  # only to learn a port nobody serves
    probe.close()
    job = run_plain(case, tmp_path, declare=f"127.0.0.1:{probe.port}")
    r, why = job.result, job.explain()
    assert job.exit_code != 0 and r["status"] == "failed", why
    # The 403's text reaches the job's summary through the CLI's own error ("API Error: 403 proctor egress
    # proxy: http://127.0.0.1:PORT: not a declared egress host:port"): the cause is named where it is read.
    assert "not a declared egress host:port" in r["summary"], why
    assert job.model.requests == [], job.model.summary()
    refused = [d for d in job.egress() if (d["host"], d["port"]) == ("127.0.0.1", job.model.port)]
    assert refused and not any(d["allowed"] for d in refused), job.egress()
    assert all("not a declared egress host:port" in d["reason"] for d in refused)
    assert {d.get("scheme") for d in refused} == {"http"}, refused  # the absolute-form request, refused


@pytest.mark.realcli
def test_the_count_sees_codexs_analytics_when_it_is_left_on(tmp_path):
    """The control of the count: the adapter without its analytics switch phones home, and it shows."""
    overlay = f"command = {json.dumps(codex_command_without_analytics())}\n"
    job = run_plain("codex", tmp_path, overlay=overlay)
    assert job.result["status"] == "completed", job.explain()
    hosts = {(d["host"], d["port"], d["allowed"]) for d in elsewhere(job)}
    assert ("ab.chatgpt.com", 443, False) in hosts, job.egress()
