"""The hook client as a job runs it (issue 25): compiled once per job, loading none of the standard library's
Python modules (only the interpreter's C ones), speaking exactly the bytes `json` would, still fail-closed on
any answer it cannot read; and a call it was answered is in the ledger even when the host dies right after.
How fast it is is bench work (bench/hook.py), never asserted here."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LoopbackServer

from proctor.mechanisms.gatekeeper import hook_client
from proctor.mechanisms.gatekeeper import hook as gatekeeper
from proctor.mechanisms.gatekeeper.claude import ClaudeDialect
from proctor.mechanisms.gatekeeper.service import GateService
from proctor.mechanisms.gatekeeper.task import default_task
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.trusted import Policy

PYTHON = os.path.realpath(sys.executable)


@pytest.fixture
def gate(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    service = GateService(ClaudeDialect(), default_task("hook", work, False, ClaudeDialect.tools), Policy(),
                          ledger, "hook", tmp_path / "gate", stop=lambda: None, worktree=work).start()
    yield service
    service.stop()
    ledger.close()


def write_call(worktree: Path, call_id: str) -> bytes:
    return json.dumps({"hook_event_name": "PreToolUse", "tool_name": "Write", "tool_use_id": call_id,
                       "tool_input": {"file_path": str(worktree / "a.txt"), "content": "x"}}).encode()


def decision(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, (p.returncode, p.stderr[-500:])
    return json.loads(p.stdout)["hookSpecificOutput"]["permissionDecision"]


def imported(argv: list[str], stdin: bytes) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The process's run with `-X importtime`, and every module it imported (start-up's included)."""
    p = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], input=stdin, capture_output=True, timeout=60, check=False)
    names = set(re.findall(rb"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", p.stderr, re.MULTILINE))
    return p, {n.decode() for n in names}


def test_the_job_runs_the_compiled_client_and_it_decides(gate):
    hook = gate.hook_command()
    assert hook[:3] == [PYTHON, "-I", "-S"] and hook[3] == str(gate.dir / gatekeeper.HOOK_CLIENT_PYC)
    assert (gate.dir / "hook_client.py").read_bytes() == gatekeeper.HOOK_CLIENT.read_bytes()
    p = subprocess.run([*hook, "PreToolUse"], input=write_call(gate.worktree, "toolu_1"), capture_output=True,
                       timeout=60, check=False)
    assert decision(p) == "allow"
    rows = [r.payload for r in gate.ledger.rows(kind="gate.call")]
    assert [(r["call_id"], r["verdict"]) for r in rows] == [("toolu_1", "run")]


def test_the_client_loads_no_python_module_beyond_the_interpreters_start(gate):
    """json, socket and signal (with re, enum, selectors, collections behind them) cost more of each call
    than the interpreter's start and the gate's decision together: only C modules are loaded."""
    _, start = imported([PYTHON, "-I", "-S", "-c", "pass"], b"")
    p, loaded = imported([*gate.hook_command(), "PreToolUse"], write_call(gate.worktree, "toolu_2"))
    assert decision(p) == "allow"  # the whole path ran: connect, request, answer read
    assert start and loaded - start <= {"_socket", "_json", "_signal"}, sorted(loaded - start)


STRINGS = ["", "plain", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x1f\x7f", "é漢😀", "\u2028\u2029",
           "</script>", "\\u0041"]


@pytest.mark.parametrize("text", STRINGS)
def test_the_request_is_the_bytes_json_dumps_makes(text):
    for raw in (text.encode("utf-8"), text.encode("utf-8")[:-1], b"\xff\xfe" + text.encode("utf-8")):
        want = json.dumps({"cli": f"c{text}", "event": "PreToolUse", "payload": raw.decode("utf-8", "replace")})
        assert hook_client.request(f"c{text}", "PreToolUse", raw) == (want + "\n").encode()


@pytest.mark.parametrize("text", STRINGS)
def test_the_answer_is_read_as_json_loads_reads_it(text):
    answer = {"stdout": text, "stderr": text[::-1], "exit": 2}
    for data in (json.dumps(answer), json.dumps(answer, ensure_ascii=False), f" \n{json.dumps(answer)}\n "):
        assert hook_client.parse(data.encode("utf-8")) == json.loads(data) == answer


class OneAnswer:
    """A stand-in gate on a Unix socket: reads each request whole, answers `reply`, closes."""

    def __init__(self, path: Path, reply: bytes) -> None:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(4)
        self.reply = reply
        self.server = LoopbackServer(self._answer, srv)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            while conn.recv(65536):
                pass
            conn.sendall(self.reply)

    def close(self) -> None:
        self.server.close()


