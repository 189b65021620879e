"""`proctor stop|resume|check-task|decide|ledger verify`: JSON out, exit 0 for any reached decision,
exit 2 with one line (never a traceback) for unusable input, exit 1 naming the first bad ledger row."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from proctor.surfaces.cli import main
from proctor.mechanisms.ledger.store import Ledger

PROCTOR = Path(sys.executable).with_name("proctor")


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    return fresh_home


@pytest.fixture
def ws(tmp_path) -> Path:
    w = tmp_path / "ws"
    w.mkdir()
    (w / "a.py").write_text("")
    return w


@pytest.fixture
def files(tmp_path, ws):
    def write(name: str, data: object) -> str:
        p = tmp_path / name
        p.write_text(data if isinstance(data, str) else json.dumps(data))
        return str(p)

    task = {"goal": "g", "tools": [{"name": "read", "effect": "read"}, {"name": "sh", "effect": "shell"}],
            "permissions": {"workspace": str(ws), "read_files": True, "shell": True},
            "limits": {"max_steps": 500}}
    write.task = write("task.json", task)  # type: ignore[attr-defined]
    write.task_data = task  # type: ignore[attr-defined]
    return write


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_stop_and_resume(home, files):
    code, out, _ = cli("stop", "--reason", "incident 42")
    assert code == 0 and json.loads(out)["reason"] == "incident 42"
    assert (home / "STOP").exists()
    call = files("call.json", {"tool": "read", "paths": ["a.py"]})
    code, out, _ = cli("decide", "--task-file", files.task, "--call-file", call)
    assert code == 0 and json.loads(out)["code"] == "STOPPED"
    code, out, _ = cli("resume")
    assert code == 0 and json.loads(out) == {"stopped": False, "was": "incident 42", "path": str(home / "STOP")}
    code, out, _ = cli("decide", "--task-file", files.task, "--call-file", call)
    assert json.loads(out)["verdict"] == "run"


def test_check_task_prints_the_task_as_run(files):
    code, out, _ = cli("check-task", "--task-file", files.task)
    plan = json.loads(out)
    assert code == 0 and plan["verdict"] == "ready" and plan["limits"]["max_steps"] == 25
    assert plan["limits_lowered"] == ["max_steps 500 -> 25"]
    sh = next(t for t in plan["tools"] if t["name"] == "sh")
    assert sh["permitted"] and sh["outward"] and not sh["needs_network"]


def test_check_task_blocked_workspace_is_still_a_decision(files, home):
    data = dict(files.task_data, permissions={"workspace": str(home.parent)})
    code, out, _ = cli("check-task", "--task-file", files("bad-ws.json", data))
    assert code == 0 and json.loads(out)["code"] == "WORKSPACE"


@pytest.mark.parametrize("call,verdict,code", [
    ({"tool": "read", "paths": ["a.py"], "call_id": "1"}, "run", "OK"),
    ({"tool": "sh", "arguments": {"argv": ["ls"]}}, "dry_run", "OK"),
    ({"tool": "read", "paths": ["../../etc/passwd"]}, "refused", "OUTSIDE_WORKSPACE"),
    ({"tool": "write", "paths": ["a.py"]}, "refused", "TOOL_UNDECLARED"),
])
def test_decide_exit_0_for_every_reached_decision(files, call, verdict, code):
    rc, out, _ = cli("decide", "--task-file", files.task, "--call-file", files("c.json", call))
    d = json.loads(out)
    assert rc == 0 and (d["verdict"], d["code"]) == (verdict, code)


def test_decide_live_flag(files):
    call = files("c.json", {"tool": "sh"})
    assert json.loads(cli("decide", "--task-file", files.task, "--call-file", call, "--live")[1])["verdict"] == "run"


@pytest.mark.parametrize("case,match", [
    ("missing task file", "cannot be read"),
    ("bad json", "not valid JSON"),
    ("unknown task field", "approved"),
    ("unknown call field", "approved"),
    ("bad policy", "policy"),
])
def test_unusable_input_exit_2_one_line(files, home, tmp_path, case, match):
    task, call = files.task, files("c.json", {"tool": "read", "paths": ["a.py"]})
    if case == "missing task file":
        task = str(tmp_path / "nope.json")
    elif case == "bad json":
        task = files("bad.json", "{not json")
    elif case == "unknown task field":
        task = files("t2.json", dict(files.task_data, approved=True))
    elif case == "unknown call field":
        call = files("c2.json", {"tool": "read", "paths": ["a.py"], "approved": True})
    elif case == "bad policy":
        home.mkdir(parents=True, exist_ok=True)
        (home / "policy.toml").write_text("[ceilings]\nmax_steps = -1\n")
    rc, out, err = cli("decide", "--task-file", task, "--call-file", call)
    assert rc == 2 and out == "" and match in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_control_valid_input_exit_0(files):
    call = files("c.json", {"tool": "read", "paths": ["a.py"]})
    rc, _, err = cli("decide", "--task-file", files.task, "--call-file", call)
    assert rc == 0 and err == ""


def test_real_console_script_never_tracebacks(files, tmp_path, home):
    assert PROCTOR.exists()
    env = dict(os.environ, PROCTOR_HOME=str(home))
    bad = subprocess.run([str(PROCTOR), "check-task", "--task-file", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.startswith("proctor: ")
    good = subprocess.run([str(PROCTOR), "check-task", "--task-file", files.task],
                          capture_output=True, text=True, env=env, timeout=60)
    assert good.returncode == 0 and json.loads(good.stdout)["verdict"] == "ready"


def test_ledger_verify_clean_then_tampered(home):
    assert json.loads(cli("ledger", "verify")[1])["rows"] == 0  # no ledger yet
    with Ledger.default() as led:
        for i in range(4):
            led.append("gate.decision", {"i": i})
    rc, out, _ = cli("ledger", "verify")
    assert rc == 0 and json.loads(out) == {"ok": True, "rows": 4, "problems": [], "path": str(led.path)}
    db = sqlite3.connect(led.path)
    db.executescript("DROP TRIGGER rows_no_update; UPDATE rows SET payload = '{\"i\":9}' WHERE id = 2;")
    db.close()
    rc, out, err = cli("ledger", "verify")
    assert rc == 1 and json.loads(out)["problems"][0].startswith("row 2:") and "row 2" in err
