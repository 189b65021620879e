"""Hostile agents against the host's own judgement (found in review, each reproduced first).

Every case pairs the trick with the honest twin (or the unguarded mechanism) so the guard is evidence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from conftest import sh
from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.adapters.output import READERS, ClaudeStreamWatch
from proctor.services.job.classify import Patterns, classify
from proctor.mechanisms.config.load import load_config
from proctor.contract import Code
from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))


def agent(tmp_path: Path, script: str, confine: str = "off", name: str = "sh") -> object:
    p = tmp_path / f"{name}-{confine}.toml"
    p.write_text(f'confine = "{confine}"\n[agents.{name}]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\n'
                 'prompt = "stdin"\nnetwork = false\n')
    return load_config(p)


def req(repo: Path, agent_name: str = "sh", **kw) -> RunAgentRequest:
    return RunAgentRequest(agent=agent_name, task=kw.pop("task", "t"), repo=str(repo), ticket="T", **kw)


def test_skip_worktree_cannot_hide_an_edit(tmp_path, repo):
    script = "git update-index --skip-worktree README.md && echo hidden >> README.md && echo n > new.txt"
    res = run_agent(req(repo, validateCommand="true"), config=agent(tmp_path, script))
    assert set(res.agent_changed_files) == {"README.md", "new.txt"}, res.agent_changed_files
    # control: in a plain clone the same index trick does hide the edit from `git status`
    clone = tmp_path / "clone"
    sh("git", "clone", "-q", str(repo), str(clone))
    subprocess.run(["/bin/sh", "-c", script], cwd=clone, check=True)
    assert "README.md" not in sh("git", "status", "--porcelain", cwd=clone)


def test_agent_cannot_choose_its_own_validation(tmp_path):
    from conftest import make_repo

    repo = make_repo(tmp_path, {"pyproject.toml": "", "test_x.py": "def test_x():\n    assert False\n"})
    res = run_agent(req(repo, mustPass=["test_x.py::test_x"]),
                    config=agent(tmp_path, "printf 'test:\\n\\ttrue\\n' > Makefile"))
    assert res.tests_attempted and "pytest" in res.tests_attempted[0], res.tests_attempted
    assert res.status is Status.failed and res.code is Code.VALIDATION_FAILED
    assert any("define the tests" in r for r in res.known_risks)


def test_a_killed_run_is_never_completed_even_if_the_cli_exits_0_on_term(repo, fake):
    ev = {"type": "rate_limit_event", "rate_limit_info": {"status": "rejected"}}
    script = ("import json,signal,sys,time\nif sys.argv[1:] == ['--version']: sys.exit(print('9.9'))\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
              f"print(json.dumps({ev!r}), flush=True)\ntime.sleep(60)\n")
    (Path(fake("claude").path)).write_text(f"#!{sys.executable}\n" + script)
    res = run_agent(req(repo, "claude"))
    assert res.exit_codes == [0] and res.status is Status.rate_limited and res.code is Code.RATE_LIMITED, res


def test_model_prose_about_rate_limits_is_not_a_rate_limit(repo, fake):
    out = {"type": "result", "is_error": False, "result": "I implemented the rate limiter; rate_limit_error handled"}
    fake("claude", Behaviour(stdout=json.dumps(out) + "\n", exit_codes=[1]))
    res = run_agent(req(repo, "claude"))
    assert res.status is Status.failed and res.code is Code.AGENT_FAILED and res.attempts == 2
    # control: the CLI's own error result with the same words is a rate limit
    err = {"type": "result", "is_error": True, "result": "API Error: Request rejected (429) · rate_limit_error"}
    fake("claude", Behaviour(stdout=json.dumps(err) + "\n", exit_codes=[1]))
    assert run_agent(req(repo, "claude")).status is Status.rate_limited


def test_deep_json_from_the_model_neither_crashes_nor_stops_the_drain():
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    for reader in READERS.values():
        reader(deep + "\n", deep)  # no RecursionError
    assert ClaudeStreamWatch()("stdout", (deep + "\n").encode()) is None


def test_nul_in_the_task_is_refused_not_a_traceback(repo, fake, tmp_path):
    claude = fake("claude")
    res = run_agent(req(repo, "claude", task="a\0b"))
    assert res.status is Status.failed and res.code is Code.INVALID_REQUEST and "NUL" in res.known_risks[0]
    assert claude.calls() == [] and res.worktree_path is None
    task = tmp_path / "nul.txt"
    task.write_bytes(b"fix\0it")
    p = subprocess.run([PROCTOR, "run-agent", "--agent", "claude", "--task-file", str(task), "--repo", str(repo),
                        "--ticket", "T"], capture_output=True, text=True)
    assert p.returncode == 1 and json.loads(p.stdout)["code"] == "INVALID_REQUEST" and "Traceback" not in p.stderr


def test_host_git_environment_never_reaches_the_agent(repo, fake, monkeypatch):
    claude = fake("claude", Behaviour(writes={"a": "1"}, record_env=["GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"]))
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(repo))
    monkeypatch.setenv("GIT_INDEX_FILE", str(repo / ".git/index"))
    res = run_agent(req(repo, "claude", validateCommand="true"))
    assert res.status is Status.completed
    assert claude.calls()[0]["env"] == {"GIT_DIR": None, "GIT_WORK_TREE": None, "GIT_INDEX_FILE": None}


def test_crlf_task_file_reaches_the_agent_byte_for_byte(tmp_path):
    from conftest import make_repo

    repo = make_repo(tmp_path, {"win.txt": "one\r\ntwo\r\n"})
    diff = b"--- a/win.txt\r\n+++ b/win.txt\r\n@@ -1,2 +1,2 @@\r\n one\r\n-two\r\n+three\r\n"
    diff = b"--- a/win.txt\n+++ b/win.txt\n@@ -1,2 +1,2 @@\n one\r\n-two\r\n+three\r\n"
    task = tmp_path / "crlf.diff"
    task.write_bytes(diff)
    p = subprocess.run([PROCTOR, "run-agent", "--agent", "patch", "--task-file", str(task), "--repo", str(repo),
                        "--ticket", "T", "--validate-cmd", "true"], capture_output=True, text=True)
    out = json.loads(p.stdout)
    assert out["status"] == "completed", out
    assert (Path(out["worktreePath"]) / "win.txt").read_bytes() == b"one\r\nthree\r\n"


def test_pytest_collecting_nothing_is_a_risk_not_a_failure(tmp_path, monkeypatch, lean_python_bin):
    from conftest import make_repo

    repo = make_repo(tmp_path, {"pytest.ini": "[pytest]\n"})
    monkeypatch.setenv("PATH", f"{lean_python_bin}{os.pathsep}{os.environ['PATH']}")
    res = run_agent(req(repo), config=agent(tmp_path, "echo x > notes.txt"))
    assert res.tests_attempted == ["python -m pytest => exit 5, as on the base"], res.tests_attempted
    assert res.status is Status.completed and any("ran no test" in r for r in res.known_risks)
    assert res.needs_human_review


def test_classify_unit_no_bare_rate_limit_prose():
    p = Patterns.build()
    assert classify(1, "implementing a rate limiter", p).status is None
    assert classify(1, "Error: rate limited by upstream", p).status is Status.rate_limited
