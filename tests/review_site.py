"""A real `proctor serve --no-queue` for the review page's tests: a subprocess on a free loopback port, with
this test's PROCTOR_HOME and PATH (fake agent CLIs), and its sign-in address and one-time code read from its
stderr. The page lives under its secret path, `prefix` (/review/<scope>): a client signs in with the token
in a POST body, as a person pasting it would."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from proctor.surfaces.web.access import Access

PROCTOR = Path(sys.executable).with_name("proctor")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([str(PROCTOR), "serve", "--no-queue", "--port", str(self.port), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
        self.err: list[str] = []
        self.login_url = ""
        self.code = ""  # the one-time sign-in code, typed into the page (never in an address)
        got = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for raw in self.proc.stderr:
                line = raw.decode("utf-8", "replace")
                self.err.append(line)
                m = re.search(r"review page: (http://\S+)\s+sign-in code: (\S+)", line)  # once the socket listens
                if m:
                    self.login_url, self.code = m.group(1), m.group(2)
                    got.set()

        threading.Thread(target=read, daemon=True).start()
        assert got.wait(30), f"proctor serve printed no sign-in address: {''.join(self.err)}"
        self.base = f"http://127.0.0.1:{self.port}"
        self.token = (Path(os.environ["PROCTOR_HOME"]) / "review-token").read_text().strip()
        self.prefix = f"/review/{Access(self.token).scope}"  # the page's secret path (proctor.surfaces.web.access)
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.base + "/favicon.ico", timeout=2)
                break
            except httpx.TransportError:
                assert self.proc.poll() is None, f"proctor serve exited: {''.join(self.err)}"
                assert time.monotonic() < deadline, "proctor serve did not answer in 30 s"
                time.sleep(0.1)

    def sign_in(self, page) -> None:  # type: ignore[no-untyped-def]
        """A browser page signed in as a person does it: the printed address, the code typed into the page."""
        page.goto(self.login_url)
        page.fill("#code", self.code)
        page.click("#sign-in-code")
        page.wait_for_url(self.url())

    def client(self, signed_in: bool = True) -> httpx.Client:
        c = httpx.Client(base_url=self.base, timeout=120, follow_redirects=False)
        if signed_in:
            r = c.post("/review/login", data={"token": self.token})
            assert r.status_code == 303, r.text
            assert r.headers["location"] == self.prefix
        return c

    def url(self, path: str = "") -> str:
        """A page's address under the secret path (`path` "" the list, "/jobs/ID" a job)."""
        return self.base + self.prefix + path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("proctor serve did not stop within 15 s of SIGTERM") from None
        assert "Traceback" not in "".join(self.err), "".join(self.err)


def run_job(repo: Path, ticket: str, validate: str = "true", agent: str = "claude", task: str = "do it") -> dict:
    p = subprocess.run([str(PROCTOR), "run-agent", "--agent", agent, "--task", task, "--repo", str(repo),
                        "--ticket", ticket, "--validate-cmd", validate], capture_output=True, timeout=180,
                       env=os.environ.copy())
    assert b"Traceback" not in p.stderr, p.stderr.decode()
    return json.loads(p.stdout)


def start_job(repo: Path, ticket: str, validate: str = "true") -> subprocess.Popen:
    return subprocess.Popen([str(PROCTOR), "run-agent", "--agent", "claude", "--task", "slow", "--repo", str(repo),
                             "--ticket", ticket, "--validate-cmd", validate], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=os.environ.copy())
