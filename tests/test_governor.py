"""The spend governor over a real SQLite tally: budgets admit up to their limits and deny past them with when
the window frees, bookings settle to what the CLI reported or are released, windows roll over, a job under
several budgets is all-or-nothing, an unreadable tally fails closed, and a malformed budget in the trusted
policy is a clear error. Time is a fake clock; every denial has its control."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Clock

from proctor.mechanisms.adapters.output import Usage
from proctor.contract import Code
from proctor.mechanisms.policy.budget import PERIODS, BudgetTable
from proctor.mechanisms.policy.governor import Booking, Denial, UsageGovernor
from proctor.mechanisms.policy.windows import iso, key_for
from proctor.mechanisms.policy.tally import SqliteTally, Tally, Versioned
from proctor.mechanisms.policy.trusted import Policy, PolicyError

HOUR = PERIODS["hour"]
T0 = 1_796_256_000.0 + 600  # 2026-12-03 00:10 UTC: 10 minutes into an hour and a day


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def tally(tmp_path):
    t = SqliteTally(tmp_path / "usage.sqlite3")
    yield t
    t.close()


def budget(name: str, **table):
    return BudgetTable.model_validate(table).build(name)


def governor(tally: Tally, clock: Clock, *budgets, lane=None) -> UsageGovernor:
    return UsageGovernor(list(budgets), lambda: tally, lane=lane, clock=clock)


def usage(tokens_in: int, tokens_out: int, usd: float | None = None) -> Usage:
    return Usage(tokens_in, tokens_out, usd, "test")


def spent(gov: UsageGovernor, name: str, period: str = "hour") -> dict:
    (row,) = [s for s in gov.spend() if s.budget.name == name]
    return row.windows[period].spent.as_dict()


def test_a_budget_admits_up_to_its_limit_then_denies_with_when_the_window_frees(tally, clock):
    gov = governor(tally, clock, budget("claude-hour", agent="claude", runs_per_hour=2))
    first, second = gov.book("claude", "j1"), gov.book("claude", "j2")
    assert isinstance(first, Booking) and isinstance(second, Booking)  # control: within the limit
    assert first.store == "sqlite" and [p.budget for p in first.parts] == ["claude-hour"]
    third = gov.book("claude", "j3")
    assert isinstance(third, Denial) and third.code is Code.BUDGET_DENIED
    assert third.retry_at == T0 - 600 + HOUR  # the end of the hour the runs were booked in
    assert "runs_per_hour 2" in third.reason and iso(third.retry_at) in third.reason
    assert third.record()["denied"] == [{"budget": "claude-hour", "limit": "runs_per_hour", "allowed": 2,
                                         "spent": 2, "booked": 1, "frees_at": iso(third.retry_at)}]
    assert spent(gov, "claude-hour")["runs"] == 2  # the denial wrote nothing
    # Another agent is another pool: not covered, not counted.
    other = gov.book("codex", "j4")
    assert isinstance(other, Booking) and other.parts == ()


def test_the_next_window_frees_a_unit_and_a_day_limit_still_holds(tally, clock):
    gov = governor(tally, clock, budget("b", agent="claude", runs_per_hour=1, runs_per_day=2))
    assert isinstance(gov.book("claude", "j1"), Booking)
    held = gov.book("claude", "j2")
    assert isinstance(held, Denial) and held.retry_at == T0 - 600 + HOUR
    clock.now = held.retry_at  # the first second of the next hour
    assert isinstance(gov.book("claude", "j3"), Booking)
    clock.now += HOUR
    day = gov.book("claude", "j4")
    assert isinstance(day, Denial) and [o.limit.key for o in day.over] == ["runs_per_day"]
    assert day.retry_at == T0 - 600 + PERIODS["day"]


def test_tokens_book_the_estimate_and_settle_to_what_the_cli_reported(tally, clock):
    gov = governor(tally, clock, budget("t", agent="codex", tokens_per_hour=10_000, tokens_per_run=4_000))
    a, b = gov.book("codex", "j1"), gov.book("codex", "j2")
    assert isinstance(a, Booking) and isinstance(b, Booking)
    denied = gov.book("codex", "j3")  # 8,000 booked + 4,000 > 10,000
    assert isinstance(denied, Denial) and denied.over[0].spent == 8_000 and denied.over[0].booked == 4_000
    done = gov.settle(a, usage(700, 300))
    assert done.how == "usage" and done.error is None and dict(done.charged)["t"].tokens == 1_000
    assert spent(gov, "t")["tokens"] == 5_000
    assert isinstance(gov.book("codex", "j3"), Booking)  # the same request, now with room: admitted


def test_dollars_settle_to_the_stated_cost_and_keep_the_estimate_without_one(tally, clock):
    gov = governor(tally, clock, budget("usd", lane="fast", usd_per_day=1.0, usd_per_run=0.4), lane="fast")
    a, b = gov.book("claude", "j1"), gov.book("gemini", "j2")
    assert isinstance(a, Booking) and isinstance(b, Booking)
    assert isinstance(gov.book("codex", "j3"), Denial)  # 0.8 + 0.4 > 1.0
    gov.settle(a, usage(10, 5, usd=0.05))  # claude states its cost
    gov.settle(b, usage(10, 5))  # gemini does not: its estimate stands
    assert spent(gov, "usd", "day")["usd"] == pytest.approx(0.45)
    assert isinstance(gov.book("codex", "j3"), Booking)
    # A job on another lane (or none: a local job) is not in this pool.
    assert governor(tally, clock, budget("usd", lane="fast", usd_per_day=1.0, usd_per_run=0.4)).book(
        "codex", "j4").parts == ()


def test_a_run_that_never_launched_gives_its_booking_back(tally, clock):
    gov = governor(tally, clock, budget("one", agent="claude", runs_per_hour=1, tokens_per_hour=100,
                                        tokens_per_run=60))
    first = gov.book("claude", "j1")
    assert isinstance(first, Booking)
    assert isinstance(gov.book("claude", "j2"), Denial)
    released = gov.release(first)
    assert released.how == "released" and spent(gov, "one") == {"runs": 0, "tokens": 0, "usd": 0.0}
    assert isinstance(gov.book("claude", "j2"), Booking)


def test_a_cost_stated_without_tokens_keeps_the_token_estimate(tally, clock):
    from proctor.mechanisms.adapters.output import _claude_usage

    gov = governor(tally, clock, budget("t", agent="claude", tokens_per_hour=10_000, tokens_per_run=4_000))
    stated = _claude_usage({"total_cost_usd": 0.25})  # no `usage` object in the result event
    assert stated is not None and not stated.tokens_stated and stated.as_dict()["tokens_in"] is None
    gov.settle(gov.book("claude", "j1"), stated)
    assert spent(gov, "t")["tokens"] == 4_000
    # The control: stated tokens replace the estimate.
    gov.settle(gov.book("claude", "j2"), _claude_usage({"total_cost_usd": 0.1, "usage": {"input_tokens": 10,
                                                                                         "output_tokens": 5}}))
    assert spent(gov, "t")["tokens"] == 4_015


def test_settling_without_a_report_keeps_the_estimate(tally, clock):
    gov = governor(tally, clock, budget("t", agent="grok", tokens_per_hour=1_000, tokens_per_run=400))
    booked = gov.book("grok", "j1")
    done = gov.settle(booked, None)  # a text CLI says nothing of its usage
    assert done.how == "estimate" and spent(gov, "t")["tokens"] == 400


def test_a_job_under_several_budgets_is_told_every_limit_and_when_the_last_frees(tally, clock):
    per_agent = budget("a-agent", agent="claude", runs_per_hour=1)
    per_lane = budget("b-lane", lane="fast", runs_per_day=1)
    both = budget("c-both", agent="claude", lane="fast", runs_per_hour=5)
    gov = governor(tally, clock, per_agent, per_lane, both, lane="fast")
    first = gov.book("claude", "j1")
    assert isinstance(first, Booking) and [p.budget for p in first.parts] == ["a-agent", "b-lane", "c-both"]
    second = gov.book("claude", "j2")
    assert isinstance(second, Denial)
    assert sorted(o.budget for o in second.over) == ["a-agent", "b-lane"]
    assert second.retry_at == T0 - 600 + PERIODS["day"]  # both must free: the later one
    assert spent(gov, "c-both")["runs"] == 1  # nothing of the denied job was booked anywhere


class RacedTally:
    """The Tally seam with a competitor: just before this governor's first write to `key`, another governor
    takes that budget's last unit (what a second host does between our read and our write)."""

    store = "sqlite"

    def __init__(self, inner: SqliteTally, key: str, competitor) -> None:
        self.inner, self.key, self.competitor, self.fired = inner, key, competitor, False

    def get(self, key: str) -> Versioned | None:
        return self.inner.get(key)

    def _race(self, key: str) -> None:
        if key == self.key and not self.fired:
            self.fired = True
            assert isinstance(self.competitor(), Booking)

    def create(self, key: str, value: bytes) -> int | None:
        self._race(key)
        return self.inner.create(key, value)

    def update(self, key: str, value: bytes, last: int) -> int | None:
        self._race(key)
        return self.inner.update(key, value, last)

    def close(self) -> None:
        pass


