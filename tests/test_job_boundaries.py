"""Nothing of the host's, or of another job's, crosses into a job unless declared (issue 21 items 1 and 2):
the agent and validation get a declared environment, never the host's; the user's home is hidden from a
confined agent but for its state, which is a per-job copy whose changes die with the job (but the login
files a CLI must keep); a change to a CLI's config is a risk. Each test beside its control.

The confined tests need Landlock or bubblewrap; they skip without, and fail under CI=true. The real-codex
test needs the CLI and bubblewrap, as tests/test_real_cli_jobs.py does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_real_cli_jobs import (  # at import: its CLI cache is the real HOME's, not a test's
    ACTION,
    run_job,
)

from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.adapters.testing import Behaviour

CAPS = detect()
CI = os.environ.get("CI") == "true"
SECRETS = {"ANTHROPIC_API_KEY": "sk-ant-host-secret", "AWS_SECRET_ACCESS_KEY": "aws-host-secret"}


def needs_confinement() -> None:
    if CAPS.bwrap is None and not CAPS.landlock:
        why = f"no OS confinement here (bwrap: {CAPS.bwrap_reason}; landlock: {CAPS.landlock_reason})"
        if CI:
            pytest.fail(why)
        pytest.skip(why)


def config(tmp_path: Path, text: str, name: str = "c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return load_config(p)


def req(repo: Path, agent: str, **kw) -> RunAgentRequest:
    return RunAgentRequest(agent=agent, task="t", repo=str(repo), ticket="T-1", **{"validateCommand": "true", **kw})


def env_lines(res) -> dict[str, str]:
    tail = res.validation[0]["output_tail"]
    return dict(line.split("=", 1) for line in tail.splitlines() if "=" in line)


# -- 1. the environment -------------------------------------------------------------------------------------

def test_host_secrets_reach_neither_the_agent_nor_validation(repo, fake, tmp_path, monkeypatch):
    for k, v in {**SECRETS, "MY_PASSED": "passed-value", "MY_MODEL_KEY": "model-key"}.items():
        monkeypatch.setenv(k, v)
    agent = fake("mine", Behaviour(writes={"a.txt": "1"}, record_env=[
        *SECRETS, "MY_PASSED", "MY_MODEL_KEY", "HOME", "PATH"]))
    cfg = config(tmp_path, 'confine = "off"\nenv_pass = ["MY_PASSED"]\n[agents.mine]\ncommand = ["mine", "{prompt}"]\n'
                           'credentials = ["MY_MODEL_KEY"]\n')
    res = run_agent(req(repo, "mine", validateCommand="env"), config=cfg)
    assert res.status is Status.completed, res
    seen = agent.calls()[0]["env"]
    assert seen["ANTHROPIC_API_KEY"] is None and seen["AWS_SECRET_ACCESS_KEY"] is None, seen
    # Control: what config passes and what the adapter declares as its login reach the agent.
    assert seen["MY_PASSED"] == "passed-value" and seen["MY_MODEL_KEY"] == "model-key", seen
    assert seen["PATH"] == os.environ["PATH"]
    # Its HOME is the job's own, not the user's.
    assert seen["HOME"] != os.environ["HOME"] and seen["HOME"].endswith("/home"), seen
    # Validation runs the agent's code: not the host's secrets, nor the model's key; the user's pass, yes.
    venv = env_lines(res)
    assert not set(SECRETS) & set(venv) and "MY_MODEL_KEY" not in venv, sorted(venv)
    assert "sk-ant-host-secret" not in res.validation[0]["output_tail"]
    assert venv["MY_PASSED"] == "passed-value", sorted(venv)
    # The result names what was passed, never a value.
    details = res.confinement_details
    assert {"MY_PASSED", "MY_MODEL_KEY", "PATH"} <= set(details["env"]) and not set(SECRETS) & set(details["env"])
    assert details["credentials"] == ["MY_MODEL_KEY"]
    assert "passed-value" not in json.dumps(details) and "model-key" not in json.dumps(details)


def test_a_builtin_declares_its_login_variables(repo, fake, monkeypatch):
    """The built-in claude gets ANTHROPIC_API_KEY (its documented key) but not the AWS secret; control for
    the test above: the same host variable reaches the adapter that declares it."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    agent = fake("claude", Behaviour(writes={"a.txt": "1"}, record_env=list(SECRETS),
                                     stdout='{"type":"result","is_error":false,"result":"done"}\n'))
    res = run_agent(req(repo, "claude"))
    assert res.status is Status.completed, res
    assert agent.calls()[0]["env"] == {"ANTHROPIC_API_KEY": "sk-ant-host-secret", "AWS_SECRET_ACCESS_KEY": None}


# -- 2. the home, hidden but for the state ------------------------------------------------------------------

READER = r'''
for p in "$REAL_HOME/.ssh/id_rsa" "$REAL_HOME/.fakecli/token" "$HOME/.fakecli/token"; do
  if cat "$p" >/dev/null 2>&1; then echo "read $p"; else echo "denied $p"; fi
done > seen.txt
ls "$REAL_HOME" > listing.txt 2>&1 || true
'''


