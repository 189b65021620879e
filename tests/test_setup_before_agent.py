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
from proctor.contract import RunAgentRequest, Status
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
    return f"mkdir -p deps && curl -sf --proxytunnel http://127.0.0.1:{port}/pkg -o deps/ready"


def test_setup_fetches_from_its_registry_before_the_agent(tmp_path, registry):
    res = job(tmp_path, f'setup = [{json.dumps(fetch(registry))}]\nregistries = ["127.0.0.1:{registry}"]\n')
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "package-1.0\n"  # the agent saw it
    assert res.changed_files == ["seen.txt"]  # setup's ignored output is not the job's change
    assert res.validation[0]["label"].startswith("setup before the agent:") and res.validation[0]["exit_code"] == 0
    rows = [r.payload for r in Ledger.default().rows() if r.kind == "egress.decision" and r.job_id == res.job_id]
    assert rows and all(r.get("allowed") for r in rows), rows
    # Before validation the same setup runs in a tree that holds the agent's code: no network there, so
    # a setup that needs the registry fails validation (README: code the agent wrote never gets one).
    again = [v for v in res.validation if v["label"].startswith("setup: ")]
    assert again and again[0]["exit_code"] != 0, res.validation
    assert res.status is Status.failed and len(rows) == 1, (res.status, rows)


def test_control_a_host_outside_the_registries_is_refused_and_the_agent_runs_without_it(tmp_path, registry):
    res = job(tmp_path, f'setup = [{json.dumps(fetch(registry))}]\nregistries = ["127.0.0.2:9"]\n')
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "missing\n"
    assert any("setup before the agent failed" in r for r in res.known_risks), res.known_risks
    rows = [r.payload for r in Ledger.default().rows() if r.kind == "egress.decision" and r.job_id == res.job_id]
    assert rows and not any(r.get("allowed") for r in rows), rows
    # The cause is in the result itself, not only in the ledger (issue 24).
    assert any("the network proxy refused requests to: 127.0.0.1:" in r for r in res.known_risks), res.known_risks


def test_control_setup_without_registries_has_no_network(tmp_path, registry):
    res = job(tmp_path, f'setup = [{json.dumps(fetch(registry))}]\n')
    assert (Path(res.worktree_path) / "seen.txt").read_text() == "missing\n"
    assert res.validation[0]["exit_code"] != 0


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
