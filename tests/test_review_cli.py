"""The review surface end to end: real `proctor run-agent` jobs (fake agent CLIs on PATH, real git repos),
then `proctor jobs|show|diff|land|discard|gc` as a person runs them, each a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import sh, wait_until
from proctor.mechanisms import confine
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.adapters.testing import Behaviour

PROCTOR = Path(sys.executable).with_name("proctor")


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    p = subprocess.run([str(PROCTOR), *args], capture_output=True, timeout=120, env=os.environ.copy())
    assert b"Traceback" not in p.stderr, p.stderr.decode()
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout.decode()[-2000:], p.stderr.decode()[-2000:])
    return p


def out(*args: str, check: int | None = 0) -> dict | list:
    return json.loads(cli(*args, "--json", check=check).stdout)


def run_job(repo: Path, ticket: str, validate: str = "true") -> dict:
    p = cli("run-agent", "--agent", "claude", "--task", "do it", "--repo", str(repo), "--ticket", ticket,
            "--validate-cmd", validate, check=None)
    return json.loads(p.stdout)


def commit(repo: Path, rel: str, content: str) -> str:
    (repo / rel).write_text(content)
    sh("git", "add", rel, cwd=repo)
    sh("git", "commit", "-qm", f"add {rel}", cwd=repo)
    return sh("git", "rev-parse", "HEAD", cwd=repo).strip()


def fsck(repo: Path) -> None:
    p = subprocess.run(["git", "fsck", "--strict", "--no-dangling"], cwd=repo, capture_output=True, text=True)
    assert p.returncode == 0 and "error" not in p.stderr and "missing" not in p.stdout, (p.stdout, p.stderr)


def has_object(repo: Path, sha: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=repo, capture_output=True).returncode == 0


def rows(kind: str, job_id: str | None = None) -> list:
    with Ledger.default() as led:
        return led.rows(kind=kind, job_id=job_id)


# -- land ----------------------------------------------------------------------------------------------

def test_land_fast_forward_into_the_checked_out_branch(repo, fake):
    fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    res = run_job(repo, "T-1", "test -f fix.txt")
    assert res["status"] == "completed", res
    job = res["jobId"]
    stored = json.loads((Path(os.environ["PROCTOR_HOME"]) / "jobs" / job / "result.json").read_text())
    assert stored["commit"] == res["commit"] and stored["validation"][0]["exit_code"] == 0
    assert not has_object(repo, res["commit"]), "the main repo got an object from the job before landing"

    t0 = time.monotonic()
    landed = out("land", job)
    took = time.monotonic() - t0
    assert landed["ok"] and landed["how"] == "ff" and landed["new"] == res["commit"] and not landed["moved"]
    assert "revalidation" not in landed, "a fast-forward lands the tree that was validated: no second run"
    # The main checkout was on master and clean: its files followed, and nothing else changed.
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == res["commit"]
    assert (repo / "fix.txt").read_text() == "fixed\n" and landed["checkout_updated"] is True
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
    fsck(repo)
    again = out("land", job, check=1)
    assert again["code"] == "ALREADY_LANDED"
    kinds = [r.kind for r in rows("review.land.start", job) + rows("review.land", job)]
    assert kinds.count("review.land") == 2 and kinds.count("review.land.start") == 1
    listed = {j["jobId"]: j for j in out("jobs")}
    assert listed[job]["state"] == "landed" and listed[job]["landed"]["into"] == "master"
    assert out("discard", job)["ok"] and not Path(res["worktreePath"]).exists()
    assert out("diff", job)["files"] == ["fix.txt"]  # landed: its objects are the main repo's now
    fsck(repo)
    print(f"\nland (ff, CLI wall time): {took:.2f} s")


def test_land_merge_revalidates_the_merged_tree_and_leaves_another_checkout_alone(repo, fake, tmp_path):
    log = tmp_path / "validation-runs.log"
    fake("claude", Behaviour(writes={"b.txt": "b\n"}))
    res = run_job(repo, "T-2", f'echo "$PWD $(ls | tr "\\n" ,)" >> {log}; test -f b.txt')
    assert res["status"] == "completed", res
    moved = commit(repo, "other.txt", "o\n")
    sh("git", "checkout", "-q", "-b", "side", cwd=repo)
    (repo / "scratch.txt").write_text("mine, uncommitted\n")

    t0 = time.monotonic()
    landed = out("land", res["jobId"], "--into", "master")
    took = time.monotonic() - t0
    assert landed["ok"] and landed["how"] == "merge" and landed["moved"] and landed["old"] == moved
    parents = sh("git", "rev-list", "--parents", "-n1", "master", cwd=repo).split()
    assert parents == [landed["new"], moved, res["commit"]]
    assert set(sh("git", "ls-tree", "--name-only", "master", cwd=repo).split()) == {"README.md", "b.txt", "other.txt"}
    rv = landed["revalidation"]
    assert rv["ran"] and rv["passed"] and rv["tests_attempted"][0].endswith("=> exit 0")
    # The second run was on the merged tree, in the scratch checkout beside the job's, not in the job's.
    runs = log.read_text().splitlines()
    # The base's run (before the agent), the job's, then the land's on the merged tree.
    assert len(runs) == 3 and f".{res['jobId']}.land/tree" in runs[2] and "other.txt" in runs[2], runs
    assert "b.txt" not in runs[0] and "b.txt" in runs[1], runs
    assert not (Path(res["worktreePath"]).parent / f".{res['jobId']}.land").exists()
    # The checkout is on another branch: untouched.
    assert sh("git", "branch", "--show-current", cwd=repo).strip() == "side"
    assert not (repo / "b.txt").exists() and (repo / "scratch.txt").exists()
    fsck(repo)
    print(f"\nland (merge + re-validation, CLI wall time): {took:.2f} s")


@pytest.mark.skipif(isinstance(confine.choose("required", confine.detect()), confine.Unavailable),
                    reason="no bubblewrap nor Landlock on this machine")
def test_revalidation_is_confined_by_todays_config(repo, fake, proctor_home):
    """The job ran with confine off; at land time config says auto: the merged tree's validation may write
    its own checkout and nothing else (not the main repo's .git, not the host's git dir beside it)."""
    fake("claude", Behaviour(writes={"g.txt": "g\n"}))
    probe = " ".join(f'"{p}"' for p in ("$PWD/inside", repo / ".git" / "planted",
                                         "$PWD/../host/.git/planted", proctor_home / "planted"))
    res = run_job(repo, "T-9", f'for p in {probe}; do if touch "$p" 2>/dev/null; then echo "wrote $p"; '
                               'else echo "denied $p"; fi; done; true')
    assert res["status"] == "completed", res
    (repo / ".git" / "planted").unlink()  # the job's own run was unconfined: it could
    (proctor_home / "planted").unlink()
    commit(repo, "other.txt", "o\n")
    (proctor_home / "config.toml").write_text('confine = "auto"\n')
    landed = out("land", res["jobId"])
    assert landed["ok"] and landed["revalidation"]["confinement"] != "none", landed
    tail = landed["revalidation_output"][0]["output_tail"]
    assert "wrote " in tail and tail.count("denied ") == 3, tail
    assert not (repo / ".git" / "planted").exists() and not (proctor_home / "planted").exists()
    fsck(repo)


def test_land_refuses_when_the_merged_tree_fails_and_moves_nothing(repo, fake):
    fake("claude", Behaviour(writes={"c.txt": "c\n"}))
    res = run_job(repo, "T-3", "echo checking; ! test -f bad.txt")
    assert res["status"] == "completed", res
    tip = commit(repo, "bad.txt", "the target broke the job's check\n")
    assert out("land", res["jobId"], "--ff-only", check=1)["code"] == "NOT_FAST_FORWARD"
    p = cli("land", res["jobId"], check=1)
    assert b"REVALIDATION_FAILED" in p.stderr and b"checking" in p.stdout  # the failing run's output, shown
    assert len(p.stderr.decode().strip().splitlines()) == 1
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == tip
    assert not has_object(repo, res["commit"]) and not (repo / "c.txt").exists()
    refused = rows("review.land", res["jobId"])[-1].payload
    assert refused["ok"] is False and refused["code"] == "REVALIDATION_FAILED"
    # The checkout is on the target: a filter driver in the repo's config (never run by proctor) and
    # uncommitted changes are each refused before anything runs.
    planted = repo.parent / "smudged"
    sh("git", "config", "filter.x.y.smudge", f"touch {planted}; cat", cwd=repo)
    forced = out("land", res["jobId"], "--force", "--reason", "try", check=1)
    assert forced["code"] == "TARGET_CHECKED_OUT" and "x.y" in forced["reason"] and not planted.exists()
    sh("git", "config", "--remove-section", "filter.x.y", cwd=repo)
    (repo / "README.md").write_text("edited\n")
    assert out("land", res["jobId"], "--force", "--reason", "try", check=1)["code"] == "CHECKOUT_DIRTY"
    fsck(repo)


def test_land_refuses_a_failed_job_unless_forced_with_a_reason(repo, fake):
    fake("claude", Behaviour(writes={"d.txt": "d\n"}))
    res = run_job(repo, "T-4", "false")
    assert res["status"] == "failed" and res["code"] == "VALIDATION_FAILED"
    refused = out("land", res["jobId"], check=1)
    assert refused["code"] == "NOT_LANDABLE" and "failed" in refused["reason"]
    assert out("land", res["jobId"], "--force", check=1)["code"] == "FORCE_NEEDS_REASON"
    assert cli("land", res["jobId"], "--reason", "x", check=2).stderr.startswith(b"proctor: ")
    assert cli("land", res["jobId"], "--squash", "--merge", check=2).stderr.startswith(b"proctor: ")
    assert sh("git", "rev-parse", "master", cwd=repo).strip() != res["commit"]
    forced = out("land", res["jobId"], "--force", "--reason", "the test was wrong", "--squash")
    assert forced["ok"] and forced["how"] == "squash" and forced["not_landable"]
    assert sh("git", "rev-list", "--count", "master", cwd=repo).strip() == "2"  # one squashed commit
    row = rows("review.land", res["jobId"])[-1].payload
    assert row["forced"] is True and row["force_reason"] == "the test was wrong"
    fsck(repo)


# -- jobs, show, diff ------------------------------------------------------------------------------------

def test_jobs_show_and_diff(repo, fake, tmp_path):
    hostile = "x\x1b]0;PWNED\x07\x1b[2J\u202e\n"
    fake("claude", Behaviour(writes={"fix.txt": "fixed\n", "odd.txt": hostile}))
    a = run_job(repo, "T-5", "printf 'out\\033]0;PWNED\\007\\n'; true")
    other = tmp_path / "other" / "repo"
    sh("git", "clone", "-q", str(repo), str(other))
    fake("claude", Behaviour(exit_codes=[1]))
    b = run_job(other, "T-6")
    assert (a["status"], b["status"]) == ("completed", "failed")

    assert [j["jobId"] for j in out("jobs", "--repo", str(repo))] == [a["jobId"]]
    assert [j["jobId"] for j in out("jobs", "--status", "failed")] == [b["jobId"]]
    table = cli("jobs").stdout.decode()
    assert table.splitlines()[0].split() == ["job", "repo", "ticket", "agent", "status", "code", "needs-review", "age"]
    assert len(table.splitlines()) == 3 and "VALIDATION_FAILED" not in table and "AGENT_FAILED" in table

    shown = out("show", a["jobId"][:17])
    assert shown["result"]["commit"] == a["commit"] and shown["request"]["validateCommand"].startswith("printf")
    assert "PWNED" in shown["validation"][0]["output_tail"] and shown["risks"]
    assert {"job.start", "job.tree", "job.end"} <= {r["kind"] for r in shown["ledger"]}
    assert shown["gate"] == [] and Path(shown["validation_log"]).is_file()
    human = cli("show", a["jobId"]).stdout
    assert b"\x1b" not in human and b"\x07" not in human and b"PWNED" in human

    patch = cli("diff", a["jobId"]).stdout  # piped: the exact patch
    assert b"+fixed" in patch and hostile.encode()[:-1] in patch
    subprocess.run(["git", "apply", "--check", "-"], cwd=repo, input=patch, check=True)
    d = out("diff", a["jobId"])
    assert d["files"] == ["fix.txt", "odd.txt"] and "fix.txt" in d["stat"]
    assert "\u202e".encode() not in json.dumps(d).encode() and b"\x1b" not in cli("diff", a["jobId"], "--json").stdout
    assert out("show", "no-such-job", check=1)["code"] == "UNKNOWN_JOB"
    verbs = {r.kind for r in rows("review.jobs") + rows("review.show") + rows("review.diff")}
    assert verbs == {"review.jobs", "review.show", "review.diff"}


def test_jobs_lists_ledger_only_jobs_and_escapes_hostile_text():
    hostile = "T\x1b]0;PWNED\x07\x1b[2J\x9b\u202e\nfake-line"
    with Ledger.default() as led:
        led.append("job.start", {"jobId": "j1", "agent": "codex", "ticket": "T-1", "repo": "/r", "mode": "build"},
                   job_id="j1")
        led.append("job.end", {"jobId": "j1", "status": "completed", "code": "OK", "needs_human_review": False},
                   job_id="j1")
        led.append("job.start", {"jobId": "j2", "agent": "claude\x1b]52;c;eA==\x07", "ticket": hostile,
                                 "repo": "/r"}, job_id="j2")
    jobs = {j["jobId"]: j for j in out("jobs")}
    assert (jobs["j1"]["status"], jobs["j1"]["code"], jobs["j1"]["agent"]) == ("completed", "OK", "codex")
    assert jobs["j2"]["status"] == "interrupted" and jobs["j2"]["ended"] is None and jobs["j2"]["ticket"] == hostile
    p = cli("jobs")
    for raw in (b"\x1b", b"\x07", "\x9b".encode(), "\u202e".encode()):
        assert raw not in p.stdout, raw
    lines = p.stdout.decode().splitlines()
    assert len(lines) == 3  # header + two rows: the planted newline is shown as \n, not a fake row
    assert "T\\x1b]0;PWNED\\x07\\x1b[2J\\x9b\\u202e\\nfake-line" in lines[2]


# -- discard, gc -----------------------------------------------------------------------------------------

def test_discard_then_gc_removes_an_abandoned_job_and_the_main_repo_stays_clean(repo, fake):
    fake("claude", Behaviour(writes={"e.txt": "e\n"}))
    done = run_job(repo, "T-7")
    wt = Path(done["worktreePath"])
    gone = out("discard", done["jobId"])
    assert gone["ok"] and not wt.exists() and gone["freed"]["bytes"] > 0
    assert out("land", done["jobId"], check=1)["code"] == "DISCARDED"

    # A job whose host dies mid-run (kill -9): a start row, no end row, a worktree, an agent left running.
    agent = fake("claude", Behaviour(writes={"f.txt": "f\n"}, sleep=60))
    before = len(agent.calls())  # the fake's record is shared by every job of the test
    host = subprocess.Popen([str(PROCTOR), "run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo),
                             "--ticket", "T-8", "--validate-cmd", "true"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        wait_until(lambda: len(agent.calls()) > before, 120, "the agent to start")
        running = [j for j in out("jobs") if j["ticket"] == "T-8"][0]
        assert running["status"] == "running" and running["hostAlive"] is True
        assert out("discard", running["jobId"], check=1)["code"] == "JOB_RUNNING"
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
        for call in agent.calls()[before:]:
            try:
                os.kill(call["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    job = running["jobId"]
    # An older proctor's layout also left a branch in the main repo: gc takes it too.
    sh("git", "branch", f"wt/{job}/T-8", cwd=repo)
    interrupted = [j for j in out("jobs") if j["jobId"] == job][0]
    assert interrupted["status"] == "interrupted" and interrupted["worktreeExists"]
    assert interrupted["worktreePath"] == str(repo.parent / "repo-agents" / job)  # no end row names it

    assert out("gc", "--dry-run")["jobs"] == []  # the default --older-than 7d keeps a fresh one
    dry = out("gc", "--older-than", "0s", "--dry-run")
    assert [j["jobId"] for j in dry["jobs"]] == [job] and dry["freed_bytes"] == 0
    assert dry["jobs"][0]["why"] == "abandoned (its host died)" and Path(interrupted["worktreePath"]).exists()
    t0 = time.monotonic()
    done_gc = out("gc", "--older-than", "0s")
    took = time.monotonic() - t0
    assert done_gc["ok"] and done_gc["freed_bytes"] == dry["would_free_bytes"] > 0
    assert not Path(interrupted["worktreePath"]).exists() and not (repo.parent / "repo-agents").exists()
    assert "wt/" not in sh("git", "branch", "--list", cwd=repo)
    fsck(repo)
    assert cli("gc", "--older-than", "soon", check=2).stderr.startswith(b"proctor: --older-than")
    print(f"\ngc: freed {done_gc['freed_bytes']} bytes of 1 abandoned job in {took:.2f} s (CLI wall time)")
