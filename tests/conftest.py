"""Shared fixtures: a throw-away PROCTOR_HOME, real git repos, and fake agent CLIs on PATH."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from proctor.mechanisms.adapters.testing import Behaviour, FakeAgent

UNCONFINED = 'confine = "off"\n'
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}


@pytest.fixture(autouse=True)
def proctor_home(tmp_path_factory, monkeypatch) -> Path:
    home = tmp_path_factory.mktemp("proctor-home")
    monkeypatch.setenv("PROCTOR_HOME", str(home))
    # Fakes record their calls beside themselves, outside any worktree: host tests run unconfined unless
    # they ask (the confinement tests do, and give the fake's record dir as a declared state dir).
    (home / "config.toml").write_text(UNCONFINED)
    monkeypatch.delenv("PROCTOR_CONFIG", raising=False)
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    # Adapters' state dirs live under HOME (~/.codex, ~/.claude): never the real one.
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    return home


@pytest.fixture
def fresh_home(tmp_path, monkeypatch) -> Path:
    """A PROCTOR_HOME of the test's own that proctor has not made yet: no config.toml, the defaults."""
    h = tmp_path / "proctor-home"
    monkeypatch.setenv("PROCTOR_HOME", str(h))
    return h


class LoopbackServer:
    """A server that hands each connection to `handle` on its accept thread (a handler that blocks starts a
    thread of its own); `accepted` counts the connections. TCP on 127.0.0.1, or a listening socket given."""

    def __init__(self, handle: Callable[[socket.socket], None], srv: socket.socket | None = None) -> None:
        self.srv = srv or socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1] if self.srv.family == socket.AF_INET else None
        self.accepted = 0
        self._handle = handle
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            self._handle(conn)

    def close(self) -> None:
        self.srv.close()


def wait_until(ready, bound_s: float, what: str, step_s: float = 0.02):  # type: ignore[no-untyped-def]
    """Poll `ready()` until it is truthy and return its value; fail after `bound_s`. The bound only keeps a
    broken run from hanging: it is never the property under test (latency is measured in bench/), so it is
    generous enough for a loaded machine (issue 24)."""
    import time

    deadline = time.monotonic() + bound_s
    while True:
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"waited {bound_s:.0f} s for {what}")
        time.sleep(step_s)


def sh(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True).stdout


def sh_job(repo: Path, where: Path, script: str, branch: str = "master", extra: str = "") -> tuple[Any, dict]:
    """One autodetected job of a `sh` agent running `script` in its worktree (prompt on stdin, no network),
    confine = required, with a ledger of its own in `where`: the result and its ledger rows by kind.
    `extra`: more top-level config lines (a `[repos."..."]` table)."""
    import json

    from proctor import RunAgentRequest, run_agent
    from proctor.mechanisms.config.load import load_config
    from proctor.mechanisms.ledger.store import Ledger

    where.mkdir(parents=True, exist_ok=True)
    cfg = where / "agent.toml"
    cfg.write_text(f'confine = "required"\n{extra}[agents.sh]\ncommand = ["/bin/sh", "-c", {json.dumps(script)}]\n'
                   'prompt = "stdin"\nnetwork = false\n')
    with Ledger(where / "ledger.sqlite3") as ledger:
        res = run_agent(RunAgentRequest(agent="sh", task="t", repo=str(repo), ticket="T", branch=branch),
                        config=load_config(cfg), ledger=ledger)
        return res, {r.kind: r.payload for r in ledger.rows(job_id=res.job_id)}


def make_repo(root: Path, files: dict[str, str] | None = None, branch: str = "master") -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    sh("git", "init", "-q", "-b", branch, str(repo))
    for rel, content in (files or {"README.md": "hello\n"}).items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-qm", "init", cwd=repo)
    return repo


