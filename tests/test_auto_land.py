"""Landing without a person (issue 42), where the person's config says so per repo and the evidence allows:
a clean job lands on its own with an `auto.land` row naming the policy and the evidence; a job with a risk,
one whose verdict rests on less than the policy asks, and one crossing the trust line stay for a person.
Off by default: the same clean job with no policy lands nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from proctor import RunAgentRequest, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.ledger.store import Ledger
from proctor.services.review import auto
from tests.conftest import make_repo, sh

FILES = {
    "pyproject.toml": '[project]\nname = "calc"\nversion = "0"\n',
    "calc.py": "def add(a, b):\n    return a - b\n",
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
FIX = "printf 'def add(a, b):\\\\n    return a + b\\\\n' > calc.py"
SCRIPTS = {
    "clean": FIX,
    "ci": FIX + "; mkdir -p .github/workflows; printf 'on: push\\\\n' > .github/workflows/x.yml",
    "risky": FIX + "; printf 'def test_more():\\n    assert True\\n' >> tests/test_calc.py",
}



def setup(tmp_path: Path, policy: str | None) -> tuple[Path, Path]:
    repo = make_repo(tmp_path, dict(FILES))
    cfg = tmp_path / "config.toml"
    agents = "".join(f'[agents.{n}]\ncommand = ["/bin/sh", "-c", "cat >/dev/null; {s}"]\nprompt = "stdin"\n'
                     'network = false\n' for n, s in SCRIPTS.items())
    cfg.write_text((f'[auto_land."{repo}"]\n{policy}\n' if policy is not None else "") + agents)
    return repo, cfg


def job(repo: Path, cfg: Path, agent: str):
    config = load_config(cfg)
    res = run_agent(RunAgentRequest(agent=agent, task="fix add", repo=str(repo), ticket="A"), config=config)
    return res, auto.after_job(str(repo), res, config)


def master(repo: Path) -> str:
    return sh("git", "rev-parse", "master", cwd=repo).strip()


def test_a_clean_job_lands_on_its_own_and_says_by_what(tmp_path):
    repo, cfg = setup(tmp_path, 'basis = "base-tests"')
    before = master(repo)
    res, said = job(repo, cfg, "clean")
    assert res.status.value == "completed" and not res.needs_human_review, res.to_json()
    assert said is not None and said["landed"] is True and said["code"] == "OK", said
    assert master(repo) != before and "return a + b" in sh("git", "show", "master:calc.py", cwd=repo)
    assert res.landed == said
    with Ledger.default() as ledger:
        row = next(r for r in ledger.rows(kind="auto.land") if r.job_id == res.job_id).payload
        landing = next(r for r in ledger.rows(kind="review.land") if r.job_id == res.job_id).payload
    assert row["policy"] == {"repo": str(repo), "basis": "base-tests", "into": None}
    assert row["evidence"]["basis"] == "base-tests" and row["evidence"]["risks"] == 0
    assert landing["via"] == "auto"


@pytest.mark.parametrize("agent, why", [("risky", "needs a person (completed"), ("ci", "needs a person (completed")])
def test_a_risky_job_or_one_across_the_trust_line_waits_for_a_person(tmp_path, agent, why):
    repo, cfg = setup(tmp_path, 'basis = "exit-code"')
    before = master(repo)
    res, said = job(repo, cfg, agent)
    assert said is not None and said["landed"] is False, said
    assert why in f"{said['reason']} {said['code']}", said
    assert master(repo) == before


def test_a_verdict_below_the_policys_basis_and_no_policy_land_nothing(tmp_path):
    repo, cfg = setup(tmp_path, 'basis = "held-out"')
    before = master(repo)
    res, said = job(repo, cfg, "clean")
    assert said is not None and said["landed"] is False and "asks for held-out" in said["reason"], said
    # Off by default: the same clean job under a config with no policy for the repo.
    other, none_cfg = setup(tmp_path / "none", None)
    res2, said2 = job(other, none_cfg, "clean")
    assert res2.status.value == "completed" and said2 is None and res2.landed is None
    assert master(repo) == before


def test_run_agent_on_the_cli_lands_where_the_policy_says(tmp_path):
    from proctor.surfaces.cli.main import main

    repo, cfg = setup(tmp_path, "")
    before = master(repo)
    got = CliRunner().invoke(main, ["run-agent", "--agent", "clean", "--task", "fix add", "--repo", str(repo),
                                    "--ticket", "A", "--config", str(cfg)])
    out = json.loads(got.stdout)
    assert got.exit_code == 0 and out["landed"]["landed"] is True, got.stdout
    assert master(repo) != before


def test_a_follow_up_never_lands_on_its_own_though_its_own_verdict_would():
    """Landing a follow-up lands its whole chain, whose earlier jobs its verdict did not judge one by one."""
    from proctor.contract import RunAgentResult, Status
    from proctor.mechanisms.config.model import AutoLand

    clean = dict(status=Status.completed, needs_human_review=False, basis={"verdict": "base-tests"}, commit="c" * 40,
                 jobId="20261207T000000-aaaaaa")
    policy = AutoLand(basis="base-tests")
    assert auto.why_not(RunAgentResult(**clean), policy) is None  # the control: the same evidence, alone
    why = auto.why_not(RunAgentResult(**clean, chain=["20261206T000000-bbbbbb"]), policy)
    assert why is not None and "whole chain" in why, why