GARBLED = {
    "nothing": b"",
    "not json": b"allow",
    "two documents": b'{"stdout": "", "exit": 0} {"stdout": "", "exit": 0}',
    "not an object": b'["allow"]',
    "stdout not text": b'{"stdout": 1, "exit": 0}',
    "stderr not text": b'{"stdout": "{}", "stderr": 5, "exit": 0}',
    "exit not a number": b'{"stdout": "{}", "exit": "0"}',
    "no exit": b'{"stdout": "{}"}',
    "cut short": b'{"stdout": "{}", "exit": 0',
    "not utf-8": b'{"stdout": "\xff", "exit": 0}',
    "a control character in a string": b'{"stdout": "a\nb", "exit": 0}',
}


@pytest.mark.parametrize("how", sorted(GARBLED))
def test_an_answer_the_client_cannot_read_is_a_deny(tmp_path, how):
    client = tmp_path / "hook_client.pyc"
    gatekeeper.compile_client(gatekeeper.HOOK_CLIENT, client)
    fake = OneAnswer(tmp_path / "g.sock", GARBLED[how])
    try:
        p = subprocess.run([PYTHON, "-I", "-S", str(client), str(tmp_path / "g.sock"), "claude", "PreToolUse"],
                           input=b'{"tool_name": "Bash"}', capture_output=True, timeout=60, check=False)
    finally:
        fake.close()
    assert p.returncode == 2 and b"[proctor GATE_UNAVAILABLE]" in p.stderr and p.stdout == b"", (p, how)


def test_control_a_well_formed_answer_from_the_stand_in_is_passed_through(tmp_path):
    client = tmp_path / "hook_client.pyc"
    gatekeeper.compile_client(gatekeeper.HOOK_CLIENT, client)
    fake = OneAnswer(tmp_path / "g.sock", json.dumps({"stdout": "{\"ok\": 1}", "stderr": "é", "exit": 0}).encode())
    try:
        p = subprocess.run([PYTHON, "-I", "-S", str(client), str(tmp_path / "g.sock"), "claude", "PreToolUse"],
                           input=b"{}", capture_output=True, timeout=60, check=False)
    finally:
        fake.close()
    assert (p.returncode, p.stdout, p.stderr.decode()) == (0, b'{"ok": 1}', "é")


def test_the_compiled_client_with_its_gate_gone_denies(tmp_path):
    client = tmp_path / "hook_client.pyc"
    gatekeeper.compile_client(gatekeeper.HOOK_CLIENT, client)
    p = subprocess.run([PYTHON, "-I", "-S", str(client), str(tmp_path / "gone.sock"), "claude", "PreToolUse"],
                       input=b'{"tool_name": "Bash"}', capture_output=True, timeout=60, check=False)
    assert p.returncode == 2 and b"[proctor GATE_UNAVAILABLE] FileNotFoundError" in p.stderr and p.stdout == b""


# A host process holding a job's gate: prints its hook command, then waits to be killed.
HOST = r"""
import json, sys, time
from pathlib import Path
from proctor.mechanisms.gatekeeper.claude import ClaudeDialect
from proctor.mechanisms.gatekeeper.service import GateService
from proctor.mechanisms.gatekeeper.task import default_task
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.policy.trusted import Policy
tmp = Path(sys.argv[1])
work = tmp / "work"
work.mkdir()
ledger = Ledger(tmp / "ledger.sqlite3")
gate = GateService(ClaudeDialect(), default_task("crash", work, False, ClaudeDialect.tools), Policy(), ledger,
                   "crash", tmp / "gate", stop=lambda: None, worktree=work).start()
print(json.dumps({"hook": gate.hook_command(), "worktree": str(work)}), flush=True)
time.sleep(600)
"""


def test_a_call_answered_is_in_the_ledger_when_the_host_is_killed_right_after(tmp_path):
    """The decision is released only once its row is committed: the host killed (SIGKILL) as soon as the
    hook has its answer loses none of the calls it answered, and the chain and head read intact."""
    host = subprocess.Popen([sys.executable, "-c", HOST, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(host.stdout.readline())
        answered = []
        for i in range(3):
            p = subprocess.run([*first["hook"], "PreToolUse"], input=write_call(Path(first["worktree"]), f"t{i}"),
                               capture_output=True, timeout=60, check=False)
            assert decision(p) == "allow"
            answered.append(f"t{i}")
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=60)
    with Ledger(tmp_path / "ledger.sqlite3") as ledger:
        assert [r.payload["call_id"] for r in ledger.rows(kind="gate.call")] == answered
        assert ledger.verify() == []
