"""One job's words never back off or open the adapter for everyone (issue: limits and faults, item 5).

The breaker is kept per credential pool (the adapter and the key/base URL its agent sees) and moves only on
what the host can trust: exits, its own deadline, and an HTTP status in a field of the CLI's protocol. Each
case runs real fake-CLI processes through `run_agent` and counts launches, beside a control where the same
shape of run does move the breaker.
"""

from __future__ import annotations

import json

from proctor.mechanisms.config.load import load_config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.adapters.testing import Behaviour

from conftest import make_repo

PASS = "true"


def req(repo, **kw) -> RunAgentRequest:
    return RunAgentRequest.model_validate({"agent": "claude", "task": "t", "repo": str(repo), "ticket": "T1",
                                           "validateCommand": PASS, **kw})


def structured_429() -> str:
    """What claude -p --output-format stream-json prints when the API refused with 429 (measured shape)."""
    return json.dumps({"type": "result", "subtype": "success", "is_error": True, "api_error_status": 429,
                       "result": "API Error: Request rejected (429) · rate limited"}) + "\n"


def test_a_rate_limit_in_an_agents_text_backs_off_only_its_own_job(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "key-one")
    agent = fake("claude", Behaviour(exit_codes=[1], stderr="Error: rate limit exceeded\n"))
    res = run_agent(req(make_repo(tmp_path / "a")))
    assert res.status is Status.rate_limited and res.code is Code.RATE_LIMITED  # its own verdict: a claim
    assert res.breaker["signal"] == "neutral" and "claim" in res.breaker["source"], res.breaker
    # Another sender's job on another repo, same adapter and key: it runs (and completes).
    agent.set(Behaviour(writes={"a.txt": "1"}))
    before = len(agent.calls())
    other = run_agent(req(make_repo(tmp_path / "b")))
    assert other.status is Status.completed and len(agent.calls()) == before + 1, other
    # Three such jobs in a row open nothing either.
    agent.set(Behaviour(exit_codes=[1], stderr="429 Too Many Requests: rate_limit_error\n"))
    for _ in range(3):
        assert run_agent(req(make_repo(tmp_path / f"c{_}"))).code is Code.RATE_LIMITED
    agent.set(Behaviour(writes={"a.txt": "1"}))
    assert run_agent(req(make_repo(tmp_path / "d"))).status is Status.completed


def test_control_a_429_in_the_clis_protocol_backs_off_the_pool_and_only_the_pool(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "key-one")
    agent = fake("claude", Behaviour(exit_codes=[1], stdout=structured_429()))
    res = run_agent(req(make_repo(tmp_path / "a")))
    assert res.status is Status.rate_limited and len(agent.calls()) == 1  # never retried
    assert res.breaker["signal"] == "rate_limited"
    assert res.breaker["source"] == "HTTP 429 in the CLI's result.api_error_status", res.breaker
    pool = res.breaker["pool"]
    assert pool.startswith("claude@") and "key-one" not in pool  # a digest of the key, never the key

    agent.set(Behaviour(writes={"a.txt": "1"}))
    held = run_agent(req(make_repo(tmp_path / "b")))  # same key: backing off, nothing launched
    assert held.code is Code.RATE_LIMITED and "backing off" in held.summary and len(agent.calls()) == 1
    assert held.breaker == {"pool": pool, "admitted": False, "retry_at": held.breaker["retry_at"]}

    monkeypatch.setenv("ANTHROPIC_API_KEY", "key-two")  # another credential pool: not held back
    other = run_agent(req(make_repo(tmp_path / "c")))
    assert other.status is Status.completed and len(agent.calls()) == 2, other
    assert other.breaker["pool"] != pool and other.breaker["signal"] == "success"


def test_a_declared_pool_is_shared_by_adapters_that_name_it(tmp_path, fake):
    cfg = tmp_path / "c.toml"
    cfg.write_text('confine = "off"\n'
                   '[agents.one]\ncommand = ["one", "{prompt}"]\noutput = "claude-stream-json"\npool = "team-key"\n'
                   '[agents.two]\ncommand = ["two", "{prompt}"]\noutput = "claude-stream-json"\npool = "team-key"\n'
                   '[agents.three]\ncommand = ["two", "{prompt}"]\noutput = "claude-stream-json"\n')
    config = load_config(cfg)
    fake("one", Behaviour(exit_codes=[1], stdout=structured_429()))
    two = fake("two", Behaviour(writes={"a.txt": "1"}))
    assert run_agent(req(make_repo(tmp_path / "a"), agent="one"), config=config).breaker["pool"] == "team-key"
    held = run_agent(req(make_repo(tmp_path / "b"), agent="two"), config=config)
    assert held.code is Code.RATE_LIMITED and two.calls() == []
    free = run_agent(req(make_repo(tmp_path / "c"), agent="three"), config=config)  # its own pool
    assert free.status is Status.completed and len(two.calls()) == 1


def test_server_errors_in_the_protocol_open_the_circuit_and_a_plain_crash_counts_too(tmp_path, fake):
    cfg = tmp_path / "c.toml"
    cfg.write_text('confine = "off"\n[breaker]\nthreshold = 2\ncooldown_s = 3600\n')
    config = load_config(cfg)
    overloaded = json.dumps({"type": "result", "is_error": True, "api_error_status": 529,
                             "result": "API Error: overloaded"}) + "\n"
    agent = fake("claude", Behaviour(exit_codes=[1], stdout=overloaded))
    first = run_agent(req(make_repo(tmp_path / "a")), config=config)
    assert first.code is Code.AGENT_FAILED and first.breaker["source"] == "HTTP 529 in the CLI's result.api_error_status"
    agent.set(Behaviour(exit_codes=[1]))  # an exit the host saw: a failure whatever was printed
    second = run_agent(req(make_repo(tmp_path / "b")), config=config)
    assert second.breaker == {**second.breaker, "signal": "failure", "state": "open"}
    launched = len(agent.calls())
    agent.set(Behaviour(writes={"a.txt": "1"}))
    refused = run_agent(req(make_repo(tmp_path / "c")), config=config)
    assert refused.code is Code.CIRCUIT_OPEN and len(agent.calls()) == launched
