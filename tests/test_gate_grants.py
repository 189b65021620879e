"""A person's one-time grant is used once and only for the exact call it names (issue 22, items 5 and 6), and
`proctor approve` shows the call before it grants it, by digest (issue 23, item 8).

- The race: two processes (two jobs of one ticket released at once), each its own gate service and ledger
  handle on one ledger of over 5,000 rows, ask for the granted call together, 50 rounds: exactly one runs
  each round. Control: with two grants in a round both run (the harness sees a double when there is one);
  and the read-then-append claim the gate used before doubles in this harness.
- The `<worktree>` confusion: a grant for `cat <the worktree> calc.py` never covers the typed text
  `cat <worktree> calc.py`; control: the approved call itself, in the next job's worktree, runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proctor.mechanisms.gatekeeper.claude import ClaudeDialect
from proctor.mechanisms.gatekeeper.grant import input_digest
from proctor.mechanisms.gatekeeper.service import GateService
from proctor.mechanisms.gatekeeper.task import default_task
from proctor.mechanisms.ledger.rows import Entry
from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger
from proctor.mechanisms.policy.trusted import Policy

PROCTOR = str(Path(sys.executable).with_name("proctor"))
ROUNDS = 50
LONG = 5_000


def gate(home: Path, ledger: Ledger, worktree: Path, job: str, cls: type[GateService] = GateService) -> GateService:
    """A job's gate as the host makes it (no socket: `handle` is what the socket calls), ticket T of repo R."""
    worktree.mkdir(parents=True, exist_ok=True)
    task = default_task("t", worktree, False, ClaudeDialect.tools)
    return cls(ClaudeDialect(), task, Policy.load(home), ledger, job, home / f"gate-{job}",
                       stop=lambda: None, worktree=worktree, ticket="T", repo="R")


def ask(service: GateService, tool: str, tool_input: dict, call_id: str) -> str:
    """One PreToolUse as claude's hook sends it; the hook's permissionDecision (allow / deny)."""
    payload = {"hook_event_name": "PreToolUse", "tool_name": tool, "tool_use_id": call_id, "tool_input": tool_input}
    raw = json.dumps({"cli": "claude", "event": "PreToolUse", "payload": json.dumps(payload)}).encode()
    answer = service.handle(raw)
    return json.loads(answer.stdout)["hookSpecificOutput"]["permissionDecision"]


def write_input(worktree: Path) -> dict:
    return {"file_path": f"{worktree}/a.txt", "content": "x"}


def grant_row(ledger: Ledger, tool: str, tool_input: dict, worktree: Path) -> int:
    return ledger.append("gate.grant", {"ticket": "T", "repo": "R", "tool": tool, "by": "test",
                                        "input_sha256": input_digest(tool_input, worktree, tool=tool)})


class ReadThenAppend(GateService):
    """The claim as the gate made it before: the used grants read, then `gate.grant_used` appended, no lock
    across the two. Only for the control: this harness must see the double it allowed."""

    def _grant(self, call):
        used = {r.payload.get("grant") for r in self.ledger.rows(kind="gate.grant_used")}
        for row in self.ledger.rows(kind="gate.grant"):
            if row.id not in used and row.payload.get("input_sha256") == self._digest:
                self._write("gate.grant_used", {"jobId": self.job_id, "grant": row.id, "call_id": call.call_id})
                return f"grant #{row.id}"
        return None


def worktree(home: Path, n: int) -> Path:
    return home.parent / f"{home.name}-wt{n}"  # never inside PROCTOR_HOME (the gate refuses that workspace)


def _worker(n: int, home: str, path: str, barrier, results, old: bool) -> None:
    os.environ["PROCTOR_HOME"] = home
    with Ledger(path) as ledger:
        wt = worktree(Path(home), n)
        service = gate(Path(home), ledger, wt, f"job{n}", ReadThenAppend if old else GateService)
        for r in range(ROUNDS):
            barrier.wait()  # the round's grant(s) are written
            results.put((r, n, ask(service, "Write", write_input(wt), f"toolu_{r}")))
            barrier.wait()  # both answered


