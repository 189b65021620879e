"""The per-adapter circuit breaker: opens on consecutive failures, backs off on rate limits, one half-open
trial, state shared through the ledger file, every transition a ledger row. Time is a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Clock

from proctor.contract import Code, Status
from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger
from proctor.mechanisms.policy.breaker import TRANSITION_KIND, Breaker, BreakerState, Signal, evidence_for


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    return fresh_home


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000.0)


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / LEDGER_FILE) as led:
        yield led


@pytest.fixture
def breaker(ledger, clock) -> Breaker:
    return Breaker(ledger, threshold=3, cooldown_s=60, backoff_s=10, clock=clock)


def fail(b: Breaker, n: int, adapter: str = "codex") -> None:
    for _ in range(n):
        b.record(adapter, Signal.failure)


def test_opens_after_threshold_consecutive_failures(breaker):
    fail(breaker, 2)
    assert breaker.admit("codex").allowed  # control: one short of the threshold
    fail(breaker, 1)
    a = breaker.admit("codex")
    assert not a.allowed and a.code is Code.CIRCUIT_OPEN and a.retry_at == 1_060.0
    assert "3 consecutive failures" in a.reason
    assert breaker.admit("claude").allowed  # per adapter


def test_success_resets_the_count(breaker):
    fail(breaker, 2)
    breaker.record("codex", Signal.success)
    fail(breaker, 2)
    assert breaker.admit("codex").allowed and breaker.status("codex").failures == 2


def test_neutral_neither_counts_nor_resets(breaker):
    fail(breaker, 2)
    breaker.record("codex", Signal.neutral)
    assert breaker.status("codex").failures == 2
    fail(breaker, 1)
    assert not breaker.admit("codex").allowed


def test_cooldown_then_one_trial(breaker, clock):
    fail(breaker, 3)
    clock.now += 59
    assert not breaker.admit("codex").allowed
    clock.now += 1
    trial = breaker.admit("codex")
    assert trial.allowed and trial.trial and breaker.status("codex").state is BreakerState.half_open
    second = breaker.admit("codex")
    assert not second.allowed and second.code is Code.CIRCUIT_OPEN and "trial" in second.reason


def test_trial_success_closes(breaker, clock):
    fail(breaker, 3)
    clock.now += 60
    assert breaker.admit("codex").trial
    st = breaker.record("codex", Signal.success)
    assert st.state is BreakerState.closed and st.failures == 0
    assert breaker.admit("codex").allowed and not breaker.admit("codex").trial


def test_trial_failure_reopens_for_a_new_cooldown(breaker, clock):
    fail(breaker, 3)
    clock.now += 60
    assert breaker.admit("codex").trial
    assert breaker.record("codex", Signal.failure).state is BreakerState.open
    a = breaker.admit("codex")
    assert not a.allowed and a.retry_at == clock.now + 60


@pytest.mark.parametrize("signal", [Signal.neutral, Signal.rate_limited])
def test_trial_showing_nothing_of_the_backend_is_released(breaker, clock, signal):
    fail(breaker, 3)
    clock.now += 60
    assert breaker.admit("codex").trial
    assert not breaker.admit("codex").allowed
    breaker.record("codex", signal)
    clock.now += 10  # past the rate-limit backoff as well
    st = breaker.status("codex")
    assert st.state is BreakerState.half_open and st.trial_at is None
    assert breaker.admit("codex").trial


def test_lost_trial_is_released_after_a_cooldown(breaker, clock):
    fail(breaker, 3)
    clock.now += 60
    assert breaker.admit("codex").trial
    clock.now += 59
    assert not breaker.admit("codex").allowed
    clock.now += 1
    assert breaker.admit("codex").trial


def test_rate_limit_backs_off_but_never_opens(breaker, clock):
    for _ in range(5):
        breaker.record("codex", Signal.rate_limited)
    st = breaker.status("codex")
    assert st.state is BreakerState.closed and st.failures == 0
    a = breaker.admit("codex")
    assert not a.allowed and a.code is Code.RATE_LIMITED and a.retry_at == clock.now + 10
    clock.now += 10
    assert breaker.admit("codex").allowed


def test_rate_limit_honours_retry_after_capped_by_cooldown(breaker, clock):
    breaker.record("codex", Signal.rate_limited, retry_after_s=30)
    assert breaker.admit("codex").retry_at == clock.now + 30
    breaker.record("codex", Signal.rate_limited, retry_after_s=10_000)
    assert breaker.admit("codex").retry_at == clock.now + 60


def test_threshold_and_cooldown_configurable(ledger, clock):
    b = Breaker(ledger, threshold=1, cooldown_s=5, clock=clock)
    b.record("x", Signal.failure)
    assert not b.admit("x").allowed
    clock.now += 5
    assert b.admit("x").trial


def test_bad_configuration_refused(ledger):
    for kwargs in ({"threshold": 0}, {"cooldown_s": 0}, {"backoff_s": -1}):
        with pytest.raises(ValueError):
            Breaker(ledger, **kwargs)


def test_state_is_shared_through_the_file(tmp_path, clock):
    path = tmp_path / "shared" / LEDGER_FILE
    with Ledger(path) as a, Ledger(path) as b:
        fail(Breaker(a, clock=clock), 3)
        assert not Breaker(b, clock=clock).admit("codex").allowed


def test_transitions_are_ledger_rows(breaker, ledger, clock):
    fail(breaker, 3)
    clock.now += 60
    breaker.admit("codex", job_id="j1")
    breaker.record("codex", Signal.success, job_id="j1")
    rows = ledger.rows(kind=TRANSITION_KIND)
    assert [(r.payload["from"], r.payload["to"]) for r in rows] == [
        ("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    assert rows[-1].job_id == "j1" and rows[0].payload["failures"] == 3
    assert ledger.verify() == []


@pytest.mark.parametrize("status,code,backend,signal", [
    (Status.completed, Code.OK, None, Signal.success),
    (Status.failed, Code.VALIDATION_FAILED, None, Signal.success),
    (Status.failed, Code.AGENT_FAILED, None, Signal.failure),
    (Status.timed_out, Code.TIMED_OUT, None, Signal.failure),
    # A rate limit read from the agent's text is a claim: it moves nothing shared.
    (Status.rate_limited, Code.RATE_LIMITED, None, Signal.neutral),
    (Status.rate_limited, Code.RATE_LIMITED, 429, Signal.rate_limited),
    (Status.failed, Code.AGENT_FAILED, 529, Signal.failure),
    (Status.failed, Code.AGENT_FAILED, 401, Signal.failure),
    (Status.failed, Code.STOPPED, None, Signal.neutral),
    (Status.failed, Code.RESOURCE_LIMIT, None, Signal.neutral),
    (Status.failed, Code.INVALID_REQUEST, None, Signal.neutral),
    (Status.approval_required, Code.APPROVAL_REQUIRED, None, Signal.neutral),
    (Status.failed, Code.CIRCUIT_OPEN, None, Signal.neutral),
])
def test_evidence_for_run_agent_results(status, code, backend, signal):
    found = evidence_for(status, code, backend, "result.api_error_status")
    assert found.signal is signal and found.source
