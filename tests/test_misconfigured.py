"""A CLI that cannot run as configured (no login, a bad key, an auth type it rejects) ends the job with its
own code, AGENT_MISCONFIGURED, not retried, the CLI's own line in the summary; measured texts and exit codes
of the real CLIs (research/clis.md), each beside a control: an ordinary failure that is retried."""

from __future__ import annotations

import json

import pytest

from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.adapters.testing import Behaviour


def req(repo, agent: str) -> RunAgentRequest:
    return RunAgentRequest(agent=agent, task="t", repo=str(repo), ticket="T", validateCommand="true")


CLAUDE_NO_LOGIN = json.dumps({"type": "result", "is_error": True, "result": "Not logged in · Please run /login"})
GEMINI_AUTH = json.dumps({"session_id": "s", "error": {"type": "Error", "message": "Invalid auth method selected.",
                                                         "code": 41}})


@pytest.mark.parametrize("agent,behaviour,said", [
    ("claude", Behaviour(exit_codes=[1], stdout=CLAUDE_NO_LOGIN + "\n"), "Not logged in"),
    ("gemini", Behaviour(exit_codes=[41], stderr="Error\n" + GEMINI_AUTH + "\n"), "Invalid auth method selected"),
    ("gemini", Behaviour(exit_codes=[41]), "41"),  # its exit code alone (FatalAuthenticationError)
    ("grok", Behaviour(exit_codes=[1], stderr="❌ Error: API key required. Set GROK_API_KEY\n"), "API key required"),
    ("codex", Behaviour(exit_codes=[1], stdout=json.dumps({"type": "turn.failed", "error": {
        "message": "unexpected status 401 Unauthorized: Incorrect API key provided"}}) + "\n"), "401"),
])
def test_a_cli_that_cannot_run_as_configured_is_misconfigured_and_not_retried(repo, fake, agent, behaviour, said):
    cli = fake(agent, behaviour)
    res = run_agent(req(repo, agent))
    assert res.status is Status.failed and res.code is Code.AGENT_MISCONFIGURED, res
    assert res.attempts == 1 and len(cli.calls()) == 1
    assert said in res.summary and res.summary.startswith(f"{agent} cannot run as configured")
    assert res.breaker["signal"] == "neutral"  # a login problem says nothing of the backend's health


def test_control_an_ordinary_failure_is_retried_once_and_stays_agent_failed(repo, fake):
    cli = fake("gemini", Behaviour(exit_codes=[1], stderr="TypeError: cannot read properties of undefined\n"))
    res = run_agent(req(repo, "gemini"))
    assert res.code is Code.AGENT_FAILED and res.attempts == 2 and len(cli.calls()) == 2


def test_control_exit_zero_with_the_same_words_is_judged_by_validation(repo, fake):
    fake("claude", Behaviour(stdout="Not logged in · Please run /login\n", writes={"a.txt": "1"}))
    assert run_agent(req(repo, "claude")).status is Status.completed