def race(home: Path, grants_per_round, *, old: bool = False) -> dict[int, list[str]]:
    """50 rounds of two processes asking for a call the round granted; each round's decisions."""
    path = home / LEDGER_FILE
    with Ledger(path) as ledger:
        ledger.update(lambda _db: (None, [Entry("job.note", {"i": i, "pad": "x" * 64}, f"old{i % 50}")
                                          for i in range(LONG)]))
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(n, str(home), str(path), barrier, results, old)) for n in (1, 2)]
    for w in workers:
        w.start()
    rounds: dict[int, list[str]] = {}
    try:
        with Ledger(path) as ledger:
            for r in range(ROUNDS):
                for _ in range(grants_per_round(r)):
                    grant_row(ledger, "Write", write_input(worktree(home, 0)), worktree(home, 0))
                barrier.wait(timeout=60)
                for _ in range(2):
                    got_r, _n, verdict = results.get(timeout=60)
                    rounds.setdefault(got_r, []).append(verdict)
                barrier.wait(timeout=60)
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]
    return rounds


@pytest.fixture
def held_home(proctor_home):
    (proctor_home / "policy.toml").write_text('[approve]\neffects = ["write", "shell"]\n')
    return proctor_home


def test_two_processes_claim_one_grant_exactly_once_each_round(held_home):
    rounds = race(held_home, lambda r: 1)
    assert len(rounds) == ROUNDS
    runs = {r: v.count("allow") for r, v in rounds.items()}
    assert all(n == 1 for n in runs.values()), {r: n for r, n in runs.items() if n != 1}
    with Ledger(held_home / LEDGER_FILE) as ledger:
        used = [r.payload for r in ledger.rows(kind="gate.grant_used")]
        assert len(used) == ROUNDS and len({u["grant"] for u in used}) == ROUNDS
        assert ledger.verify() == [] and len(ledger.rows()) > LONG


def test_control_two_grants_in_a_round_run_twice(held_home):
    rounds = race(held_home, lambda r: 2 if r % 10 == 0 else 1)
    runs = {r: v.count("allow") for r, v in rounds.items()}
    assert all(runs[r] == (2 if r % 10 == 0 else 1) for r in runs), runs


def test_control_the_read_then_append_claim_doubles_here(held_home):
    rounds = race(held_home, lambda r: 1, old=True)
    doubled = [r for r, v in rounds.items() if v.count("allow") == 2]
    print(f"read-then-append: {len(doubled)} of {ROUNDS} rounds ran the one-time call twice")
    assert doubled, "the harness never raced: it would not see a double claim"


def test_claim_once_is_a_compare_and_set(tmp_path):
    with Ledger(tmp_path / LEDGER_FILE) as ledger:
        assert ledger.claim_once("x.used", "k1", {"a": 1}, job_id="j") == 1
        assert ledger.claim_once("x.used", "k1", {"a": 2}) is None
        assert ledger.claim_once("x.used", "k2", {"a": 3}) == 2
        assert ledger.claim_once("y.used", "k1", {}) == 3  # claims are per kind
        assert [r.payload for r in ledger.rows(kind="x.used")] == [{"a": 1, "claim": "k1"}, {"a": 3, "claim": "k2"}]


# -- exact: the grant names the canonical input ------------------------------------------------------------

def approve(job: str, call: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROCTOR, "approve", job, call, *extra], check=False, capture_output=True, text=True)


def held_digest(ledger: Ledger, job: str, call: str) -> str:
    [row] = [r.payload for r in ledger.rows(kind="gate.call", job_id=job) if r.payload["call_id"] == call]
    assert row["code"] == "APPROVAL_REQUIRED", row
    return row["input_sha256"]


