"""`proctor run-agent` as a user runs it: a subprocess, JSON on stdout, exit 0 only when completed."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = str(Path(sys.executable).with_name("proctor"))


def cli(*args: str, env=None) -> tuple[int, dict | None, str]:
    p = subprocess.run([PROCTOR, *args], check=False, capture_output=True, text=True, env=env or os.environ,
                       timeout=120)
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
    assert out["tests_attempted"] == ["true => exit 0"]
    # The tests run unconfined (conftest), and `true` leaves no per-test evidence: the two risks.
    assert out["known_risks"] == ["confinement is off by request: the agent and its validation ran unconfined",
                     "the verdict on `true` rests on its exit code alone: no per-test evidence "
                     "(docs/concepts/verdict.md: What the verdict rests on)"]
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
    # Beside the JSON, one line a person reads, with the code and the reason.
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"proctor: refused ({out['code']}): ") and needle in lines[0], err


def test_a_refusal_is_one_human_line_on_stderr(repo, fake):
    fake("claude")
    code, out, err = cli("run-agent", "--agent", "x", "--task", "t", "--repo", str(repo), "--ticket", "T")
    assert code == 1 and out["code"] == "UNKNOWN_AGENT"
    assert err.splitlines() == [f"proctor: refused (UNKNOWN_AGENT): {out['known_risks'][0]}"], err
    assert err.startswith("proctor: refused (UNKNOWN_AGENT): unknown agent 'x' (known: ") and "claude" in err
    # control: a job that ran gets no refusal line; on a pipe its stderr is only its closing lines (the live
    # progress is for terminals), which say how it ended and what to do next (issue 43)
    fake("claude", Behaviour(writes={"a": "1"}))
    code, out, err = cli("run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", "T",
                         "--validate-cmd", "true")
    assert code == 0 and "refused" not in err, err
    assert err.splitlines()[0].startswith("completed (OK) in ") and f"next: proctor show {out['jobId']}" in err


def test_missing_flags_are_named(repo):
    code, out, err = cli("run-agent", "--agent", "patch")
    assert code == 1 and out["code"] == "INVALID_REQUEST"
    assert out["known_risks"] == ["invalid request: --task or --task-file is required",
                                  "invalid request: --repo is required", "invalid request: --ticket is required"]
    assert "Input should be" not in err + json.dumps(out) and "Traceback" not in err
    assert err == ("proctor: refused (INVALID_REQUEST): --task or --task-file is required; --repo is required; "
                   "--ticket is required\n")
    code, out, _ = cli("run-agent", "--task", "t", "--repo", "/tmp", "--ticket", "T")
    assert out["known_risks"] == ["invalid request: --agent is required"]
    code, out, _ = cli("run-agent", "--agent", "patch", "--task", "t", "--repo", "/tmp", "--ticket", "a b",
                       "--timeout", "soon")
    assert [r.split(": ")[1] for r in out["known_risks"]] == ["--ticket", "--timeout"], out["known_risks"]


def test_relative_repo_is_made_absolute(repo, fake):
    fake("claude", Behaviour(writes={"a": "1"}))
    p = subprocess.run([PROCTOR, "run-agent", "--agent", "claude", "--task", "t", "--repo", "repo", "--ticket", "T",
                        "--validate-cmd", "true"], check=False, capture_output=True, text=True, cwd=repo.parent)
    assert p.returncode == 0, p.stdout + p.stderr


def test_schema_prints_request_and_result():
    code = subprocess.run([PROCTOR, "schema"], check=False, capture_output=True, text=True)
    schema = json.loads(code.stdout)
    assert "timeoutSec" in schema["RunAgentRequest"]["properties"]
    assert "needs_human_review" in schema["RunAgentResult"]["properties"]


# --- SIGINT / SIGTERM: the job is cancelled, not abandoned ------------------------------------------------


def _alive(pid: int) -> bool:
    """A zombie is dead: nothing reaps orphans in some containers."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _until(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.05)


