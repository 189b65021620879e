"""A follow-up (issue 42): `continues` cuts a new job from an earlier job's tree with a new brief, so the agent
builds on its own earlier work instead of a new job redoing everything; its verdict, diff and landing are the
chain's against the first base. The first job fixes one of two broken functions and fails (the other test
still fails); the follow-up fixes the other, passes, and landing it lands both."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from proctor import RunAgentRequest, run_agent
from proctor.contract import Code, Status
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.ledger.store import Ledger
from proctor.services.review import jobs
from proctor.services.review.land import land
from tests.conftest import make_repo, sh

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return b + a\n"
TESTS = ("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_mul():\n    assert mul(2, 3) == 6\n")
MUST = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"]
FILES = {"pyproject.toml": '[project]\nname = "calc"\nversion = "0"\n', "calc.py": CALC, "tests/test_calc.py": TESTS}



def config(where: Path) -> Path:
    """Two scripted agents: one fixes add, the other keeps the brief it was given and fixes mul."""
    cfg = where / "agents.toml"
    cfg.write_text(
        '[agents.fixadd]\ncommand = ["/bin/sh", "-c", "cat >/dev/null; sed -i s/a\\\\ -\\\\ b/a\\\\ +\\\\ b/ calc.py"]\n'
        'prompt = "stdin"\nnetwork = false\n'
        '[agents.fixmul]\ncommand = ["/bin/sh", "-c", "cat > brief.txt; sed -i s/b\\\\ +\\\\ a/a\\\\ *\\\\ b/ calc.py"]\n'
        'prompt = "stdin"\nnetwork = false\n')
    return cfg


def test_a_follow_up_builds_on_its_job_and_is_judged_as_the_chain(tmp_path):
    repo = make_repo(tmp_path, FILES)
    cfg = load_config(config(tmp_path))
    with Ledger(tmp_path / "ledger.sqlite3") as ledger:
        first = run_agent(RunAgentRequest(agent="fixadd", task="make add add", repo=str(repo), ticket="T1",
                                          mustPass=MUST), config=cfg, ledger=ledger)
        assert first.code is Code.VALIDATION_FAILED and first.changed_files == ["calc.py"], first.to_json()
        follow = run_agent(RunAgentRequest(agent="fixmul", task="now make mul multiply", repo=str(repo),
                                           ticket="T2", mustPass=MUST, continues=first.job_id),
                           config=cfg, ledger=ledger)
        assert follow.status is Status.completed and not follow.needs_human_review, follow.to_json()
        assert follow.chain == [first.job_id]
        wt = Path(follow.worktree_path)
        # The agent started from the first job's tree and was told so, with the earlier brief.
        brief = (wt / "brief.txt").read_text()
        assert brief.startswith("now make mul multiply") and first.job_id in brief and "make add add" in brief
        # Judged as the chain: its diff is against the first base and holds both fixes.
        assert sorted(follow.changed_files) == ["brief.txt", "calc.py"]
        assert follow.base_ref == first.base_ref
        start = next(r for r in ledger.rows(kind="job.start") if r.job_id == follow.job_id)
        assert start.payload["continues"] == first.job_id
        out = land(ledger, jobs.find(ledger, follow.job_id), allow_trust_line=False)
        assert out.ok, out.to_dict()
    landed = sh("git", "show", "master:calc.py", cwd=repo)
    assert "return a + b" in landed and "return a * b" in landed  # both jobs' work, landed as one


def test_a_follow_up_of_a_job_that_does_not_exist_or_of_another_repo_is_refused(tmp_path):
    repo = make_repo(tmp_path / "one", FILES)
    other = make_repo(tmp_path / "two", FILES)
    cfg = load_config(config(tmp_path))
    with Ledger(tmp_path / "ledger.sqlite3") as ledger:
        first = run_agent(RunAgentRequest(agent="fixadd", task="make add add", repo=str(repo), ticket="T1"),
                          config=cfg, ledger=ledger)
        assert first.commit, first.to_json()  # the control below continues it
        ghost = run_agent(RunAgentRequest(agent="fixmul", task="x", repo=str(repo), ticket="T2",
                                          continues="20000101T000000-abcdef"), config=cfg, ledger=ledger)
        elsewhere = run_agent(RunAgentRequest(agent="fixmul", task="x", repo=str(other), ticket="T2",
                                              continues=first.job_id), config=cfg, ledger=ledger)
        both = run_agent(RunAgentRequest(agent="fixmul", task="x", repo=str(repo), ticket="T2", branch="master",
                                         continues=first.job_id), config=cfg, ledger=ledger)
        fine = run_agent(RunAgentRequest(agent="fixmul", task="x", repo=str(repo), ticket="T2",
                                         continues=first.job_id), config=cfg, ledger=ledger)
    assert ghost.code is Code.INVALID_REQUEST and "no job" in ghost.summary, ghost.summary
    assert elsewhere.code is Code.INVALID_REQUEST and "not of" in elsewhere.summary, elsewhere.summary
    assert both.code is Code.INVALID_REQUEST and "not both" in both.summary, both.summary
    assert fine.attempts == 1 and fine.chain == [first.job_id], fine.to_json()


def test_run_agent_continue_takes_the_agent_repo_and_ticket_of_the_job(tmp_path, monkeypatch):
    from proctor.surfaces.cli.main import main

    repo = make_repo(tmp_path, FILES)
    cfg = config(tmp_path)
    runner = CliRunner()
    first = runner.invoke(main, ["run-agent", "--agent", "fixadd", "--task", "make add add", "--repo", str(repo),
                                 "--ticket", "T1", "--config", str(cfg)])
    first_id = json.loads(first.stdout)["jobId"]
    # The follow-up names neither agent, repo nor ticket: the job it continues gives them; its own agent differs.
    again = runner.invoke(main, ["run-agent", "--continue", first_id, "--agent", "fixmul", "--task", "mul too",
                                 "--config", str(cfg), "--must-pass", MUST[0], "--must-pass", MUST[1]])
    out = json.loads(again.stdout)
    assert again.exit_code == 0, again.stdout
    assert out["chain"] == [first_id] and out["agent"] == "fixmul" and "T1" in out["branch"]
