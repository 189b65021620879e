"""Fakes at the seam, shipped with the library: a fake agent CLI executable for tests (yours too).

Owns `FakeAgent`, which writes a small executable named like the real CLI (`codex`, `claude`, ...) into a
bin dir that the test puts first on PATH. The executable records what it received (argv, cwd, stdin, chosen
environment variables) and then behaves as told: print, write files where it was told, exit with a code,
sleep, ignore SIGTERM, leave a `setsid` daemon holding its pipes, or flood its output. It never imitates a
model: it is the edge we cannot reach here, and only that.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

TESTED = "<tested>"  # Behaviour.version: the built-in's own tested version (`real_version`)

_SCRIPT = r'''#!{python}
import json, os, signal, sys, time
HERE = {here!r}
NAME = {name!r}
beh = json.load(open(os.path.join(HERE, NAME + ".behaviour.json")))
calls_path = os.path.join(HERE, NAME + ".calls.jsonl")
if beh.get("version") and sys.argv[1:] == ["--version"]:
    print(beh["version"]); sys.exit(0)
try:
    st, null = os.fstat(0), os.stat("/dev/null")
    devnull = (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == null.st_rdev
except OSError:
    devnull = False
data = b"" if devnull else (sys.stdin.buffer.read() if beh.get("read_stdin", True) else b"")
n = sum(1 for _ in open(calls_path)) if os.path.exists(calls_path) else 0
with open(calls_path, "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "stdin_devnull": devnull,
        "stdin": data.decode("utf-8", "replace")[:2000], "stdin_len": len(data),
        "env": {{k: os.environ.get(k) for k in beh.get("record_env", [])}}, "pid": os.getpid()}}) + "\n")
idx = min(n, len(beh["exit_codes"]) - 1)
if beh.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for rel, content in beh.get("writes", {{}}).items():
    path = rel if os.path.isabs(rel) else os.path.join(os.getcwd(), rel)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(content)
if beh.get("daemon_pidfile"):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            # Keeps the inherited stdout/stderr open: a naive host waits for EOF forever.
            with open(beh["daemon_pidfile"], "w") as fh:
                fh.write(str(os.getpid()))
            if beh.get("daemon_scrub_env"):
                os.environ.clear()
            time.sleep(3600)
            os._exit(0)
        os._exit(0)
    os.wait()
out = beh.get("stdout_by_call", [None])[min(n, len(beh.get("stdout_by_call", [None])) - 1)] or beh.get("stdout", "")
sys.stdout.write(out); sys.stdout.flush()
sys.stderr.write(beh.get("stderr", "")); sys.stderr.flush()
if beh.get("flood_bytes"):
    block = b"x" * 1048575 + b"\n"
    left = beh["flood_bytes"]
    while left > 0:
        os.write(1, block[: min(left, len(block))]); left -= len(block)
if beh.get("sleep"):
    time.sleep(beh["sleep"])
if beh.get("stdout_after_sleep"):
    sys.stdout.write(beh["stdout_after_sleep"]); sys.stdout.flush()
sys.exit(beh["exit_codes"][idx])
'''


@dataclass
class Behaviour:
    exit_codes: list[int] = field(default_factory=lambda: [0])  # by call; the last one repeats
    stdout: str = ""
    stdout_by_call: list[str | None] = field(default_factory=lambda: [None])
    stderr: str = ""
    writes: dict[str, str] = field(default_factory=dict)  # relative to cwd, or absolute (hostile)
    sleep: float = 0.0
    stdout_after_sleep: str = ""
    ignore_term: bool = False
    daemon_pidfile: str | None = None
    daemon_scrub_env: bool = False
    flood_bytes: int = 0
    read_stdin: bool = True
    # Answered to `--version` without recording a call; TESTED: as the real CLI of that name would, a version
    # its built-in lists as tested (a stand-in for an untested one says so), else "fake-agent 1.0.0".
    version: str | None = TESTED
    record_env: list[str] = field(default_factory=lambda: ["PROCTOR_JOB_ID", "PROCTOR_WORKTREE", "TMPDIR"])


def real_version(name: str) -> str:
    """What the real CLI `name` answers to --version, at a version its built-in lists as tested."""
    agents = tomllib.loads(Path(__file__).with_name("builtin.toml").read_text()).get("agents", {})
    tested = agents.get(name, {}).get("tested")
    return f"{name} {tested[-1]}" if tested else "fake-agent 1.0.0"


class FakeAgent:
    """An executable called `name` in `bin_dir`; put `bin_dir` first on PATH."""

    def __init__(self, bin_dir: Path, name: str, behaviour: Behaviour | None = None) -> None:
        self.bin_dir = Path(bin_dir)
        self.name = name
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.bin_dir / name
        self.path.write_text(_SCRIPT.format(python=sys.executable, here=str(self.bin_dir), name=name))
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        self.set(behaviour or Behaviour())

    def set(self, behaviour: Behaviour) -> None:
        data = asdict(behaviour)
        if data["version"] == TESTED:
            data["version"] = real_version(self.name)
        (self.bin_dir / f"{self.name}.behaviour.json").write_text(json.dumps(data))

    def calls(self) -> list[dict]:
        p = self.bin_dir / f"{self.name}.calls.jsonl"
        if not p.exists():
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(base if base is not None else os.environ)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env