def test_a_grant_for_the_worktree_path_never_covers_the_text_worktree(held_home, tmp_path):
    with Ledger.default() as ledger:
        first = gate(held_home, ledger, tmp_path / "wt-a", "job-a")
        cat = {"command": f"cat {tmp_path / 'wt-a'} calc.py"}  # bash: cat <dir> calc.py (reads only)
        assert ask(first, "Bash", cat, "toolu_1") == "deny"
        digest = held_digest(ledger, "job-a", "toolu_1")
    p = approve("job-a", "toolu_1", "--digest", digest)
    assert p.returncode == 0 and json.loads(p.stdout)["granted"], p.stderr

    with Ledger.default() as ledger:
        nxt = gate(held_home, ledger, tmp_path / "wt-b", "job-b")
        # The typed text `<worktree>`: bash reads `cat < worktree > calc.py` (overwrites calc.py).
        assert ask(nxt, "Bash", {"command": "cat <worktree> calc.py"}, "toolu_2") == "deny"
        assert ask(nxt, "Bash", {"command": "cat  calc.py"}, "toolu_3") == "deny"  # the path cut out, not typed
        assert ask(nxt, "Bash", {"command": f"cat {tmp_path / 'wt-b'} calc.py "}, "toolu_4") == "deny"
        assert ledger.rows(kind="gate.grant_used") == []
        # Control: the approved call itself, in this job's worktree, runs, once.
        assert ask(nxt, "Bash", {"command": f"cat {tmp_path / 'wt-b'} calc.py"}, "toolu_5") == "allow"
        assert ask(nxt, "Bash", {"command": f"cat {tmp_path / 'wt-b'} calc.py"}, "toolu_6") == "deny"
        assert len(ledger.rows(kind="gate.grant_used")) == 1


def test_the_digest_is_the_tool_and_the_input_with_the_worktree_cut_out(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    same = input_digest({"command": f"cat {a}/x {a}"}, a, tool="Bash")
    assert same == input_digest({"command": f"cat {b}/x {b}"}, b, tool="Bash")
    assert same != input_digest({"command": f"cat {b}/x {b}"}, b, tool="Write")
    assert same != input_digest({"command": f"cat {a}/x {a}"}, b, tool="Bash")
    assert same != input_digest({"command": "cat <worktree>/x <worktree>"}, b, tool="Bash")
    assert input_digest({"c": [f"{a}", "x"]}, a, tool="T") != input_digest({"c": [f"{a}x"]}, a, tool="T")


# -- approve shows what it approves ------------------------------------------------------------------------

def test_approve_shows_the_held_call_escaped_and_cut_and_grants_only_by_its_digest(held_home, tmp_path):
    wt = tmp_path / "wt"
    hostile = "\x1b[2J\x1b]0;owned\x07 notes\u202etxt.sh " + "y" * 5000
    with Ledger.default() as ledger:
        service = gate(held_home, ledger, wt, "job-s")
        assert ask(service, "Write", {"file_path": f"{wt}/a\u202etxt.sh", "content": hostile}, "toolu_9") == "deny"
        assert ask(service, "Bash", {"command": "rm -rf build\x1b[A"}, "toolu_10") == "deny"
        digest = held_digest(ledger, "job-s", "toolu_9")

    shown = approve("job-s", "toolu_9")
    assert shown.returncode == 1 and "nothing granted" in shown.stderr and digest in shown.stderr, shown
    out = shown.stdout
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out, out[:300]
    assert "tool:     Write" in out and f"path:     {wt}/a\\u202etxt.sh" in out, out[:600]
    assert "\\x1b[2J\\x1b]0;owned\\x07 notes\\u202etxt.sh" in out and "(cut: 2000 of " in out
    assert f"digest:   {digest}" in out and f"worktree: {wt}" in out
    cmd = approve("job-s", "toolu_10").stdout
    assert "command:  rm -rf build\\x1b[A" in cmd and "\x1b" not in cmd, cmd

    with Ledger.default() as ledger:
        assert ledger.rows(kind="gate.grant") == []  # showing granted nothing
    for bad in ("0" * 64, digest[:8], "zz" + digest[2:]):
        p = approve("job-s", "toolu_9", "--digest", bad)
        assert p.returncode == 2 and "--digest" in p.stderr and "Traceback" not in p.stderr, (bad, p.stderr)
    other = approve("job-s", "toolu_9", "--digest", held_digest(Ledger.default(), "job-s", "toolu_10"))
    assert other.returncode == 2, other  # the other held call's digest names not this one
    p = approve("job-s", "toolu_9", "--digest", digest[:12].upper())
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["input_sha256"] == digest
