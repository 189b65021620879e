"""`proctor run-request` as a user runs it: a real subprocess, JSON on stdout, the documented exit status,
and never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from proctor.mechanisms.confine import detect
from test_commands_support import home, policy_file, project, request, tools  # noqa: F401  (fixtures)

PROCTOR = [sys.executable, "-c", "from proctor.surfaces.cli import main; main()"]


def cli(tmp_path: Path, req: object, *flags: str, raw: str | None = None, cwd: Path | None = None
        ) -> tuple[int, dict, str]:
    path = tmp_path / "req.json"
    path.write_text(raw if raw is not None else json.dumps(req))
    p = subprocess.run([*PROCTOR, "run-request", "--request-file", str(path), *flags], capture_output=True,
                       text=True, env=os.environ.copy(), timeout=60, cwd=cwd)
    assert "Traceback" not in p.stdout + p.stderr
    return p.returncode, json.loads(p.stdout), p.stderr


def test_ok_run_prints_the_result_and_exits_0(tmp_path, tools, project, policy_file) -> None:
    req = request(tools, "write", "out/c.txt", expected_writes=["out/c.txt"])
    code, out, _ = cli(tmp_path, req, "--project", ".", "--policy", str(policy_file), cwd=project)
    assert code == 0 and out["ran"] and out["exit"] == 0 and out["undeclared_writes"] == []
    assert list(out)[:9] == ["agent", "argv", "exit", "duration_ms", "stdout", "stderr", "truncated",
                             "undeclared_writes", "ran"]
    assert (project / "out" / "c.txt").exists()


def test_the_default_policy_is_the_one_in_proctor_home(tmp_path, tools, project, policy_file) -> None:
    req = request(tools, "write", "out/c.txt", expected_writes=["out/c.txt"])
    code, out, _ = cli(tmp_path, req, "--project", str(project), "--dry-run")
    assert code == 1 and out["ran"] is False and out["code"] == "DRY_RUN"
    assert not (project / "out" / "c.txt").exists()


def test_a_refusal_is_json_with_a_code_and_exit_2(tmp_path, tools, project, policy_file) -> None:
    req = {**request(tools, "write", "out/c.txt"), "argv": "rm -rf /"}
    code, out, _ = cli(tmp_path, req, "--project", str(project), "--policy", str(policy_file))
    assert code == 2 and out["code"] == "ARGV_SHELL_STRING" and "shell string" in out["message"]
    code, out, _ = cli(tmp_path, None, "--project", str(project), raw="{not json")
    assert code == 2 and out["code"] == "REQUEST_UNREADABLE"
    code, out, _ = cli(tmp_path, request(tools, "exit", "0"), "--project", str(tmp_path / "missing"))
    assert code == 2 and out["code"] == "PROJECT_INVALID"


def test_undeclared_writes_and_failures_exit_1_with_the_full_result(tmp_path, tools, project, policy_file) -> None:
    code, out, _ = cli(tmp_path, request(tools, "write", "build/x.o"), "--project", str(project),
                       "--policy", str(policy_file))
    assert code == 1 and out["code"] == "UNDECLARED_WRITES" and out["undeclared_writes"] == ["build/x.o"]
    code, out, _ = cli(tmp_path, request(tools, "exit", "4"), "--project", str(project), "--policy", str(policy_file))
    assert code == 1 and out["exit"] == 4 and out["ran"]


def test_tampering_exits_3_or_cannot_happen(tmp_path, tools, project, policy_file, home) -> None:
    req = request(tools, "tamper", str(home / "ledger.head"))
    cli(tmp_path, request(tools, "exit", "0"), "--project", str(project), "--policy", str(policy_file))
    code, out, _ = cli(tmp_path, req, "--project", str(project), "--policy", str(policy_file))
    if detect().bwrap is not None:  # $PROCTOR_HOME is hidden (an empty read-only folder): no tamper to see
        assert code == 1 and out["code"] == "EXIT_NONZERO" and "Read-only file system" in out["stderr"]
        assert out["hidden"] and out["exposed"] == []
    else:
        assert code == 3 and out["code"] == "LEDGER_TAMPERED"


def test_a_deeply_nested_request_is_unusable_input_not_a_traceback(tmp_path, tools, project, policy_file) -> None:
    code, out, _ = cli(tmp_path, None, "--project", str(project), "--policy", str(policy_file),
                       raw="[" * 200_000 + "]" * 200_000)
    assert code == 2 and out["code"] == "REQUEST_UNREADABLE" and "nested too deeply" in out["message"]
    # control: a request of ordinary depth, with a nested (ignored-by-shape) value, still reads and is judged
    code, out, _ = cli(tmp_path, {**request(tools, "exit", "0"), "extra": [[[1]]]}, "--project", str(project),
                       "--policy", str(policy_file))
    assert code == 2 and out["code"] == "REQUEST_SHAPE"
    code, out, _ = cli(tmp_path, request(tools, "exit", "0"), "--project", str(project), "--policy", str(policy_file))
    assert code == 0 and out["ran"]


def test_the_commands_output_reaches_the_terminal_as_json_escapes_never_raw(tmp_path, tools, project, policy_file):
    # pydantic leaves DEL, C1 (8-bit CSI/OSC) and bidi controls raw in JSON; the CLI writes them as \\uXXXX.
    said = "out/\x1b]0;T\x07\x9b2J\x9d52;c;eA==\x9c\u202egnp\x7f"
    path = tmp_path / "req.json"
    path.write_text(json.dumps(request(tools, "say", said)))
    p = subprocess.run([*PROCTOR, "run-request", "--request-file", str(path), "--project", str(project),
                        "--policy", str(policy_file)], capture_output=True, timeout=60)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["stdout"] == said and out["stderr"] == said  # the same document
    for raw in (b"\x1b", b"\x07", b"\x7f", "\x9b".encode(), "\x9d".encode(), "\u202e".encode()):
        assert raw not in p.stdout, raw
    assert b"\\u009b2J" in p.stdout and b"\\u202egnp" in p.stdout