class LostReplyTally(RacedTally):
    """A write that goes in, then its reply is lost (a failover): the store answers as if it had lost."""

    def __init__(self, inner: SqliteTally, lose: int) -> None:
        self.inner, self.lose = inner, lose

    def create(self, key: str, value: bytes) -> int | None:
        got = self.inner.create(key, value)
        return self._lost(got)

    def update(self, key: str, value: bytes, last: int) -> int | None:
        return self._lost(self.inner.update(key, value, last))

    def _lost(self, got: int | None) -> int | None:
        if got is not None and self.lose > 0:
            self.lose -= 1
            return None
        return got


@pytest.mark.parametrize("lose", [0, 1])
def test_a_write_whose_reply_was_lost_is_counted_once(tally, clock, lose):
    one = budget("one", agent="claude", runs_per_hour=5)
    gov = UsageGovernor([one], lambda: LostReplyTally(tally, lose), clock=clock)
    booked = gov.book("claude", "j1")  # lose=1: its create went in, the answer said it lost
    assert isinstance(booked, Booking)
    assert spent(governor(tally, clock, one), "one")["runs"] == 1  # lose=0 is the control
    second = gov.book("claude", "j2")
    assert spent(governor(tally, clock, one), "one")["runs"] == 2
    gov = UsageGovernor([one], lambda: LostReplyTally(tally, lose), clock=clock)
    gov.release(second)  # an update that goes in and is answered as lost
    assert spent(governor(tally, clock, one), "one")["runs"] == 1