def _pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _job_end(home: Path, job_id: str) -> dict:
    db = sqlite3.connect(f"file:{home / 'ledger.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT payload FROM rows WHERE kind = 'job.end' AND job_id = ?", (job_id,)).fetchall()
    finally:
        db.close()
    assert len(rows) == 1, rows
    return json.loads(rows[0][0])


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([PROCTOR, "run-agent", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _cancelled(p: subprocess.Popen, sig: signal.Signals, home: Path) -> tuple[dict, str]:
    p.send_signal(sig)
    stdout, err = p.communicate(timeout=120)  # a bound for a broken run only; the agent would sleep 300 s
    assert p.returncode == 130, (p.returncode, stdout, err)
    out = json.loads(stdout)
    assert out["status"] == "failed" and out["code"] == "CANCELLED", out
    assert "Traceback" not in err and "Aborted" not in err, err
    assert f"proctor: cancelled ({sig.name}): job {out['jobId']} ended failed (CANCELLED)" in err, err
    end = _job_end(home, out["jobId"])
    assert end["status"] == "failed" and end["code"] == "CANCELLED", end
    jobs = subprocess.run([PROCTOR, "jobs", "--json"], check=False, capture_output=True, text=True, timeout=60)
    assert "interrupted" not in jobs.stdout, jobs.stdout
    return out, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_agent_runs_cancels_kills_its_tree_and_exits_130(repo, fake, tmp_path, proctor_home, sig):
    daemon = tmp_path / "daemon.pid"
    agent = fake("claude", Behaviour(stdout="working\n", writes={"a": "1"}, sleep=300, daemon_pidfile=str(daemon)))
    p = _start("--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", "T", "--validate-cmd", "true")
    _until(lambda: agent.calls() and _pid(daemon), "the agent and its setsid grandchild started")
    pids = [agent.calls()[0]["pid"], _pid(daemon)]
    assert all(_alive(pid) for pid in pids)  # control: the check sees them alive
    out, _ = _cancelled(p, sig, proctor_home)
    # CANCELLED (in _cancelled) with its 300 s agent and the daemon dead: the signal ended the run.
    assert not [pid for pid in pids if _alive(pid)], "a process of the agent's tree survived"
    assert any(f"cancelled: {sig.name} received" in r and "process tree was killed" in r for r in out["known_risks"])
    assert out["attempts"] == 1 and out["tests_attempted"] == []


def test_a_signal_before_the_agent_launched_launches_nothing(repo, tmp_path, proctor_home):
    # The version probe (run before the agent) is held until the test has signalled.
    started, launched = tmp_path / "probe.started", tmp_path / "launched"
    exe = tmp_path / "slow-agent"
    exe.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo $$ > {started}; exec sleep 300; fi\n"
                   f"touch {launched}\n")
    exe.chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'confine = "off"\n[agents.slow]\ncommand = ["{exe}", "{{prompt}}"]\nversion_args = ["--version"]\n')
    p = _start("--agent", "slow", "--task", "t", "--repo", str(repo), "--ticket", "T", "--config", str(cfg))
    _until(lambda: _pid(started), "the version probe started")
    probe = _pid(started)
    out, _ = _cancelled(p, signal.SIGINT, proctor_home)
    assert not launched.exists(), "the agent launched after the signal"
    assert any("nothing was launched" in r for r in out["known_risks"]), out["known_risks"]
    assert not _alive(probe)


def test_a_signal_during_validation_cancels_it_and_kills_its_tree(repo, fake, tmp_path, proctor_home):
    fake("claude", Behaviour(writes={"a": "1"}))
    shell, child = tmp_path / "validate.pid", tmp_path / "validate-child.pid"
    # The base's own run (before the agent) has no `a`: it ends at once; the job's blocks.
    validate = f"[ -e a ] || exit 0; sleep 300 & echo $! > {child}; echo $$ > {shell}; wait"
    p = _start("--agent", "claude", "--task", "t", "--repo", str(repo), "--ticket", "T", "--validate-cmd", validate)
    _until(lambda: _pid(shell) and _pid(child), "validation and its child started")
    pids = [_pid(shell), _pid(child)]
    assert all(_alive(pid) for pid in pids)
    out, _ = _cancelled(p, signal.SIGTERM, proctor_home)
    assert not [pid for pid in pids if _alive(pid)], "a process of validation's tree survived"
    assert any("validation cancelled: SIGTERM received" in r for r in out["known_risks"]), out["known_risks"]
    assert out["agent_changed_files"] == ["a"]
