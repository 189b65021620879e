"""run_agent end to end: real git worktrees, real processes, fake agent CLIs on PATH."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import UNCONFINED, make_repo, sh
from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.contract import Code
from proctor.mechanisms.adapters.testing import Behaviour


def req(repo: Path, agent: str = "claude", task: str = "fix the bug", **kw) -> RunAgentRequest:
    return RunAgentRequest(agent=agent, task=task, repo=str(repo), ticket=kw.pop("ticket", "T-1"), **kw)


def user_config(tmp_path: Path, text: str):
    p = tmp_path / "config.toml"
    p.write_text(UNCONFINED + text)
    return load_config(p)


PASS = "true"
FAIL = "false"


# -- worktree -------------------------------------------------------------------------------------------

def test_worktree_path_branch_and_main_checkout_untouched(repo, fake):
    agent = fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    head = sh("git", "rev-parse", "HEAD", cwd=repo)
    res = run_agent(req(repo, validateCommand=PASS))
    assert res.status is Status.completed, res
    wt = Path(res.worktree_path)
    assert wt == repo.parent / "repo-agents" / res.job_id
    assert res.branch == f"wt/{res.job_id}/T-1"
    assert sh("git", "branch", "--show-current", cwd=wt).strip() == res.branch
    assert (wt / "fix.txt").read_text() == "fixed\n"
    # main checkout: same HEAD, same branch, clean, and the agent's file is not there
    assert sh("git", "rev-parse", "HEAD", cwd=repo) == head
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
    assert not (repo / "fix.txt").exists()
    assert agent.calls()[0]["cwd"] == str(wt)
    assert wt.is_dir(), "the worktree stays for review"


def test_default_base_master_else_main_else_head(tmp_path, fake):
    fake("claude", Behaviour(writes={"x": "1"}))
    r1 = make_repo(tmp_path / "a", branch="main")
    sh("git", "checkout", "-q", "-b", "other", cwd=r1)
    (r1 / "other.txt").write_text("o")
    sh("git", "add", ".", cwd=r1)
    sh("git", "commit", "-qm", "other", cwd=r1)
    res = run_agent(req(r1, validateCommand=PASS))
    assert res.base_ref == "main" and not (Path(res.worktree_path) / "other.txt").exists()
    r2 = make_repo(tmp_path / "b", branch="trunk")
    res2 = run_agent(req(r2, validateCommand=PASS))
    assert res2.base_ref == "trunk" and res2.status is Status.completed
    sh("git", "branch", "master", cwd=r1)
    assert run_agent(req(r1, validateCommand=PASS)).base_ref == "master"


def test_explicit_branch_is_used_and_a_missing_one_refused(repo, fake):
    agent = fake("claude", Behaviour(writes={"x": "1"}))
    sh("git", "checkout", "-q", "-b", "feature/a", cwd=repo)
    (repo / "feat.txt").write_text("f")
    sh("git", "add", ".", cwd=repo)
    sh("git", "commit", "-qm", "feat", cwd=repo)
    sh("git", "checkout", "-q", "master", cwd=repo)
    res = run_agent(req(repo, branch="feature/a", validateCommand=PASS))
    assert (Path(res.worktree_path) / "feat.txt").exists()
    bad = run_agent(req(repo, branch="no-such-branch"))
    assert bad.status is Status.failed and bad.code is Code.INVALID_REQUEST
    assert "no-such-branch" in bad.known_risks[0]
    assert len(agent.calls()) == 1, "the agent launched for a missing base"


def test_not_a_git_repo_and_missing_repo_are_refused(tmp_path, fake):
    agent = fake("claude")
    plain = tmp_path / "plain"
    plain.mkdir()
    for path in (plain, tmp_path / "missing"):
        res = run_agent(req(path))
        assert res.status is Status.failed and res.code is Code.INVALID_REQUEST
        assert str(path) in res.known_risks[0]
    assert agent.calls() == []


def test_unknown_agent_refused(repo):
    res = run_agent(req(repo, agent="nope"))
    assert res.status is Status.failed and res.code is Code.UNKNOWN_AGENT and "nope" in res.known_risks[0]


# -- process, retry, classification ----------------------------------------------------------------------

def test_argv_agents_get_dev_null_stdin_and_stdin_agents_the_prompt(repo, fake):
    claude = fake("claude", Behaviour(writes={"a": "1"}))
    codex = fake("codex", Behaviour(writes={"b": "1"}))
    big = "y" * 300_000  # past any argv cap: stdin adapters are uncapped
    run_agent(req(repo, validateCommand=PASS))
    run_agent(req(repo, agent="codex", task=big, validateCommand=PASS))
    assert claude.calls()[0]["stdin_devnull"] is True
    c = codex.calls()[0]
    assert c["stdin_devnull"] is False and c["stdin_len"] == 300_000


def test_retry_once_on_nonzero_then_success(repo, fake):
    agent = fake("claude", Behaviour(exit_codes=[3, 0], writes={"a": "1"}))
    res = run_agent(req(repo, validateCommand=PASS))
    assert res.status is Status.completed and res.attempts == 2 and res.exit_codes == [3, 0]
    assert len(agent.calls()) == 2
    assert agent.calls()[0]["cwd"] == agent.calls()[1]["cwd"], "retry must reuse the worktree"
    assert any("retried once" in r for r in res.known_risks) and res.needs_human_review


def test_two_failures_are_failed(repo, fake):
    agent = fake("claude", Behaviour(exit_codes=[1]))
    res = run_agent(req(repo, validateCommand=PASS))
    assert res.status is Status.failed and res.code is Code.AGENT_FAILED and len(agent.calls()) == 2
    assert res.tests_attempted == [], "validation must not run after the agent failed"


def test_timeout_is_not_retried_and_kills_the_tree(repo, fake):
    agent = fake("claude", Behaviour(sleep=120, daemon_pidfile=str(repo.parent / "d.pid")))
    # model_construct skips the 60 s clamp so the test takes 2 s; the host takes the field as given.
    r = RunAgentRequest.model_construct(**{**req(repo).model_dump(), "timeout_sec": 2})
    res = run_agent(r)
    assert res.status is Status.timed_out and res.code is Code.TIMED_OUT and len(agent.calls()) == 1
    pid = int((repo.parent / "d.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.parametrize("text,status", [
    ("API Error: Request rejected (429) · rate limited", Status.rate_limited),
    ("You've hit your limit · resets 5pm (UTC)", Status.rate_limited),
    ("exceeded retry limit, last status: 429 Too Many Requests", Status.rate_limited),
    ("TerminalQuotaError: You have exhausted your capacity on this model", Status.rate_limited),
    ("Error: approval required to run `rm`", Status.approval_required),
])
def test_nonzero_exit_with_pattern_is_classified_and_not_retried(repo, fake, text, status):
    agent = fake("claude", Behaviour(exit_codes=[1], stderr=text))
    res = run_agent(req(repo, validateCommand=PASS))
    assert res.status is status and len(agent.calls()) == 1, res


def test_rate_limit_reset_time_is_carried(repo, fake):
    fake("claude", Behaviour(exit_codes=[1], stderr="You've hit your limit · resets 5pm (UTC)"))
    assert run_agent(req(repo)).retry_after == "5pm (UTC)"


def test_exit_zero_printing_429_is_judged_by_validation(repo, fake):
    fake("claude", Behaviour(stdout="HTTP 429 Too Many Requests... rate_limit_error\n", writes={"a": "1"}))
    ok = run_agent(req(repo, validateCommand=PASS))
    assert ok.status is Status.completed and ok.code is Code.OK
    bad = run_agent(req(repo, validateCommand=FAIL))
    assert bad.status is Status.failed and bad.code is Code.VALIDATION_FAILED


def test_no_network_is_not_a_rate_limit(repo, fake):
    fake("codex", Behaviour(exit_codes=[1], stdout='{"type":"error","message":"Reconnecting... 2/5 waiting for network"}\n'))
    res = run_agent(req(repo, agent="codex"))
    assert res.status is Status.failed and res.code is Code.AGENT_FAILED


def test_claude_rejected_rate_limit_event_ends_the_run_early(repo, fake):
    ev = {"type": "rate_limit_event", "rate_limit_info": {"status": "rejected", "resetsAt": 1767225600}}
    agent = fake("claude", Behaviour(stdout=json.dumps(ev) + "\n", sleep=120))
    res = run_agent(req(repo))
    # Ended by the host on the event: killed by its TERM (-15) with two minutes of sleep left, not read from
    # the output after the agent's own exit 0; the exit code and the risk say so, not a clock (issue 24).
    assert res.status is Status.rate_limited and res.exit_codes == [-15], res
    assert any("the host ended the run" in r for r in res.known_risks), res.known_risks
    assert res.retry_after == "1767225600" and len(agent.calls()) == 1


def test_claude_allowed_rate_limit_event_does_not_end_the_run(repo, fake):
    ev = {"type": "rate_limit_event", "rate_limit_info": {"status": "allowed"}}
    result = {"type": "result", "subtype": "success", "is_error": False, "result": "done"}
    fake("claude", Behaviour(stdout=json.dumps(ev) + "\n", sleep=0.5,
                             stdout_after_sleep=json.dumps(result) + "\n", writes={"a": "1"}))
    res = run_agent(req(repo, validateCommand=PASS))
    assert res.status is Status.completed and res.summary == "done"


# -- prompt caps -----------------------------------------------------------------------------------------

def test_argv_prompt_past_the_cap_is_refused_before_launch(repo, fake):
    agent = fake("claude", Behaviour(writes={"a": "1"}))
    too_big = "z" * 200_000  # Linux MAX_ARG_STRLEN is 131072
    res = run_agent(req(repo, task=too_big))
    assert res.status is Status.failed and res.code is Code.PROMPT_TOO_LARGE
    assert "refused, not truncated" in res.known_risks[0] and res.worktree_path is None
    assert agent.calls() == []
    ok = run_agent(req(repo, task="z" * 100_000, validateCommand=PASS))  # control: under the cap launches
    assert ok.status is Status.completed and "z" * 100_000 in agent.calls()[0]["argv"]


def test_user_declared_cap_is_enforced(tmp_path, repo, fake):
    fake("mine", Behaviour(writes={"a": "1"}))
    cfg = user_config(tmp_path, '[agents.mine]\ncommand = ["mine", "{prompt}"]\nmax_prompt_bytes = 10\n')
    assert run_agent(req(repo, agent="mine", task="x" * 11), config=cfg).code is Code.PROMPT_TOO_LARGE
    assert run_agent(req(repo, agent="mine", task="x" * 10, validateCommand=PASS), config=cfg).status is Status.completed


# -- changed files and the review rule --------------------------------------------------------------------

def test_changed_files_untracked_spaces_rename_commit(repo, fake):
    (repo / "old name.txt").write_text("content\n")
    sh("git", "add", ".", cwd=repo)
    sh("git", "commit", "-qm", "add", cwd=repo)
    script = ("git mv 'old name.txt' 'new name.txt' && echo n > 'dir with space/ünï.txt' 2>/dev/null || "
              "(mkdir 'dir with space' && echo n > 'dir with space/ünï.txt'); echo c > committed.txt && "
              "git add committed.txt && git -c user.email=a@b -c user.name=a commit -qm agent committed.txt")
    cfg = user_config(repo.parent, f'[agents.shell]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\nprompt = "stdin"\n')
    res = run_agent(req(repo, agent="shell", validateCommand=PASS), config=cfg)
    assert res.status is Status.completed, res
    assert set(res.agent_changed_files) == {"old name.txt", "new name.txt", "dir with space/ünï.txt", "committed.txt"}


def test_build_output_cannot_make_an_idle_agent_look_clean(repo, fake):
    fake("claude")  # does nothing
    res = run_agent(req(repo, validateCommand="mkdir -p build && echo o > build/out.bin"))
    assert res.status is Status.completed and res.tests_attempted
    # Validation runs in a throw-away checkout: its output is never part of the job's tree or its review copy.
    assert res.agent_changed_files == [] and res.changed_files == []
    assert not (Path(res.worktree_path) / "build").exists()
    assert res.needs_human_review and "the agent changed no files" in res.known_risks


def test_the_agents_own_git_metadata_decides_nothing(repo, fake):
    # The agent removes its git dir: the host never read it, so its edit is listed all the same.
    cfg = user_config(repo.parent, '[agents.wreck]\ncommand = ["/bin/sh", "-c", '
                      '"echo x > a.txt; rm -rf $(git rev-parse --git-dir)"]\nprompt = "stdin"\n')
    res = run_agent(req(repo, agent="wreck", validateCommand=PASS), config=cfg)
    assert res.status is Status.completed and res.changed_files == ["a.txt"], res
    assert sh("git", "log", "--format=%s", "-1", cwd=Path(res.worktree_path)).startswith("proctor job")


def test_needs_human_review_false_only_when_everything_checked(repo, fake):
    agent = fake("claude", Behaviour(writes={"a.txt": "1"}))
    good = run_agent(req(repo, validateCommand=PASS))
    # Everything checked and passed, but under confine = "off" (these tests' config): validation ran agent
    # code unconfined, which alone keeps a person in the loop (the confined False case: test_host_trust).
    assert good.status is Status.completed and good.needs_human_review is True
    assert good.known_risks == ["confinement is off by request: the agent and its validation ran unconfined",
                                "the verdict on `true` rests on its exit code alone: no per-test evidence "
                                "(docs/concepts/verdict.md: What the verdict rests on)"]
    assert good.tests_attempted == ["true => exit 0"]
    skipped = run_agent(req(repo))  # no test command detected: validation did not run
    assert skipped.status is Status.completed and skipped.needs_human_review is True
    agent.set(Behaviour())
    idle = run_agent(req(repo, validateCommand=PASS))
    assert idle.needs_human_review is True


def test_claimed_status_is_recorded_and_decides_nothing(repo, fake):
    out = {"type": "result", "subtype": "success", "is_error": True, "result": "Not logged in"}
    fake("claude", Behaviour(stdout=json.dumps(out) + "\n", writes={"a": "1"}))
    res = run_agent(req(repo, validateCommand=PASS))
    # exit 0 + validation passed: the host's verdict stands; the claim is kept beside it
    assert res.status is Status.completed and res.claimed_status == "failed" and res.summary == "Not logged in"


def test_environment_given_to_the_agent(repo, fake, tmp_path):
    fake("mine", Behaviour(writes={"a": "1"}, record_env=["PROCTOR_JOB_ID", "PROCTOR_WORKTREE", "MY_KEY"]))
    cfg = user_config(tmp_path, '[agents.mine]\ncommand = ["mine", "{prompt}"]\nenv = { MY_KEY = "v" }\n')
    res = run_agent(req(repo, agent="mine", validateCommand=PASS), config=cfg)
    from proctor.mechanisms.adapters.testing import FakeAgent  # noqa: F401
    env = json.loads((Path(os.environ["PATH"].split(os.pathsep)[0]) / "mine.calls.jsonl").read_text().splitlines()[0])["env"]
    assert env == {"PROCTOR_JOB_ID": res.job_id, "PROCTOR_WORKTREE": res.worktree_path, "MY_KEY": "v"}


def test_prompt_file_placeholder(repo, fake, tmp_path):
    cfg = user_config(tmp_path, '[agents.filer]\ncommand = ["/bin/sh", "-c", "cp \\"$0\\" got.md", "{prompt_file}"]\nprompt = "file"\n')
    res = run_agent(req(repo, agent="filer", task="the brief", validateCommand=PASS), config=cfg)
    assert res.status is Status.completed
    assert (Path(res.worktree_path) / "got.md").read_text() == "the brief"


# -- patch adapter ---------------------------------------------------------------------------------------

DIFF = """--- a/README.md
+++ b/README.md
@@ -1 +1 @@
-hello
+hello, patched
"""


def test_patch_adapter_applies_and_a_bad_diff_fails(repo):
    res = run_agent(req(repo, agent="patch", task=DIFF, validateCommand=PASS))
    assert res.status is Status.completed and res.agent_changed_files == ["README.md"]
    assert (Path(res.worktree_path) / "README.md").read_text() == "hello, patched\n"
    bad = run_agent(req(repo, agent="patch", task=DIFF.replace("-hello", "-absent")))
    # `retry = false`: a diff that did not apply will not apply on a second try either.
    assert bad.status is Status.failed and bad.code is Code.AGENT_FAILED and bad.attempts == 1
    assert (repo / "README.md").read_text() == "hello\n"
