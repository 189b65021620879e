"""Fixtures for the command-request tests: a throw-away PROCTOR_HOME, a real git project, a helper program
outside the project that performs one action per call, and an allowlist written as a user would write it.

Imported by the other test_commands_* modules; it holds no tests of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proctor.services.commands import Allowlist
from proctor.mechanisms.ledger.store import Ledger

PY = sys.executable
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}

# One action per call; what each does is the evidence a test reads back.
ACT = r'''
import json, os, subprocess, sys, time
action, *args = sys.argv[1:]
if action in ("write", "write-narrow"):
    for p in args:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        with open(p, "w") as fh:
            fh.write("written\n")
elif action == "delete":
    os.remove(args[0])
elif action == "rename":
    os.rename(args[0], args[1])
elif action == "chmod":
    os.chmod(args[0], 0o755)
elif action == "rewrite":
    st = os.stat(args[0])
    with open(args[0], "rb") as fh:
        data = fh.read()
    new = bytes(b ^ 0x20 for b in data)
    with open(args[0], "r+b") as fh:
        fh.write(new)
    os.utime(args[0], ns=(st.st_atime_ns, st.st_mtime_ns))
elif action == "env":
    print(json.dumps(dict(os.environ)))
elif action == "stdin":
    with open(args[0], "w") as fh:
        fh.write(sys.stdin.read())
elif action == "spam":
    sys.stdout.write("x" * int(args[0]))
    sys.stderr.write("e" * 10)
elif action == "sleep":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open("child.pid", "w") as fh:
        fh.write(str(child.pid))
    with open("before.txt", "w") as fh:
        fh.write("written before the deadline\n")
    time.sleep(int(args[0]))
elif action == "tamper":
    try:
        with open(args[0], "ab") as fh:
            fh.write(b"\0")
    except OSError as exc:
        sys.exit(f"tamper refused: {exc}")
elif action == "daemon":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(120)
        os._exit(0)
    time.sleep(0.3)
elif action == "say":
    sys.stdout.write(" ".join(args)); sys.stderr.write(" ".join(args))
elif action == "exit":
    sys.exit(int(args[0]))
'''

ACTIONS = ["write", "delete", "rename", "chmod", "rewrite", "env", "stdin", "daemon", "say"]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    """Every test gets its own PROCTOR_HOME (ledger, allowlist, helper cache)."""
    fresh_home.mkdir()
    return fresh_home


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    d = tmp_path / "tools"
    d.mkdir()
    (d / "act.py").write_text(ACT)
    return d


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A real repo: tracked, untracked and ignored files, one commit."""
    p = tmp_path / "proj"
    (p / "src").mkdir(parents=True)
    (p / "src" / "app.py").write_text("print('app')\n")
    (p / "docs").mkdir()
    (p / "docs" / "brief.md").write_text("the brief\n")
    (p / ".gitignore").write_text("build/\n*.log\n")
    (p / "build").mkdir()
    (p / "build" / "old.o").write_text("object\n")
    (p / "out").mkdir()
    git("init", "-q", cwd=p)
    git("add", "-A", cwd=p)
    git("commit", "-qm", "init", cwd=p)
    (p / "notes.txt").write_text("untracked\n")
    return p


@pytest.fixture(params=["bwrap", "none"])
def isolation_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`bwrap`: unconfined runs hide proctor's state in a mount namespace, as they do wherever bwrap runs;
    `none`: the same machine with bwrap taken away, the fallback that can only detect and put back."""
    from proctor.services.commands import isolation
    from proctor.mechanisms.confine import detect

    caps = detect()
    if request.param == "bwrap" and caps.bwrap is None:
        pytest.skip(f"bwrap cannot run here: {caps.bwrap_reason}")
    if request.param == "none":
        gone = dataclasses.replace(caps, bwrap=None, bwrap_reason="bwrap taken away by the test")
        monkeypatch.setattr(isolation, "capabilities", lambda: gone)
    return request.param


def toml_str(s: str | Path) -> str:
    return json.dumps(str(s))


def base_policy(tools: Path, ledger_path: Path | None = None, extra: str = "") -> str:
    """The allowlist most tests use: agent `codex` may run the helper with a few shapes of argv."""
    act = toml_str(tools / "act.py")
    tamper = ""
    if ledger_path is not None:
        targets = [ledger_path, ledger_path.with_suffix(".head"), Path(os.environ["PROCTOR_HOME"]) / "commands.toml"]
        tamper = f'''
[[agents.codex.commands]]
name = "tamper"
argv = [{toml_str(PY)}, {act}, "tamper", {{type = "choice", values = {json.dumps([str(t) for t in targets])}}}]
'''
    return f'''
version = 1
protected = ["docs/brief.md"]

[agents.codex]
write_scopes = ["src/**"]

[[agents.codex.commands]]
name = "act"
argv = [{toml_str(PY)}, {act}, {json.dumps(ACTIONS)}, {{type = "tail", max = 3, item = {{type = "path"}}}}]
writes = ["**"]
timeout_s = 30
env_pass = ["PROCTOR_TEST_PASSED"]
stdin_gates = [{{type = "max_bytes", limit = 1000}}, {{type = "deny_regex", patterns = ["SECRET"]}}]
match = [[{toml_str(PY)}, {act}, "write", "out/a.txt"]]
not_match = [[{toml_str(PY)}, {act}, "write", "--force"], [{toml_str(PY)}, {act}, "write", "../x"]]

[[agents.codex.commands]]
name = "narrow"
argv = [{toml_str(PY)}, {act}, "write-narrow", {{type = "path", globs = ["out/**", "src/**"]}}]
writes = ["out/**"]

[[agents.codex.commands]]
name = "sleep"
argv = [{toml_str(PY)}, {act}, "sleep", {{type = "int", max = 600}}]
writes = ["**"]
# Its writes come before the deadline (the test counts them): 5 s leaves room on a loaded machine.
timeout_s = 5

[[agents.codex.commands]]
name = "spam"
argv = [{toml_str(PY)}, {act}, "spam", {{type = "int", max = 100000000}}]
max_output_bytes = 1000

[[agents.codex.commands]]
name = "exit"
argv = [{toml_str(PY)}, {act}, "exit", {{type = "int", max = 255}}]

[[agents.codex.commands]]
name = "in-src"
argv = [{toml_str(PY)}, {act}, "write", "here.txt"]
cwd = "src"
writes = ["src/**"]
{tamper}{extra}'''


@pytest.fixture
def policy_file(home: Path, tools: Path) -> Path:
    path = home / "commands.toml"
    path.write_text(base_policy(tools, ledger_path=home / "ledger.sqlite3"))
    return path


def request(tools: Path, *args: str, **fields: Any) -> dict[str, Any]:
    """A request for the helper: `request(tools, "write", "out/a.txt", expected_writes=[...])`."""
    body: dict[str, Any] = {
        "kind": "command-request", "agent": "codex", "argv": [PY, str(tools / "act.py"), *args], "cwd": ".",
        "purpose": "test", "expected_writes": [],
    }
    body.update(fields)
    return body


def ledger_kinds(home: Path) -> list[str]:
    if not (home / "ledger.sqlite3").exists():
        return []
    with Ledger(home / "ledger.sqlite3") as led:
        return [r.kind for r in led.rows()]


def ledger_rows(home: Path) -> list[Any]:
    with Ledger(home / "ledger.sqlite3") as led:
        return led.rows()


def load(policy_file: Path) -> Allowlist:
    return Allowlist.load(policy_file)