def test_losing_the_last_unit_of_one_budget_gives_back_the_others(tally, clock):
    roomy = budget("a-roomy", agent="claude", runs_per_hour=10)
    tight = budget("b-tight", agent="claude", runs_per_hour=1)
    rival = governor(tally, clock, tight)
    raced = RacedTally(tally, key_for(tight), lambda: rival.book("claude", "rival"))
    gov = UsageGovernor([roomy, tight], lambda: raced, clock=clock)
    lost = gov.book("claude", "j1")
    assert isinstance(lost, Denial) and lost.code is Code.BUDGET_DENIED and gov.conflicts == 1
    assert [o.budget for o in lost.over] == ["b-tight"]
    check = governor(tally, clock, roomy, tight)
    assert spent(check, "a-roomy")["runs"] == 0  # its booking was given back
    assert spent(check, "b-tight")["runs"] == 1  # the rival's
    # Control: without the rival the same job books both.
    clock.now += HOUR
    assert isinstance(governor(tally, clock, roomy, tight).book("claude", "j2"), Booking)


def test_a_settlement_after_the_window_closed_leaves_the_new_window_alone(tally, clock):
    gov = governor(tally, clock, budget("t", agent="codex", tokens_per_hour=10_000, tokens_per_run=5_000))
    booked = gov.book("codex", "j1")
    clock.now = T0 - 600 + HOUR + 1  # the run ended in the next hour
    fresh = gov.book("codex", "j2")
    done = gov.settle(booked, usage(100, 50))
    assert done.closed == ("t",)
    assert spent(gov, "t")["tokens"] == 5_000  # only j2's estimate: j1 counted in the hour it was booked in
    assert spent(gov, "t", "day")["tokens"] == 5_150  # the day window was still open: settled there
    assert isinstance(fresh, Booking)


def test_an_unreadable_tally_value_fails_closed(tally, clock):
    b = budget("b", agent="claude", runs_per_hour=5)
    tally.create(key_for(b), b"{not json")
    denied = governor(tally, clock, b).book("claude", "j1")
    assert isinstance(denied, Denial) and denied.code is Code.BUDGET_UNAVAILABLE
    assert "unreadable" in denied.reason and "nothing was launched" in denied.reason
    found = tally.get(key_for(b))
    assert tally.update(key_for(b), b'{"v": 1, "windows": {}}', found.revision) is not None
    assert isinstance(governor(tally, clock, b).book("claude", "j1"), Booking)  # control: a readable value