def _closure(name: str) -> list[metadata.Distribution]:
    """`name`'s distribution and every one it requires here (markers evaluated for this interpreter)."""
    out: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in out:
            continue
        out[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(out.values())


@pytest.fixture(scope="session")
def lean_python_bin(tmp_path_factory) -> str:
    """The bin dir of a venv that has pytest and what it needs, nothing else: what a small project's venv
    holds. Validation that autodetects `python -m pytest` runs it; the suite's own venv would load its
    plugins (schemathesis, hypothesis: 0.9 s) in every validation run of every job."""
    venv = tmp_path_factory.mktemp("pytest-only-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    for dist in _closure("pytest"):
        for top in {f.parts[0] for f in dist.files or () if not f.parts[0].startswith("..")}:
            src = Path(dist.locate_file(top))
            # Copied, not linked: a confined job is shown this venv, not what a link would point at.
            if src.is_dir() and not (site / top).exists():
                shutil.copytree(src, site / top, symlinks=True)
            elif src.is_file():
                shutil.copy2(src, site / top)
    return str(venv / "bin")


@pytest.fixture(autouse=True)
def lean_python_first(monkeypatch, lean_python_bin):
    """Every test's `python` is the lean venv's: validation that autodetects `python -m pytest` runs what a
    small project's venv holds. Otherwise PATH's `python` is whatever the machine has (here pyenv's, whose
    hypothesis and pytest-benchmark plugins cost 0.7 s a start, rewritten afresh each time as validation
    writes no bytecode) and the suite's time went to plugins no test is about. A test that needs another
    interpreter names it or puts its own bin before this one, as fake_bin does."""
    monkeypatch.setenv("PATH", f"{lean_python_bin}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def repo(tmp_path) -> Path:
    return make_repo(tmp_path)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


@pytest.fixture
def fake(fake_bin):
    """fake("claude", Behaviour(...)) -> FakeAgent installed on PATH."""

    def make(name: str, behaviour: Behaviour | None = None) -> FakeAgent:
        return FakeAgent(fake_bin, name, behaviour)

    return make


class Clock:
    """A clock a test moves by hand: `clock.now += 60`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    """One real nats-server (the bundled binary) for a test module."""
    from proctor.mechanisms.queue import server

    handle = server.start(tmp_path_factory.mktemp("nats") / "store")
    yield handle.url
    handle.stop()


@pytest.fixture
def clear_of_the_hour():
    """For runs counted in the real clock's hour: one that starts in the last half minute of an hour waits
    for the next, so no window rolls over between a booking and the check of it."""
    import time

    left = 3600 - time.time() % 3600
    if left < 30:
        time.sleep(left + 0.5)


def serve_in_thread(app):  # type: ignore[no-untyped-def]
    """`app` served by uvicorn (through the guard's config) on a free loopback port in a thread; a context
    manager yielding its base URL."""
    import contextlib
    import threading
    import time

    import uvicorn

    from proctor.surfaces.api.guard import server_config
    from proctor.mechanisms.queue import server

    @contextlib.contextmanager
    def serving():
        port = server.free_port()
        srv = uvicorn.Server(server_config(app, "127.0.0.1", port))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            srv.should_exit = True
            thread.join(10)

    return serving()


@pytest.fixture
def other_user():
    """A real second local user, `proctor-t-<random>` (a pwd entry), removed with its home after. Under CI a
    machine that cannot make one fails: a skip there would hide a missing install step."""
    import pwd
    import secrets
    import shutil

    missing = "not root" if os.geteuid() != 0 else (
        "" if shutil.which("useradd") and shutil.which("userdel") else "no useradd/userdel")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"a second local user is needed and cannot be made: {missing}", pytrace=False)
        pytest.skip(f"a second local user cannot be made: {missing}")
    name = f"proctor-t-{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        assert subprocess.run(["id", name], capture_output=True, check=False).returncode != 0, f"{name} stays"


def pytest_runtest_setup(item):
    """`make test` runs `--dist loadgroup`: a test marked xdist_group must reach its worker with its group
    (xdist appends it to the node id). A pytest and pytest-xdist that drop it do so silently, and the
    useradd tests then collide on /etc/passwd: each such test fails instead, saying why."""
    if (getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
            and "@" not in item.nodeid):
        pytest.fail("--dist loadgroup lost this test's xdist_group: this pytest-xdist drops the groups under this "
                    "pytest (pytest-xdist issue #1386); pyproject.toml pins pytest below 9.2 for it")
