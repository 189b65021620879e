"""`proctor run-agent` as a user runs it: a subprocess, JSON on stdout, exit 0 only when completed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proctor.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))


def cli(*args: str, env=None) -> tuple[int, dict | None, str]:
    p = subprocess.run([PROCTOR, *args], capture_output=True, text=True, env=env or os.environ, timeout=120)
    try:
        out = json.loads(p.stdout)
    except ValueError:
        out = None
    return p.returncode, out, p.stderr


def test_completed_job_prints_the_v1_result_and_exits_0(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    code, out, err = cli("run-agent", "--agent", "claude", "--task", "do", "--repo", str(repo), "--ticket", "T-9",
                         "--validate-cmd", "true")
    assert code == 0 and out["status"] == "completed", (out, err)
    for key in ("status", "summary", "changed_files", "tests_attempted", "known_risks", "needs_human_review",
                "agent", "durationSeconds", "worktreePath", "jobId", "branch", "agent_changed_files"):
        assert key in out
    assert out["tests_attempted"] == ["true => exit 0"] and out["needs_human_review"] is False
    assert "Traceback" not in err


def test_failed_job_exits_nonzero(repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "1"}))
    code, out, _ = cli("run-agent", "--agent", "claude", "--task", "do", "--repo", str(repo), "--ticket", "T",
                       "--validate-cmd", "false")
    assert code == 1 and out["status"] == "failed" and out["tests_attempted"] == ["false => exit 1"]


@pytest.mark.parametrize("content", [None, b"\xff\xfe not utf-8", "dir"])
def test_unreadable_task_file_is_refused_before_launch_with_control(repo, fake, tmp_path, content):
    agent = fake("claude", Behaviour(writes={"a.txt": "1"}))
    bad = tmp_path / "task.md"
    if content == "dir":
        bad.mkdir()
    elif content is not None:
        bad.write_bytes(content)
    code, out, err = cli("run-agent", "--agent", "claude", "--task-file", str(bad), "--repo", str(repo), "--ticket", "T")
    assert code == 1 and out["status"] == "failed" and out["code"] == "TASK_UNREADABLE", (out, err)
    assert str(bad) in out["known_risks"][0] and "Traceback" not in err
    assert agent.calls() == [], "the agent launched on an unreadable brief"
    good = tmp_path / "good.md"
    good.write_text("the real brief")
    code, out, _ = cli("run-agent", "--agent", "claude", "--task-file", str(good), "--repo", str(repo), "--ticket", "T",
                       "--validate-cmd", "true")
    assert code == 0 and "the real brief" in agent.calls()[0]["argv"]


@pytest.mark.parametrize("args,needle", [
    (["--ticket", "bad ticket"], "ticket"),
    (["--branch", "a..b"], "'..'"),
    (["--branch", "-xfoo"], "must not start with '-'"),
    (["--timeout", "soon"], "not a finite number"),
    (["--timeout", "inf"], "not a finite number"),
    (["--agent", "nope"], "unknown agent 'nope'"),
    (["--task", " "], "task must be non-empty"),
    (["--task-file", "/etc/hostname"], "not both"),
    (["--config", "/nonexistent/c.toml"], "cannot be read"),
])
def test_invalid_requests_are_failed_results_not_tracebacks(repo, fake, args, needle):
    agent = fake("claude")
    base = {"--agent": "claude", "--task": "t", "--repo": str(repo), "--ticket": "T"}
    merged = list(sum(base.items(), ()))
    override = dict(zip(args[::2], args[1::2]))
    for k, v in override.items():
        if k in base:
            merged[merged.index(k) + 1] = v
        else:
            merged += [k, v]
    code, out, err = cli("run-agent", *merged)
    assert code == 1 and out["status"] == "failed", (out, err)
    assert any(needle in r for r in out["known_risks"]), out["known_risks"]
    assert "Traceback" not in err and agent.calls() == []


def test_missing_flags_are_named(repo):
    code, out, err = cli("run-agent", "--agent", "patch")
    assert code == 1 and out["code"] == "INVALID_REQUEST"
    text = " ".join(out["known_risks"])
    assert all(f in text for f in ("task", "repo", "ticket")) and "Traceback" not in err


def test_relative_repo_is_made_absolute(repo, fake):
    fake("claude", Behaviour(writes={"a": "1"}))
    p = subprocess.run([PROCTOR, "run-agent", "--agent", "claude", "--task", "t", "--repo", "repo", "--ticket", "T",
                        "--validate-cmd", "true"], capture_output=True, text=True, cwd=repo.parent)
    assert p.returncode == 0, p.stdout + p.stderr


def test_schema_prints_request_and_result():
    code = subprocess.run([PROCTOR, "schema"], capture_output=True, text=True)
    schema = json.loads(code.stdout)
    assert "timeoutSec" in schema["RunAgentRequest"]["properties"]
    assert "needs_human_review" in schema["RunAgentResult"]["properties"]