def test_no_covering_budget_books_nothing_and_opens_no_tally(clock):
    def never() -> Tally:
        raise AssertionError("the tally was opened for a job no budget covers")

    gov = UsageGovernor([budget("b", agent="claude", runs_per_hour=1)], never, clock=clock)
    got = gov.book("codex", "j1")
    assert isinstance(got, Booking) and got.parts == () and got.store is None
    assert gov.settle(got, usage(1, 1)).charged == ()


def test_the_sqlite_tally_is_a_compare_and_set(tally):
    assert tally.create("k", b"1") == 1
    assert tally.create("k", b"2") is None  # exists: somebody created it first
    assert tally.update("k", b"2", last=7) is None  # a revision that moved
    assert tally.update("k", b"2", last=1) == 2  # control: the revision read
    assert tally.get("k") == Versioned(b"2", 2)


# -- the trusted policy -----------------------------------------------------------------------------------

GOOD = '[budgets.team]\nagent = "claude"\nruns_per_hour = 3\ntokens_per_day = 1000\ntokens_per_run = 100\n'


def write_policy(home: Path, text: str) -> None:
    (home / "policy.toml").write_text(text)


def test_budgets_load_from_the_trusted_policy(proctor_home):
    write_policy(proctor_home, GOOD + '[budgets.lane-fast]\nlane = "fast"\nusd_per_hour = 2.5\nusd_per_run = 0.5\n')
    fast, team = Policy.load().budgets  # in name order
    assert (team.name, team.agent, team.lane) == ("team", "claude", None)
    assert [(lim.key, lim.value) for lim in team.limits] == [("runs_per_hour", 3), ("tokens_per_day", 1000)]
    assert (fast.lane, fast.limits[0].value, fast.estimate.usd_micros) == ("fast", 2_500_000, 500_000)


@pytest.mark.parametrize("table, says", [
    ('agent = "claude"\nruns_per_hour = -1', "budgets.b.runs_per_hour: Input should be greater than or equal to 0"),
    ('agent = "claude"\nruns_per_hour = "ten"', "budgets.b.runs_per_hour: Input should be a valid integer"),
    ('agent = "claude"\nruns_per_hour = true', "budgets.b.runs_per_hour: Input should be a valid integer"),
    ('agent = "claude"\nruns_per_hour = 1.5', "budgets.b.runs_per_hour: Input should be a valid integer"),
    ('agent = "claude"\nrun_per_hour = 3', "budgets.b.run_per_hour: Extra inputs are not permitted"),
    ('runs_per_hour = 3', "budgets.b: names no pool: give agent, lane or both"),
    ('agent = "claude"', "budgets.b: sets no limit"),
    ('agent = "claude"\ntokens_per_hour = 100', "budgets.b: tokens_per_hour needs tokens_per_run"),
    ('agent = "claude"\nusd_per_day = 5.0', "budgets.b: usd_per_day needs usd_per_run"),
    ('agent = "claude"\ntokens_per_hour = 100\ntokens_per_run = 500',
     "budgets.b: tokens_per_run 500 is over tokens_per_hour 100: no run could ever be admitted"),
    ('agent = "claude"\nusd_per_day = inf\nusd_per_run = 1.0', "budgets.b.usd_per_day: Input should be a finite number"),
    ('agent = "claude"\nusd_per_day = nan\nusd_per_run = 1.0', "budgets.b.usd_per_day: Input should be a finite number"),
    ('lane = "fast.lane"\nruns_per_hour = 1', "budgets.b.lane: String should match pattern"),
])
def test_a_malformed_budget_is_a_clear_policy_error(proctor_home, table, says):
    write_policy(proctor_home, GOOD)
    assert Policy.load().budgets  # control: the same file with a good table loads
    write_policy(proctor_home, f"{GOOD}[budgets.b]\n{table}\n")
    with pytest.raises(PolicyError) as err:
        Policy.load()
    assert str(err.value).startswith(f"policy {proctor_home / 'policy.toml'}: "), err.value
    assert says in str(err.value), err.value
    assert "Value error" not in str(err.value)


def test_a_budget_name_that_cannot_be_a_key_is_refused(proctor_home):
    write_policy(proctor_home, '[budgets."team.one"]\nagent = "claude"\nruns_per_hour = 1\n')
    with pytest.raises(PolicyError, match="budgets.team.one"):
        Policy.load()
    write_policy(proctor_home, '[budgets.team-one]\nagent = "claude"\nruns_per_hour = 1\n')
    assert Policy.load().budgets[0].name == "team-one"