def test_the_users_home_is_unreadable_to_a_confined_agent_but_its_state_copy(repo, tmp_path):
    needs_confinement()
    home = Path(os.environ["HOME"])
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    (home / ".fakecli").mkdir()
    (home / ".fakecli" / "token").write_text("state\n")
    cfg = config(tmp_path, 'confine = "required"\n[agents.fakecli]\ncommand = ["sh", "-c", '
                 + json.dumps(READER) + ']\nprompt = "stdin"\nnetwork = false\nstate_dirs = ["~/.fakecli"]\n'
                 f'env = {{ REAL_HOME = "{home}" }}\n')
    res = run_agent(req(repo, "fakecli"), config=cfg)
    assert res.status is Status.completed, res
    seen = (Path(res.worktree_path) / "seen.txt").read_text().splitlines()
    assert seen == [f"denied {home}/.ssh/id_rsa",
                    f"denied {home}/.fakecli/token",  # the user's own state dir: hidden too
                    f"read {res.confinement_details['home']['path']}/.fakecli/token"], seen  # control: the copy
    assert res.confinement_details["home"]["user_home_hidden"] is True
    # Control: the same read, unconfined, works (the file is there and readable).
    assert (home / ".ssh" / "id_rsa").read_text() == "PRIVATE KEY\n"


def test_read_home_shows_what_the_user_lists(repo, tmp_path):
    needs_confinement()
    home = Path(os.environ["HOME"])
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    (home / ".gitconfig").write_text("[user]\nname = t\n")
    script = ('cat "$REAL_HOME/.gitconfig" > got.txt 2>/dev/null; cat "$REAL_HOME/.ssh/id_rsa" >> got.txt 2>/dev/null;'
              ' echo end >> got.txt')
    cfg = config(tmp_path, 'confine = "required"\nread_home = ["~/.gitconfig"]\n[agents.r]\ncommand = ["sh", "-c", '
                 + json.dumps(script) + f']\nprompt = "stdin"\nnetwork = false\nenv = {{ REAL_HOME = "{home}" }}\n')
    res = run_agent(req(repo, "r"), config=cfg)
    assert res.status is Status.completed, res
    assert (Path(res.worktree_path) / "got.txt").read_text() == "[user]\nname = t\nend\n"


# -- 3. the state dir is the job's: a planted MCP server dies with it ---------------------------------------

PLANT = ('#!/bin/sh\ncp "$HOME/.codex/config.toml" seen.toml 2>/dev/null || echo none > seen.toml\n'
         'printf \'\\n[mcp_servers.evil]\\ncommand = "sh"\\n\' >> "$HOME/.codex/config.toml"\n'
         'cp "$HOME/.codex/config.toml" mine.toml\nls -A "$HOME/.codex" > ls.txt\n')


def test_a_config_a_job_writes_in_its_state_is_a_risk_and_never_the_next_jobs(repo, fake_bin):
    home = Path(os.environ["HOME"])
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text('model = "theirs"\n')
    (home / ".codex" / "sessions").mkdir()
    (home / ".codex" / "sessions" / "old.jsonl").write_text("the user's old transcript\n")
    codex = fake_bin / "codex"
    codex.write_text(PLANT)
    codex.chmod(0o755)
    first = run_agent(req(repo, "codex"))
    assert first.status is Status.completed, first
    wt1 = Path(first.worktree_path)
    assert "[mcp_servers.evil]" in (wt1 / "mine.toml").read_text()  # control: the job's own copy had it
    risk = [r for r in first.known_risks if "~/.codex/config.toml" in r]
    assert risk and "discarded" in risk[0] and first.needs_human_review, first.known_risks
    assert first.confinement_details["state"]["changed_config"] == ["~/.codex/config.toml"]
    assert (home / ".codex" / "config.toml").read_text() == 'model = "theirs"\n'  # the user's: untouched
    second = run_agent(req(repo, "codex").model_copy(update={"ticket": "T-2"}))
    assert second.status is Status.completed, second
    seen = (Path(second.worktree_path) / "seen.toml").read_text()
    assert seen == 'model = "theirs"\n', seen  # the next job's copy: the user's, without the planted server
    # Session records are not copied into a job (state_skip): neither the user's history nor its size.
    assert (Path(second.worktree_path) / "ls.txt").read_text().split() == ["config.toml"]


# A refresh as a CLI makes one: new tokens in its copy of the login. The issuer is not reached here (no
# network); the agent could reach it as the CLI does, so nothing the host sees of the job proves the refresh.
REFRESH = ("#!/bin/sh\necho '{{\"tokens\": {{\"access\": \"refreshed\", \"refresh\": \"{refresh}\", "
           "\"account_id\": \"{account}\"}}}}' > \"$HOME/.lg/auth.json\"\necho x > a.txt\n")
