"""A call the trusted policy holds for a person ends the job `approval_required` with the pending call in
the result; `proctor approve JOB CALL_ID` records a one-time grant that the next run of that ticket honours,
and only once. The stand-in CLI of test_gate_bypass.py (claude's hook protocol, real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_gate_bypass import config, job  # noqa: F401 - the fixture and the runner

from proctor.contract import Code, Status
from proctor.mechanisms.ledger.store import Ledger

PROCTOR = str(Path(sys.executable).with_name("proctor"))


def test_a_held_call_waits_for_a_person_and_a_grant_is_used_once(repo, config, proctor_home):  # noqa: F811
    (proctor_home / "policy.toml").write_text('[approve]\neffects = ["write"]\n')
    held = job(repo, config, "both")
    assert held.status is Status.approval_required and held.code is Code.APPROVAL_REQUIRED, held
    assert held.changed_files == [] and held.needs_human_review
    [pending] = held.gate["pending"]
    assert pending["tool"] == "Write" and pending["call_id"] == "toolu_1"

    shown = subprocess.run([PROCTOR, "approve", held.job_id, "toolu_1"], capture_output=True, text=True)
    assert shown.returncode == 1 and "nothing granted" in shown.stderr, shown  # shown first, never granted blind
    assert "tool:     Write" in shown.stdout and pending["input_sha256"] in shown.stdout, shown.stdout
    p = subprocess.run([PROCTOR, "approve", held.job_id, "toolu_1", "--reason", "reviewed",
                        "--digest", pending["input_sha256"][:16]], capture_output=True, text=True, env=os.environ)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["granted"] is True

    again = job(repo, config, "both")  # the next run of the ticket: the same call now runs
    assert again.status is Status.completed and again.changed_files == ["a.txt"], again
    used = [r.payload for r in Ledger.default().rows(kind="gate.grant_used")]
    assert len(used) == 1 and used[0]["jobId"] == again.job_id

    third = job(repo, config, "both")  # one-time: held again
    assert third.code is Code.APPROVAL_REQUIRED


def test_control_without_the_hold_the_call_runs_and_approve_refuses_an_unknown_call(repo, config):  # noqa: F811
    res = job(repo, config, "both")
    assert res.status is Status.completed and "pending" not in res.gate
    p = subprocess.run([PROCTOR, "approve", res.job_id, "toolu_1"], capture_output=True, text=True)
    assert p.returncode == 2 and "no call 'toolu_1' held" in p.stderr and "Traceback" not in p.stderr
