"""A repo's `setup` runs in the agent's worktree before the agent (so the agent can run the tests as it
works), confined, its network only the repo's `registries` through a proxy of its own; its failure is a risk.
Real bwrap/Landlock, a real loopback "registry"; under CI=true a machine without confinement fails."""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import pytest
from conftest import make_repo

from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect
from proctor.contract import Code, RunAgentRequest, Status
from proctor.services.job.run_agent import run_agent
from proctor.mechanisms.ledger.store import Ledger

CAPS = detect()
if CAPS.bwrap is None and not CAPS.landlock and os.environ.get("CI") == "true":
    pytest.fail("CI must have bwrap or Landlock for the setup tests", pytrace=False)
pytestmark = pytest.mark.skipif(CAPS.bwrap is None and not CAPS.landlock, reason="no OS confinement here")

# The agent works only where setup ran first: it records what it found, as a test run would.
AGENT = ('[agents.st]\ncommand = ["sh", "-c", "cat deps/ready > seen.txt 2>&1 || echo missing > seen.txt"]\n'
         'prompt = "stdin"\nnetwork = false\n')


@pytest.fixture
def registry():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"package-1.0\n"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def job(tmp_path: Path, proctor_toml: str):
    repo = make_repo(tmp_path, {"README.md": "x\n", ".gitignore": "deps/\n", ".proctor.toml": proctor_toml})
    cfg = tmp_path / "c.toml"
    cfg.write_text('confine = "required"\n' + AGENT)
    req = RunAgentRequest(agent="st", task="t", repo=str(repo), ticket="T", validateCommand="true")
    return run_agent(req, config=load_config(cfg))


def fetch(port: int) -> str:
    """Fetch the package, and (offline, as in validation) fail: setup that needs the registries."""
    return f"mkdir -p deps && curl -sf --proxytunnel http://127.0.0.1:{port}/pkg -o deps/ready"


def fetch_or_note(port: int) -> str:
    """The same fetch, which succeeds offline too (noting it): a setup validation can run, so the job goes on."""
    return f"{fetch(port)} || echo offline > deps/offline"


def rows_of(res, kind: str = "egress.decision") -> list:
    return [r.payload for r in Ledger.default().rows() if r.kind == kind and r.job_id == res.job_id]


def test_setup_fetches_from_its_registry_before_the_agent(tmp_path, registry):
    res = job(tmp_path, f'setup = [{json.dumps(fetch_or_note(registry))}]\nregistries = ["127.0.0.1:{registry}"]\n')
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "package-1.0\n"  # the agent saw it
    assert res.changed_files == ["seen.txt"]  # setup's ignored output is not the job's change
    assert res.validation[0]["label"].startswith("setup before the agent:") and res.validation[0]["exit_code"] == 0
    rows = rows_of(res)
    assert len(rows) == 1 and rows[0].get("allowed"), rows  # before the agent only: validation had no network
    assert res.status is Status.completed, (res.known_risks, res.validation)


def test_a_setup_that_needs_the_network_in_validation_is_refused_before_the_agent(tmp_path, registry):
    """Before validation the same setup runs in a tree that holds the agent's code: no network there (code
    the agent wrote never gets one). A setup that cannot run offline can never validate: the base's own run
    says so before any agent runs, naming the step, and nothing launches."""
    res = job(tmp_path, f'setup = [{json.dumps(fetch(registry))}]\nregistries = ["127.0.0.1:{registry}"]\n')
    assert res.status is Status.failed and res.code is Code.BASELINE_FAILED, (res.code, res.known_risks)
    assert "the repo's setup fails on the base" in res.summary and "curl" in res.summary, res.summary
    assert not (Path(res.worktree_path) / "seen.txt").exists(), "the agent ran"
    rows = rows_of(res)
    assert len(rows) == 1 and rows[0].get("allowed"), rows  # the fetch before the agent did reach it


def test_control_a_host_outside_the_registries_is_refused_and_the_agent_runs_without_it(tmp_path, registry):
    res = job(tmp_path, f'setup = [{json.dumps(fetch_or_note(registry))}]\nregistries = ["127.0.0.2:9"]\n')
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "missing\n"
    rows = rows_of(res)
    assert rows and not any(r.get("allowed") for r in rows), rows
    # The cause is in the result itself, not only in the ledger (issue 24).
    assert any("the network proxy refused requests to: 127.0.0.1:" in r for r in res.known_risks), res.known_risks


def test_control_setup_without_registries_has_no_network(tmp_path, registry):
    res = job(tmp_path, f'setup = [{json.dumps(fetch(registry))}]\n')
    assert res.validation[0]["exit_code"] != 0  # setup before the agent: no network
    res = job(tmp_path / "noted", f'setup = [{json.dumps(fetch_or_note(registry))}]\n')
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "missing\n"
    assert not rows_of(res)


def test_setup_runs_in_the_same_environment_before_the_agent_as_before_validation(tmp_path):
    """The repo's own `.venv` (not active) is on PATH for setup before the agent as it is before validation:
    `tox: not found` (exit 127) before the agent, found after (issue 24)."""
    import sys

    repo = make_repo(tmp_path, {"README.md": "x\n", ".gitignore": ".venv/\ntool.txt\n",
                                "pyproject.toml": '[project]\nname = "x"\nversion = "0"\n',
                                ".proctor.toml": 'setup = ["mytool > tool.txt"]\n'})
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(os.path.realpath(sys.executable))
    (bin_dir / "mytool").write_text("#!/bin/sh\necho tool-ran\n")
    (bin_dir / "mytool").chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text('confine = "required"\n[agents.st]\ncommand = ["sh", "-c", "cat tool.txt > seen.txt 2>&1"]\n'
                   'prompt = "stdin"\nnetwork = false\n')
    res = run_agent(RunAgentRequest(agent="st", task="t", repo=str(repo), ticket="T", validateCommand="true"),
                    config=load_config(cfg))
    before = [v for v in res.validation if v["label"].startswith("setup before the agent:")]
    again = [v for v in res.validation if v["label"].startswith("setup: ")]
    assert before and before[0]["exit_code"] == 0, res.validation
    assert again and again[0]["exit_code"] == 0, res.validation  # control: before validation it always ran
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "tool-ran\n"


@pytest.mark.parametrize("links", [True, False])
def test_a_hard_link_setup_leaves_in_the_worktree_is_a_risk(tmp_path, links):
    """The job's checkout has no hard links (the host's fresh checkout); setup is the one writer before the
    agent, and a file it leaves linked (as a package manager linking from its store does) is writable
    through the worktree to its other name: a risk naming it. Control: the same setup copying instead."""
    make = "ln README.md readme.link" if links else "cp README.md readme.link"
    res = job(tmp_path, f'setup = [{json.dumps(make)}]\n')
    before = [v for v in res.validation if v["label"].startswith("setup before the agent:")]
    assert before and before[0]["exit_code"] == 0, res.validation
    linked = [r for r in res.known_risks if "more than one hard link" in r]
    if links:
        assert linked and "README.md" in linked[0] and "readme.link" in linked[0], res.known_risks
    else:
        assert not linked, res.known_risks
