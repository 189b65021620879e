"""The spend governor in run_agent: a job books its budget before anything launches, a denial is
`rate_limited`/BUDGET_DENIED with `retry_after` and launches nothing (the fake CLI records no call) beside an
allowed run that did launch, and the booking settles to the usage parsed from the CLI's own output (real
claude, codex and gemini output, tests/samples) or is released when nothing ran. Real processes, real SQLite,
the `proctor` CLI where a user would see it."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import make_repo

from proctor.surfaces.cli import main
from proctor.mechanisms.config.load import load_config
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.adapters.testing import Behaviour

SAMPLES = Path(__file__).parent / "samples"
CLAUDE = (SAMPLES / "claude-2.1.197-stream.jsonl").read_text()
CODEX = (SAMPLES / "codex-0.171-exec.jsonl").read_text()
GEMINI = (SAMPLES / "gemini-0.61-stream.jsonl").read_text()
GEMINI_JSON = (SAMPLES / "gemini-0.61.json").read_text()
WRITES = {"out.txt": "done\n"}


# These runs count in the real clock's hour (conftest.clear_of_the_hour).
pytestmark = pytest.mark.usefixtures("clear_of_the_hour")


def request(repo: Path, agent: str = "claude") -> RunAgentRequest:
    return RunAgentRequest.model_validate({"agent": agent, "task": "t", "repo": str(repo), "ticket": "T1",
                                           "validateCommand": "true"})


def policy(home: Path, text: str) -> None:
    (home / "policy.toml").write_text(text)


def hour_end() -> str:
    now = datetime.now(UTC).timestamp()
    return datetime.fromtimestamp((now // 3600 + 1) * 3600, UTC).isoformat(timespec="seconds")


def rows(home: Path, kind: str) -> list[dict]:
    with Ledger(home / "ledger.sqlite3") as led:
        return [r.payload for r in led.rows(kind=kind)]


def usage_json(*args: str) -> dict:
    res = CliRunner().invoke(main, ["usage", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def limit(report: dict, budget: str, key: str) -> dict:
    (row,) = [b for b in report["budgets"] if b["budget"] == budget]
    (lim,) = [lim for lim in row["limits"] if lim["limit"] == key]
    return lim


def test_a_denied_job_is_rate_limited_launches_nothing_and_says_when_the_window_frees(
        tmp_path, fake, proctor_home):
    policy(proctor_home, '[budgets.claude-hour]\nagent = "claude"\nruns_per_hour = 1\n')
    claude = fake("claude", Behaviour(writes=WRITES))
    codex = fake("codex", Behaviour(writes=WRITES))

    first = run_agent(request(make_repo(tmp_path / "a")))
    assert first.status is Status.completed and first.code is Code.OK, first.known_risks
    assert len(claude.calls()) == 1  # control: the allowed run launched
    assert first.budget["budgets"][0]["budget"] == "claude-hour" and first.budget["store"] == "sqlite"
    assert first.budget["how"] == "estimate"  # the fake prints no usage: the booking stands as made

    denied = run_agent(request(make_repo(tmp_path / "b")))
    assert denied.status is Status.rate_limited and denied.code is Code.BUDGET_DENIED
    assert len(claude.calls()) == 1  # nothing launched
    assert denied.attempts == 0 and denied.worktree_path is None and denied.needs_human_review
    assert denied.retry_after == hour_end()
    assert "runs_per_hour 1" in denied.summary and "nothing was launched" in denied.summary
    assert denied.budget["denied"][0]["frees_at"] == denied.retry_after
    assert not (tmp_path / "b" / "repo-agents").exists()  # no worktree was cut either
    (row,) = rows(proctor_home, "usage.denied")
    assert row["jobId"] == denied.job_id and row["code"] == "BUDGET_DENIED"
    ends = {r["jobId"]: r for r in rows(proctor_home, "job.end")}
    assert ends[denied.job_id]["status"] == "rate_limited" and ends[denied.job_id]["code"] == "BUDGET_DENIED"

    # Another agent is another pool: it runs.
    other = run_agent(request(make_repo(tmp_path / "c"), "codex"))
    assert other.status is Status.completed and len(codex.calls()) == 1 and other.budget is None


def test_the_cli_says_a_denial_is_a_refusal(tmp_path, fake, proctor_home):
    policy(proctor_home, '[budgets.claude-hour]\nagent = "claude"\nruns_per_hour = 1\n')
    claude = fake("claude", Behaviour(writes=WRITES))

    def cli(repo: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from proctor.surfaces.cli import main; main()", "run-agent",
                               "--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", "T1",
                               "--validate-cmd", "true"], capture_output=True, text=True, timeout=120)

    ok = cli(make_repo(tmp_path / "a"))
    assert ok.returncode == 0 and json.loads(ok.stdout)["status"] == "completed", ok.stderr
    no = cli(make_repo(tmp_path / "b"))
    out = json.loads(no.stdout)
    assert no.returncode == 1 and out["status"] == "rate_limited" and out["code"] == "BUDGET_DENIED"
    assert out["retry_after"] == hour_end()
    assert "proctor: refused (BUDGET_DENIED): budget 'claude-hour': runs_per_hour 1" in no.stderr
    assert len(claude.calls()) == 1


@pytest.mark.parametrize("output, sample, expected", [
    ("claude-stream-json", CLAUDE, {"tokens_in": 20, "tokens_out": 10, "tokens_cached": 0, "usd": 0.00035,
                                    "source": "result.usage, result.total_cost_usd"}),
    ("codex-jsonl", CODEX, {"tokens_in": 20, "tokens_out": 10, "tokens_cached": 0, "usd": None,
                            "source": "turn.completed.usage"}),
    ("gemini-stream-json", GEMINI, {"tokens_in": 30, "tokens_out": 15, "tokens_cached": 0, "usd": None,
                                    "source": "result.stats"}),
    ("gemini-json", GEMINI_JSON, {"tokens_in": 30, "tokens_out": 15, "tokens_cached": 0, "usd": None,
                                  "source": "stats.models.tokens"}),
])
def test_the_booking_settles_to_the_usage_the_cli_reported(tmp_path, fake, proctor_home, output, sample, expected):
    # The real output of each CLI, through an adapter declared with that CLI's output format (ungated: the
    # samples hold the CLIs' own tool calls, which no gate of this test decided).
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'confine = "off"\n[agents.cli]\ncommand = ["cli", "{{prompt}}"]\noutput = "{output}"\n')
    policy(proctor_home, '[budgets.cli]\nagent = "cli"\ntokens_per_hour = 1000000\ntokens_per_run = 50000\n'
                         'usd_per_day = 10.0\nusd_per_run = 0.5\n')
    agent = fake("cli", Behaviour(stdout=sample, writes=WRITES))
    res = run_agent(request(make_repo(tmp_path), "cli"), config=load_config(cfg))
    assert res.status is Status.completed and len(agent.calls()) == 1, res.known_risks
    assert res.usage == expected
    tokens = expected["tokens_in"] + expected["tokens_out"]
    usd = expected["usd"] if expected["usd"] is not None else 0.5  # no stated cost: the estimate stands
    assert res.budget["how"] == "usage"
    assert res.budget["budgets"] == [{"budget": "cli", "booked": {"runs": 1, "tokens": 50_000, "usd": 0.5},
                                      "charged": {"runs": 1, "tokens": tokens, "usd": usd}}]
    report = usage_json()
    assert report["store"] == "sqlite"
    assert limit(report, "cli", "tokens_per_hour")["spent"] == tokens
    assert limit(report, "cli", "usd_per_day")["spent"] == pytest.approx(usd)
    (settled,) = rows(proctor_home, "usage.settled")
    assert settled["jobId"] == res.job_id and settled["usage"] == expected


def test_a_retried_run_is_charged_for_both_attempts(tmp_path, fake, proctor_home):
    cfg = tmp_path / "config.toml"
    cfg.write_text('confine = "off"\n[agents.cli]\ncommand = ["cli", "{prompt}"]\noutput = "claude-stream-json"\n')
    policy(proctor_home, '[budgets.cli]\nagent = "cli"\ntokens_per_hour = 100000\ntokens_per_run = 1000\n')
    fake("cli", Behaviour(exit_codes=[1, 0], stdout=CLAUDE, writes=WRITES))
    res = run_agent(request(make_repo(tmp_path), "cli"), config=load_config(cfg))
    assert res.attempts == 2 and res.status is Status.completed, res.known_risks
    assert (res.usage["tokens_in"], res.usage["tokens_out"], res.usage["usd"]) == (40, 20, pytest.approx(0.0007))
    assert limit(usage_json(), "cli", "tokens_per_hour")["spent"] == 60


def test_a_run_that_never_launched_gives_its_booking_back(tmp_path, fake, proctor_home):
    cfg = tmp_path / "config.toml"
    cfg.write_text('confine = "off"\n[agents.gone]\ncommand = ["no-such-agent-cli", "{prompt}"]\n'
                   '[agents.here]\ncommand = ["here", "{prompt}"]\n')
    policy(proctor_home, '[budgets.team]\nlane = "none-here"\nruns_per_hour = 1\n'
                         '[budgets.gone]\nagent = "gone"\nruns_per_hour = 1\n[budgets.here]\nagent = "here"\n'
                         'runs_per_hour = 1\n')
    config = load_config(cfg)
    # A program that is not there is refused before anything is booked (issue 24: before any sandbox).
    gone = run_agent(request(make_repo(tmp_path / "a"), "gone"), config=config)
    assert gone.code is Code.AGENT_NOT_FOUND and gone.budget is None and gone.attempts == 0
    assert limit(usage_json(), "gone", "runs_per_hour")["spent"] == 0
    assert rows(proctor_home, "usage.booked") == []
    # So the unit is still there for the next job of that pool.
    again = run_agent(request(make_repo(tmp_path / "b"), "gone"), config=config)
    assert again.code is Code.AGENT_NOT_FOUND and again.budget is None
    # Control: a run that launched keeps its unit.
    fake("here", Behaviour(writes=WRITES))
    here = run_agent(request(make_repo(tmp_path / "c"), "here"), config=config)
    assert here.status is Status.completed and here.budget["how"] == "estimate"
    assert limit(usage_json(), "here", "runs_per_hour")["spent"] == 1


def test_a_job_the_breaker_refuses_gives_its_booking_back(tmp_path, fake, proctor_home):
    cfg = tmp_path / "config.toml"
    cfg.write_text('confine = "off"\n[breaker]\nthreshold = 1\n'
                   '[agents.cli]\ncommand = ["cli", "{prompt}"]\nretry = false\n')
    policy(proctor_home, '[budgets.cli]\nagent = "cli"\nruns_per_hour = 5\n')
    agent = fake("cli", Behaviour(exit_codes=[1]))
    config = load_config(cfg)
    failed = run_agent(request(make_repo(tmp_path / "a"), "cli"), config=config)
    assert failed.code is Code.AGENT_FAILED and failed.breaker["state"] == "open"
    held = run_agent(request(make_repo(tmp_path / "b"), "cli"), config=config)
    assert held.code is Code.CIRCUIT_OPEN and len(agent.calls()) == 1
    assert held.budget["how"] == "released"
    assert limit(usage_json(), "cli", "runs_per_hour")["spent"] == 1  # the run that ran, only


def test_a_malformed_budget_refuses_the_job_and_the_usage_command_clearly(tmp_path, fake, proctor_home):
    claude = fake("claude", Behaviour(writes=WRITES))
    policy(proctor_home, '[budgets.team]\nagent = "claude"\nruns_per_hour = 1\n')
    assert run_agent(request(make_repo(tmp_path / "a"))).status is Status.completed  # control
    res = CliRunner().invoke(main, ["usage"])
    assert res.exit_code == 0 and "team" in res.output and "runs_per_hour" in res.output, res.output

    policy(proctor_home, '[budgets.team]\nagent = "claude"\ntokens_per_hour = 100\n')
    bad = run_agent(request(make_repo(tmp_path / "b")))
    assert bad.status is Status.failed and bad.code is Code.CONFIG_INVALID and len(claude.calls()) == 1
    assert "budgets.team: tokens_per_hour needs tokens_per_run" in bad.summary, bad.summary
    res = subprocess.run([sys.executable, "-c", "from proctor.surfaces.cli import main; main()", "usage"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("proctor: usage refused (CONFIG_INVALID): policy "), res.stderr
    assert "tokens_per_hour needs tokens_per_run" in res.stderr


def test_usage_shows_each_budget_against_its_limits(tmp_path, fake, proctor_home):
    res = CliRunner().invoke(main, ["usage"])
    assert res.exit_code == 0 and "no budgets" in res.output
    assert usage_json() == {"store": "sqlite", "at": usage_json()["at"], "budgets": []}
    policy(proctor_home, '[budgets.team]\nagent = "claude"\nruns_per_hour = 4\nusd_per_day = 3.0\n'
                         'usd_per_run = 0.25\n')
    fake("claude", Behaviour(writes=WRITES))
    run_agent(request(make_repo(tmp_path / "a")))
    report = usage_json()
    runs, usd = limit(report, "team", "runs_per_hour"), limit(report, "team", "usd_per_day")
    assert (runs["spent"], runs["allowed"], runs["left"]) == (1, 4, 3)
    assert (usd["spent"], usd["allowed"], usd["left"]) == (0.25, 3.0, 2.75)
    assert runs["window_end"] == hour_end()
    text = CliRunner().invoke(main, ["usage"]).output
    line = next(ln for ln in text.splitlines() if "runs_per_hour" in ln)
    assert line.split()[:6] == ["team", "agent=claude", "runs_per_hour", "1", "4", "3"], text