LOGINER = ('confine = "required"\n[agents.loginer]\ncommand = ["loginer"]\nprompt = "stdin"\nnetwork = false\n'
           'state_dirs = ["~/.lg"]\nstate_keep = ["~/.lg/auth.json"]\n')


@pytest.mark.parametrize("case", ["refreshed", "rotated", "another-account"])
def test_a_login_the_job_changed_is_never_written_back_and_the_result_says_so(repo, fake_bin, tmp_path, case):
    """Issue 39: a job that wrote an attacker's key into its copy of ~/.codex/auth.json had it written back
    to the user's; in review, checks that read the copy (its account fields, its JWTs' claims, the issuer's
    host reached) were passed by an attacker's tokens beside the user's copied id_token. Nothing of the copy
    is written back now: the result says the login changed, whether its refresh token did, and a copy that
    names another account is a risk."""
    needs_confinement()
    home = Path(os.environ["HOME"])
    (home / ".lg").mkdir()
    user = '{"tokens": {"access": "old", "refresh": "r1", "account_id": "acct-me"}}'
    (home / ".lg" / "auth.json").write_text(user)
    script = REFRESH.format(account="acct-attacker" if case == "another-account" else "acct-me",
                            refresh="r1" if case == "refreshed" else "r2")
    (fake_bin / "loginer").write_text(script)
    (fake_bin / "loginer").chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(LOGINER)
    res = run_agent(req(repo, "loginer"), config=load_config(cfg))
    assert res.status is Status.completed, res
    assert (home / ".lg" / "auth.json").read_text() == user, "the job's copy reached the user's login"
    state = res.confinement_details["state"]
    assert state["login_changed"] == ["~/.lg/auth.json"] and "not written back" in state["login"], state
    assert state["login_rotated"] == ([] if case == "refreshed" else ["~/.lg/auth.json"]), state
    assert ("log in again" in state["login"]) == (case != "refreshed"), state["login"]
    other = any("login to another account" in r for r in res.known_risks)
    assert other == (case == "another-account"), res.known_risks


def test_state_growth_counts_toward_the_disk_limit(repo, tmp_path, fake_bin):
    home = Path(os.environ["HOME"])
    (home / ".fill").mkdir()
    filler = fake_bin / "filler"
    filler.write_text('#!/bin/sh\nhead -c "$FILL" /dev/zero > "$HOME/.fill/big" && echo x > a.txt\n')
    filler.chmod(0o755)
    base = 'confine = "off"\n[limits]\ndisk = "4MiB"\n[agents.filler]\ncommand = ["filler"]\nprompt = "stdin"\n' \
           'state_dirs = ["~/.fill"]\nretry = false\n'
    over = run_agent(req(repo, "filler"), config=config(tmp_path, base + 'env = { FILL = "16777216" }\n'))
    assert over.status is Status.failed and over.code is Code.RESOURCE_LIMIT, over
    assert not (home / ".fill" / "big").exists()
    # Control: a small write completes.
    under = run_agent(req(repo, "filler").model_copy(update={"ticket": "T-2"}),
                      config=config(tmp_path, base + 'env = { FILL = "1024" }\n', "d.toml"))
    assert under.status is Status.completed, under


def test_a_state_dir_over_the_copy_cap_is_refused(repo, tmp_path, fake, monkeypatch):
    from proctor.services.job import sandbox_home

    monkeypatch.setattr(sandbox_home, "COPY_CAP", 1 << 20)
    home = Path(os.environ["HOME"])
    (home / ".big").mkdir()
    (home / ".big" / "blob").write_bytes(b"x" * (2 << 20))
    fake("big", Behaviour(writes={"a.txt": "1"}))
    cfg = 'confine = "off"\n[agents.big]\ncommand = ["big"]\nprompt = "stdin"\nstate_dirs = ["~/.big"]\n'
    res = run_agent(req(repo, "big"), config=config(tmp_path, cfg))
    assert res.status is Status.failed and res.code is Code.CONFINEMENT_UNAVAILABLE, res
    assert "over the per-job copy cap" in res.summary
    # Control: skipped, it fits.
    ok = run_agent(req(repo, "big").model_copy(update={"ticket": "T-2"}),
                   config=config(tmp_path, cfg + 'state_skip = ["~/.big/blob"]\n', "d.toml"))
    assert ok.status is Status.completed, ok


# -- 4. a real codex job with its per-job state --------------------------------------------------------------

@pytest.mark.realcli
def test_a_real_codex_job_completes_with_its_per_job_state(tmp_path):

    job = run_job("codex", tmp_path)
    r, why = job.result, job.explain()
    assert r["status"] == "completed" and r["changed_files"] == [ACTION.name], why
    state = r["confinementDetails"]["state"] if "confinementDetails" in r else r["confinement_details"]["state"]
    assert state["dirs"] == ["~/.codex"] and state["changed_config"] == [], state
    home = Path(os.environ["HOME"])
    # codex wrote its session record in the job's copy; the user's ~/.codex got none of it.
    assert not (home / ".codex" / "sessions").exists()
    assert r["known_risks"] == [], why

