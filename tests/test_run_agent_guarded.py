"""run_agent under the guards of issues 3 and 4: OS confinement, the stop switch, the breaker, the ledger.

Each "blocked" case has a control where the same agent, unconfined (or not stopped, or closed breaker),
does the thing, so the block is evidence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import sh, wait_until

from proctor import RunAgentRequest, Status, run_agent
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect
from proctor.contract import Code
from proctor.mechanisms.confine import cgroup
from proctor.mechanisms.ledger.store import Ledger
from proctor.services.review import gc as job_gc
from proctor.mechanisms.policy.stop import StopSwitch
from proctor.mechanisms.adapters.testing import Behaviour

CAPS = detect()
CONFINED = CAPS.bwrap is not None or CAPS.landlock
needs_confinement = pytest.mark.skipif(not CONFINED, reason="this kernel gives neither bubblewrap nor Landlock")
PROCTOR = str(Path(sys.executable).with_name("proctor"))


def shell_agent(tmp_path: Path, script: str, confine: str, extra: str = "") -> object:
    p = tmp_path / f"cfg-{confine}.toml"
    p.write_text(f'confine = "{confine}"\n[agents.sh]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\n'
                 f'prompt = "stdin"\nnetwork = false\n{extra}')
    return load_config(p)


def req(repo: Path, agent: str = "sh", **kw) -> RunAgentRequest:
    return RunAgentRequest(agent=agent, task="t", repo=str(repo), ticket="T", **kw)


@needs_confinement
def test_write_outside_blocked_with_unconfined_control(tmp_path, repo):
    outside = repo / "outside.txt"  # the main checkout (a path under /tmp would hit bwrap's private tmpfs)
    script = f"echo in > inside.txt; echo out > {outside}; echo hook > {repo}/.git/hooks/pre-commit; true"
    control = run_agent(req(repo), config=shell_agent(tmp_path, script, "off"))
    assert control.confinement == "none" and outside.read_text() == "out\n", "control: unconfined write lands"
    outside.unlink()
    (repo / ".git/hooks/pre-commit").unlink()
    res = run_agent(req(repo, validateCommand="true"), config=shell_agent(tmp_path, script, "auto"))
    assert res.status is Status.completed and res.confinement in ("bwrap+landlock", "bwrap", "landlock")
    assert (Path(res.worktree_path) / "inside.txt").read_text() == "in\n"
    assert not outside.exists() and not (repo / ".git/hooks/pre-commit").exists()
    assert any("confinement refused" in r for r in res.known_risks), res.known_risks
    assert res.needs_human_review
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
    assert Ledger.default().verify() == []


@needs_confinement
def test_agent_commits_in_its_own_repo_and_the_main_repo_gets_nothing(tmp_path, repo):
    script = ("echo c > c.txt && git add c.txt && git -c user.email=a@b -c user.name=a commit -qm agent && "
              "git update-ref refs/heads/master HEAD && git log -1 --format=%s > committed-as.txt; true")
    refs = sh("git", "for-each-ref", cwd=repo)
    res = run_agent(req(repo, validateCommand="true"), config=shell_agent(tmp_path, script, "required"))
    assert res.status is Status.completed and res.agent_changed_files == ["c.txt", "committed-as.txt"], res
    wt = Path(res.worktree_path)
    assert (wt / "committed-as.txt").read_text() == "agent\n", "the agent's own commit worked"
    # Its commit and its master live in the job's repo; the main repo's refs and store are as they were.
    assert sh("git", "for-each-ref", cwd=repo) == refs
    assert sh("git", "rev-parse", res.branch, cwd=wt).strip() == res.commit
    assert sh("git", "show", "--format=", "--name-only", res.commit, cwd=wt).split() == ["c.txt", "committed-as.txt"]
    sh("git", "fsck", "--full", "--strict", cwd=repo)


@needs_confinement
def test_validation_runs_confined_too(tmp_path, repo):
    # The main checkout: under bwrap a write under /tmp would land in the job's private tmpfs, unseen.
    outside = repo / "from-validation.txt"
    cfg = shell_agent(tmp_path, "echo x > a.txt", "auto")
    res = run_agent(req(repo, validateCommand=f"echo v > {outside}"), config=cfg)
    # The base's own run of it, confined as validation is, could not write there: refused before the agent.
    assert not outside.exists() and res.status is Status.failed and res.code is Code.BASELINE_FAILED, res
    assert "cannot" in res.summary and "validation cannot" in res.summary, res.summary
    control = run_agent(req(repo, validateCommand=f"echo v > {outside}"), config=shell_agent(tmp_path, "echo x > a.txt", "off"))
    assert control.status is Status.completed and outside.read_text() == "v\n"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _sleepers(tag: str) -> set[int]:
    out = set()
    for p in psutil.process_iter():
        try:
            if tag in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


@needs_confinement
def test_setsid_daemon_dies_with_a_confined_job(tmp_path, repo):
    tag = "317.25"  # a sleep length no other process uses
    cfg = shell_agent(tmp_path, f"setsid sleep {tag} & echo x > a.txt; sleep 0.2", "auto")
    res = run_agent(req(repo, validateCommand="true"), config=cfg)
    assert res.status is Status.completed
    assert not _sleepers(tag), "a setsid daemon outlived its confined job"
    # control: the same daemon started without proctor does outlive its parent
    subprocess.run(["/bin/sh", "-c", f"setsid sleep {tag} &"], check=True)
    time.sleep(0.2)
    left = _sleepers(tag)
    assert left, "control failed: the daemon did not start"
    for pid in left:
        os.kill(pid, 9)


def _restricted_path(tmp_path: Path) -> str:
    """A PATH with git and a python but no bwrap and no C compiler: a machine that gives no confinement."""
    d = tmp_path / "poorbin"
    d.mkdir()
    for tool in ("git", "sh", "env"):
        os.symlink(subprocess.check_output(["which", tool], text=True).strip(), d / tool)
    return str(d)


def test_required_fails_closed_where_the_machine_gives_nothing_with_auto_control(tmp_path, repo):
    marker = tmp_path / "launched"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[agents.sh]\ncommand = ["/bin/sh", "-c", "echo x > a.txt; : > {marker}"]\nprompt = "stdin"\n')
    env = {**os.environ, "PATH": _restricted_path(tmp_path), "PROCTOR_HOME": str(tmp_path / "fresh-home")}
    base = [PROCTOR, "run-agent", "--agent", "sh", "--task", "t", "--repo", str(repo), "--ticket", "T",
            "--config", str(cfg), "--validate-cmd", "true"]
    p = subprocess.run([*base, "--confine", "required"], capture_output=True, text=True, env=env)
    out = json.loads(p.stdout)
    assert p.returncode == 1 and out["code"] == "CONFINEMENT_UNAVAILABLE" and not marker.exists(), out
    p = subprocess.run([*base, "--confine", "auto"], capture_output=True, text=True, env=env)
    out = json.loads(p.stdout)
    assert out["status"] == "completed" and out["confinement"] == "none" and marker.exists(), out
    assert any("ran unconfined" in r for r in out["known_risks"]) and out["needs_human_review"] is True


def test_stop_kills_a_running_cli_agent_that_ignores_term(repo, fake):
    agent = fake("claude", Behaviour(sleep=120, ignore_term=True))
    holder: dict = {}
    t = threading.Thread(target=lambda: holder.setdefault("res", run_agent(req(repo, agent="claude"))))
    t.start()
    wait_until(agent.calls, 60, "the agent to start")
    pid = agent.calls()[0]["pid"]
    StopSwitch().engage("incident 42")
    # TERM is ignored here: the KILL after the grace ends it. How fast is measured in bench/stop.py; the
    # agent sleeps 120 s, so a join that returns means the stop killed it. The bound only stops a hang.
    t.join(timeout=60)
    assert not t.is_alive(), "the stop did not end the job"
    res = holder["res"]
    assert res.status is Status.failed and res.code is Code.STOPPED, res
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert any("incident 42" in r for r in res.known_risks) and len(agent.calls()) == 1
    # stopped before launch: nothing runs; control after resume: it runs
    again = run_agent(req(repo, agent="claude"))
    assert again.code is Code.STOPPED and len(agent.calls()) == 1
    StopSwitch().release()
    agent.set(Behaviour(writes={"a": "1"}))
    assert run_agent(req(repo, agent="claude", validateCommand="true")).status is Status.completed


def test_proctor_stop_ends_a_running_job(repo, fake):
    """`proctor stop` (TERM honoured) ends the running job as STOPPED and its agent with it. The latency
    (well inside 2 s unloaded) is measured in bench/stop.py, not asserted here: under load it is not a
    property of the code (issue 24)."""
    agent = fake("claude", Behaviour(sleep=120))
    holder: dict = {}
    t = threading.Thread(target=lambda: holder.setdefault("res", run_agent(req(repo, agent="claude"))))
    t.start()
    wait_until(agent.calls, 60, "the agent to start")
    pid = agent.calls()[0]["pid"]
    subprocess.run([PROCTOR, "stop", "--reason", "now"], check=True, capture_output=True, timeout=60)
    t.join(timeout=60)  # the agent sleeps 120 s: a join that returns means the stop ended it
    assert not t.is_alive() and holder["res"].code is Code.STOPPED, holder
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    StopSwitch().release()


def test_breaker_opens_after_consecutive_failures_and_refuses_without_launching(tmp_path, repo, fake):
    agent = fake("mine", Behaviour(exit_codes=[1]))
    cfg = tmp_path / "b.toml"
    cfg.write_text('confine = "off"\n[breaker]\nthreshold = 2\ncooldown_s = 3600\n'
                   '[agents.mine]\ncommand = ["mine", "{prompt}"]\n')
    config = load_config(cfg)
    for _ in range(2):
        assert run_agent(req(repo, agent="mine"), config=config).code is Code.AGENT_FAILED
    launched = len(agent.calls())
    assert launched == 4  # two jobs, each retried once
    res = run_agent(req(repo, agent="mine"), config=config)
    assert res.code is Code.CIRCUIT_OPEN and res.status is Status.failed and len(agent.calls()) == launched
    # control: another adapter is unaffected
    other = fake("claude", Behaviour(writes={"a": "1"}))
    assert run_agent(req(repo, agent="claude", validateCommand="true"), config=config).status is Status.completed
    assert len(other.calls()) == 1


def test_every_job_is_in_the_ledger_and_listed(repo, fake):
    fake("claude", Behaviour(writes={"a": "1"}))
    res = run_agent(req(repo, agent="claude", validateCommand="true"))
    bad = run_agent(req(repo, agent="claude", branch="missing"))
    ledger = Ledger.default()
    kinds = [(r.kind, r.job_id) for r in ledger.rows() if r.kind.startswith("job.")]
    assert ("job.start", res.job_id) in kinds and ("job.end", res.job_id) in kinds
    assert ("job.end", bad.job_id) in kinds
    assert ledger.verify() == []
    p = subprocess.run([PROCTOR, "jobs", "--json"], capture_output=True, text=True, check=True)
    listed = {j["jobId"] if "jobId" in j else j.get("job_id"): j for j in json.loads(p.stdout)}
    assert listed[res.job_id]["status"] == "completed"


# The sweep is machine-wide (cgroup.sweep_orphans: any proctor's next job kills a dead host's group and
# writes the row to its own ledger): a job in another xdist worker, or another suite on the machine, can
# sweep first. Seen under load beside another run: the orphan died, the row was in the other's ledger.
@pytest.mark.serial
def test_a_crashed_host_leaves_an_interrupted_job_not_nothing(repo, fake):
    agent = fake("claude", Behaviour(sleep=60))
    p = subprocess.Popen([PROCTOR, "run-agent", "--agent", "claude", "--task", "t", "--repo", str(repo),
                          "--ticket", "T"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Bounds, not latencies: a loaded machine took more than the old 10 s to start the CLI (issue 24).
    wait_until(agent.calls, 60, "the agent to start")
    p.kill()  # SIGKILL: no cleanup code runs
    p.communicate(timeout=60)
    out = json.loads(subprocess.run([PROCTOR, "jobs", "--json"], capture_output=True, text=True, check=True).stdout)
    assert [j["status"] for j in out] == ["interrupted"], out
    assert Ledger.default().verify() == []
    orphan = agent.calls()[0]["pid"]
    assert psutil.pid_exists(orphan), "control: the crashed host's agent runs on unwatched"
    # The next job on this machine sweeps the dead host's job group.
    agent.set(Behaviour(writes={"a": "1"}))
    run_agent(req(repo, agent="claude", validateCommand="true"))
    if cgroup.parent_dir() is not None:
        # The sweep's SIGKILL is delivered, but its exit is not instant on a loaded machine (was: 0.1 s).
        wait_until(lambda: _gone(orphan), 30, f"the orphan {orphan} to die")
        assert any(r.kind == "host.orphans_killed" for r in Ledger.default().rows())
    else:
        os.kill(orphan, 9)
    # What the killed host left in $TMPDIR (its job's two private dirs) is gc's to remove: the host had no
    # chance. Each run of the suite left a pair in /tmp before this.
    crashed = out[0]["jobId"]
    left = job_gc.job_tmpdirs(crashed)
    assert len(left) == 2, left  # the control: a killed host does leave them
    res = subprocess.run([PROCTOR, "gc", "--older-than", "0", "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert crashed in [j["jobId"] for j in json.loads(res.stdout)["jobs"]], res.stdout
    assert job_gc.job_tmpdirs(crashed) == [] and not any(p.exists() for p in left), left
