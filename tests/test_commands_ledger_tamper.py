"""The ledger's chain as command requests and jobs meet it: a row edited between two requests stops the next
one before it runs (LEDGER_TAMPERED, nothing recorded), `proctor ledger verify` names the row, and a command
that edits the ledger while it runs is reported as having run (`ran` true) with the tamper in its own field.
Real git projects, real processes, a real SQLite ledger edited the way a person with sqlite3 would."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from proctor import RunAgentRequest, Status, run_agent
from proctor.services.commands import LedgerTamperedError, RequestCode, isolation, run_request
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.confine import detect
from proctor.mechanisms.ledger.store import Ledger
from test_commands_support import PY, base_policy, home, project, request, toml_str, tools  # noqa: F401
from conftest import make_repo

PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]

# Edits one row of the ledger as a person would: drop the guard triggers, UPDATE, put the triggers back (so
# only the chain can tell). `recompute` also rewrites the row's own hash, as someone who read ledger.py would.
EDIT = r'''
import hashlib, json, sqlite3, sys
db_path, which, how = sys.argv[1:4]
try:
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("SELECT 1 FROM rows LIMIT 1")
except sqlite3.Error as exc:
    sys.exit(f"cannot open the ledger: {exc}")
row = db.execute("SELECT id, ts, kind, job_id, prev_hash FROM rows ORDER BY id " +
                 ("DESC" if which == "last" else "ASC") + " LIMIT 1").fetchone()
payload = json.dumps({"edited": True}, separators=(",", ":"))
digest = hashlib.sha256(json.dumps([row[4], row[0], row[1], row[2], row[3], payload], sort_keys=True,
                                   separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
try:
    db.executescript("DROP TRIGGER rows_no_update; DROP TRIGGER rows_no_delete;")
except sqlite3.Error as exc:
    sys.exit(f"cannot edit the ledger: {exc}")
if how == "recompute":
    db.execute("UPDATE rows SET payload = ?, hash = ? WHERE id = ?", (payload, digest, row[0]))
else:
    db.execute("UPDATE rows SET payload = ? WHERE id = ?", (payload, row[0]))
db.executescript(
    "CREATE TRIGGER rows_no_update BEFORE UPDATE ON rows BEGIN SELECT RAISE(ABORT, 'ledger is append-only'); END;"
    "CREATE TRIGGER rows_no_delete BEFORE DELETE ON rows BEGIN SELECT RAISE(ABORT, 'ledger is append-only'); END;")
db.close()
print(f"edited row {row[0]}")
'''


def policy(home: Path, tools: Path, *ledgers: Path) -> Path:
    (tools / "edit.py").write_text(EDIT)
    paths = json.dumps([str(p) for p in ledgers or (home / "ledger.sqlite3",)])
    extra = f'''
[[agents.codex.commands]]
name = "edit-ledger"
argv = [{toml_str(PY)}, {toml_str(tools / "edit.py")}, {{type = "choice", values = {paths}}},
        ["last", "first"], ["plain", "recompute"]]
'''
    path = home / "commands.toml"
    path.write_text(base_policy(tools, extra=extra))
    return path


def edit(db: Path, which: str, how: str = "plain") -> None:
    subprocess.run([PY, "-c", EDIT, str(db), which, how], check=True, capture_output=True)


def cli(tmp_path: Path, *args: str, req: object = None, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    if req is not None:
        (tmp_path / "req.json").write_text(json.dumps(req))
        args = ("run-request", "--request-file", str(tmp_path / "req.json"), *args)
    p = subprocess.run([*PROCTOR, *args], capture_output=True, text=True, env=env or os.environ.copy(), timeout=120)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p.returncode, p.stdout, p.stderr


def rows(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT count(*) FROM rows").fetchone()[0]


@pytest.mark.parametrize(("which", "how"), [("last", "plain"), ("last", "recompute"), ("first", "plain"),
                                            ("first", "recompute")])
def test_a_row_edited_between_requests_stops_the_next_one(which, how, tmp_path, tools, project, home) -> None:
    pol = policy(home, tools)
    db = home / "ledger.sqlite3"
    flags = ("--project", str(project), "--policy", str(pol))
    marker = project / "out" / "ran.txt"
    write = request(tools, "write", "out/ran.txt", expected_writes=["out/ran.txt"])
    # Control: on an intact ledger the same request runs, twice, and verify is clean.
    for _ in range(2):
        marker.unlink(missing_ok=True)
        code, out, _ = cli(tmp_path, *flags, req=write)
        assert code == 0 and json.loads(out)["ran"] is True and marker.exists(), out
    assert cli(tmp_path, "ledger", "verify")[0] == 0
    edit(db, which, how)
    before = rows(db)
    marker.unlink()
    code, out, err = cli(tmp_path, *flags, req=write)
    body = json.loads(out)
    assert code == 3 and body["code"] == "LEDGER_TAMPERED" and body["ran"] is False, (out, err)
    assert "changed outside proctor" in body["message"] and "proctor ledger verify" in body["message"]
    assert not marker.exists(), "the command ran on a broken ledger"
    assert rows(db) == before, "a row was chained onto the edited one"
    # A refusal that would otherwise be recorded is not recorded either.
    code, out, _ = cli(tmp_path, *flags, req=request(tools, "nope"))
    assert code == 3 and json.loads(out)["code"] == "LEDGER_TAMPERED" and rows(db) == before
    code, out, err = cli(tmp_path, "ledger", "verify")
    first_bad = json.loads(out)["problems"][0]
    # A recomputed hash moves the break to where the chain or the head no longer agrees with the row.
    named = {("first", "plain"): 1, ("first", "recompute"): 2, ("last", "plain"): before,
             ("last", "recompute"): before}[(which, how)]
    assert code == 1 and first_bad.startswith(f"row {named}:") and f"row {named}" in err, (out, err)


def test_the_open_check_walks_the_newest_rows_and_the_full_verify_all(tmp_path) -> None:
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        for i in range(50):
            led.append("gate.decision", {"i": i})
        assert led.verify() == [] and led.verify(last=10) == [] and led.verify(last=1) == []
        edit(led.path, "last")
        assert led.verify(last=1)[0].startswith("row 50:")  # the newest row is always walked
    with Ledger(tmp_path / "old.sqlite3") as led:
        for i in range(50):
            led.append("gate.decision", {"i": i})
        edit(led.path, "first")
        assert led.verify(last=49) == []  # outside the window: the bound is what it costs
        assert led.verify(last=50)[0].startswith("row 1:") and led.verify()[0].startswith("row 1:")
        db = sqlite3.connect(led.path)
        db.executescript("DROP TRIGGER rows_no_delete; DELETE FROM rows WHERE id = 7;"
                         "CREATE TRIGGER rows_no_delete BEFORE DELETE ON rows BEGIN SELECT RAISE(ABORT, 'x'); END;")
        db.close()
        assert led.verify(last=10)[0].startswith("row 7: missing")  # a deleted old row shows in the count


@pytest.mark.parametrize("machine", ["as-is", "without-bwrap"])
def test_a_command_that_edits_the_ledger_while_it_runs_ran_and_says_so(machine, tools, project, home,
                                                                       monkeypatch) -> None:
    caps = detect()
    if machine == "without-bwrap":  # the fallback where nothing can hide the ledger (isolation's seam)
        gone = dataclasses.replace(caps, bwrap=None, bwrap_reason="bwrap taken away by the test")
        monkeypatch.setattr(isolation, "capabilities", lambda: gone)
    reachable = machine == "without-bwrap" or caps.bwrap is None
    db = home / "ledger.sqlite3"
    pol = policy(home, tools)
    control = run_request(request(tools, "exit", "0"), project=project, policy=pol)
    assert control.ran and control.code == RequestCode.OK and control.tampered == []
    edit_req = {**request(tools), "argv": [PY, str(tools / "edit.py"), str(db), "last", "plain"]}
    if not reachable:
        # Control: bwrap hides $PROCTOR_HOME, so the same command cannot edit it; it ran, and failed.
        result = run_request(edit_req, project=project, policy=pol)
        assert result.ran and result.code == RequestCode.EXIT_NONZERO and result.tampered == []
        with Ledger(db) as led:
            assert led.verify() == [] and led.rows()[-1].kind == "run-request-end"
        return
    with pytest.raises(LedgerTamperedError) as info:
        run_request(edit_req, project=project, policy=pol)
    result = info.value.result
    assert result is not None and result.ran is True and result.exit == 0, result
    assert result.code == RequestCode.LEDGER_TAMPERED and "edited row" in result.stdout
    assert any(t.startswith(str(db)) for t in result.tampered)  # the file or its WAL
    assert result.ledger_problems and "content does not match" in result.ledger_problems[0]
    with Ledger(db) as led:
        assert led.rows()[-1].kind == "run-request-start"  # nothing more recorded after the tamper
    # ...and the next request on that ledger runs nothing.
    with pytest.raises(LedgerTamperedError) as nxt:
        run_request(request(tools, "write", "out/next.txt", expected_writes=["out/next.txt"]),
                    project=project, policy=pol)
    assert nxt.value.result is None and not (project / "out" / "next.txt").exists()


def path_without_bwrap(tmp_path: Path) -> str:
    """A real machine without bubblewrap: PATH holds git and nothing else."""
    bin_dir = tmp_path / "no-bwrap-bin"
    bin_dir.mkdir()
    (bin_dir / "git").symlink_to(shutil.which("git"))
    return str(bin_dir)


def test_run_request_cli_prints_a_tampering_run_as_ran_with_exit_3(tmp_path, tools, project, home) -> None:
    pol = policy(home, tools)
    flags = ("--project", str(project), "--policy", str(pol))
    db = home / "ledger.sqlite3"
    tamper = {**request(tools), "argv": [PY, str(tools / "edit.py"), str(db), "last", "plain"]}
    env = {**os.environ, "PATH": path_without_bwrap(tmp_path)}
    code, out, _ = cli(tmp_path, *flags, req=request(tools, "exit", "0"), env=env)
    assert code == 0 and json.loads(out)["tampered"] == []  # control: an untampered run
    code, out, err = cli(tmp_path, *flags, req=tamper, env=env)
    body = json.loads(out)
    assert code == 3 and body["ran"] is True and body["exit"] == 0 and body["code"] == "LEDGER_TAMPERED", out
    assert any(t.startswith(str(db)) for t in body["tampered"]) and body["exposed"] and "LEDGER_TAMPERED" in err
    assert cli(tmp_path, "ledger", "verify")[0] == 1
    # With bwrap, the same command cannot reach the ledger at all: it runs, fails, and nothing is tampered.
    if detect().bwrap is not None:
        fresh = tmp_path / "fresh-home"
        fresh.mkdir()
        pol2 = policy(fresh, tools, fresh / "ledger.sqlite3")
        env2 = {**os.environ, "PROCTOR_HOME": str(fresh)}
        cli(tmp_path, "--project", str(project), "--policy", str(pol2), req=request(tools, "exit", "0"), env=env2)
        tamper2 = {**tamper, "argv": [PY, str(tools / "edit.py"), str(fresh / "ledger.sqlite3"), "last", "plain"]}
        code, out, _ = cli(tmp_path, "--project", str(project), "--policy", str(pol2), req=tamper2, env=env2)
        body = json.loads(out)
        assert code == 1 and body["ran"] is True and body["code"] == "EXIT_NONZERO" and body["tampered"] == []
        assert cli(tmp_path, "ledger", "verify", env=env2)[0] == 0


def test_run_agent_refuses_a_broken_chain_before_launching(tmp_path, home) -> None:
    repo = make_repo(tmp_path)
    cfg = tmp_path / "agents.toml"
    cfg.write_text(f'confine = "off"\n[agents.touch]\ncommand = [{toml_str(PY)}, "-c", '
                   '"open(\'touched.txt\', \'w\').write(\'hi\')"]\nprompt = "stdin"\n')
    req = RunAgentRequest(agent="touch", task="t", repo=str(repo), ticket="T1", validateCommand="true")
    control = run_agent(req, config=load_config(cfg))
    assert control.code.value != "LEDGER_TAMPERED" and control.worktree_path, control
    db = home / "ledger.sqlite3"
    before = rows(db)
    assert before >= 2
    edit(db, "first")
    res = run_agent(req.model_copy(update={"ticket": "T2"}), config=load_config(cfg))
    assert res.status == Status.failed and res.code.value == "LEDGER_TAMPERED"
    assert "changed outside proctor" in res.summary and "row 1" in res.summary
    assert not res.worktree_path and rows(db) == before

