"""A failed validation is diagnosable from the result alone, and the risks a reviewer needs are there: the
main checkout's uncommitted changes the job did not include, a base behind the checkout's branch, and
confinement off. Each beside a control where the same job has none of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import make_repo, sh

from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))
OFF = "confinement is off by request: the agent and its validation ran unconfined"


def req(repo: Path, **kw) -> RunAgentRequest:
    return RunAgentRequest.model_validate({"agent": "claude", "task": "t", "repo": str(repo), "ticket": "T1", **kw})


def test_a_failed_validation_says_why_in_the_result_and_keeps_the_whole_log(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    # 200 KB of output before the line that explains the failure, then more on stderr.
    cmd = ("python3 -c \"import sys; print('x' * 200_000); print('AssertionError: 2 + 2 != 5'); "
           "sys.stderr.write('E   at calc.py:3\\n'); sys.exit(1)\"")
    res = run_agent(req(repo, validateCommand=cmd))
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED
    [step] = res.validation
    assert step["exit_code"] == 1 and step["timed_out"] is False and step["duration_s"] > 0
    assert step["label"] == cmd and step["output_dropped"] == 0
    tail = step["output_tail"]
    assert len(tail.encode()) <= 64 * 1024 and "AssertionError: 2 + 2 != 5" in tail and "E   at calc.py:3" in tail
    log = Path(res.validation_log)
    text = log.read_text()
    assert text.count("x" * 1000) >= 200 and "AssertionError" in text and "=> exit 1" in text
    # The log is host-owned: under $PROCTOR_HOME, never in the worktree a person reviews or an agent writes.
    assert not log.is_relative_to(Path(res.worktree_path)) and not log.is_relative_to(repo)
    # The CLI prints the same fields.
    out = json.loads(subprocess.run([PROCTOR, "run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo),
                                     "--ticket", "T2", "--validate-cmd", "exit 4"],
                                    capture_output=True, text=True).stdout)
    assert out["validation"][0]["exit_code"] == 4 and Path(out["validation_log"]).is_file()


def test_control_a_passing_validation_records_its_run_too(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    res = run_agent(req(repo, validateCommand="echo all good"))
    assert res.status is Status.completed
    assert res.validation[0]["exit_code"] == 0 and "all good" in res.validation[0]["output_tail"]
    # The control for the risks below: a clean checkout on its base has only these two (unconfined, and a
    # command that leaves no per-test evidence).
    assert res.known_risks == [OFF, "the verdict on `echo all good` rests on its exit code alone: no per-test "
                                    "evidence (docs/concepts/verdict.md: What the verdict rests on)"]


def test_uncommitted_changes_in_the_main_checkout_are_named(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    (repo / "README.md").write_text("edited, never committed\n")
    (repo / "notes.txt").write_text("new, untracked\n")
    res = run_agent(req(repo, validateCommand="true"))
    [risk] = [r for r in res.known_risks if "uncommitted" in r]
    assert "2 uncommitted change(s) the job did not include" in risk
    assert "README.md" in risk and "notes.txt" in risk and res.needs_human_review


def test_a_base_behind_the_checkouts_branch_is_a_risk(tmp_path, fake):
    repo = make_repo(tmp_path)
    sh("git", "checkout", "-qb", "main", cwd=repo)
    for i in range(3):
        (repo / f"f{i}").write_text(str(i))
        sh("git", "add", "-A", cwd=repo)
        sh("git", "commit", "-qm", f"c{i}", cwd=repo)
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    res = run_agent(req(repo, validateCommand="true"))  # default base: master, 3 behind main
    assert res.base_ref == "master"
    assert any("the base master is 3 commit(s) behind main" in r for r in res.known_risks), res.known_risks
    on_main = run_agent(req(repo, validateCommand="true", branch="main"))  # control: the checkout's own branch
    assert not any("behind" in r for r in on_main.known_risks), on_main.known_risks
