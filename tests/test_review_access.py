"""Issue 23, measured as the attacker: a real second local user on this machine (made with `useradd` and
removed with `userdel -r` by the test), her own server on another loopback port, and the reviewer's real
browser (Debian's headless Chromium with a profile on disk, so its History database can be read after).

What it proves, each beside its control:
- the session cookie never reaches her server, whatever path on localhost or 127.0.0.1 the browser is sent
  to (control: a cookie scoped the old way, Path=/review, does reach it: her log would show a leak);
- sign-in leaves no token in the browser's history (control: the spent sign-in address is there, and dead);
- `proctor serve` on a port she holds prints nothing but the error naming the port (control: a free port
  prints the address, and the server answers at once);
- her request for a job's `/v1` state by its id is 401 (control: this install's token gets past the check);
- every path of the origin is proctor's: /docs is a 404, with the same headers as every page.
Under CI=true a missing useradd (or not being root) fails; elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from review_site import PROCTOR, Server, free_port, run_job
from test_review_browser import CHROMIUM_ARGS, chromium

from proctor.mechanisms.adapters.testing import Behaviour
from proctor.surfaces.web.access import Access

# useradd/userdel lock /etc/passwd and fail at once on a held lock: one worker for them under xdist.
pytestmark = pytest.mark.xdist_group("useradd")

# Her server: answers anything with a small page and logs every request line and header to stdout, as JSON.
HER_SERVER = r"""
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print(json.dumps({"path": self.path, "headers": dict(self.headers)}), flush=True)
        body = b"<!doctype html><title>hers</title><p>hello"
        self.send_response(200)
        for cookie in json.loads(sys.argv[2]) if len(sys.argv) > 2 else []:
            self.send_header("set-cookie", cookie)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print(json.dumps({"listening": srv.server_address[1]}), flush=True)
srv.serve_forever()
"""


class HerServer:
    """Her server, run as her (uid and gid dropped by the kernel, not by our code's good will)."""

    def __init__(self, user: pwd.struct_passwd, port: int = 0, cookies: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(["/usr/bin/python3", "-c", HER_SERVER, str(port), json.dumps(cookies or [])],
                                     user=user.pw_uid,
                                     group=user.pw_gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        first = json.loads(self.proc.stdout.readline())
        self.port = first["listening"]

    def stop(self) -> list[dict]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_the_session_cookie_never_reaches_another_users_server_on_another_port(other_user, tmp_path, repo, fake):
    from playwright.sync_api import sync_playwright

    fake("claude", Behaviour(writes={"notes\u202etxt.sh": "echo hi\n"}))
    job = run_job(repo, "T-cookie", task="rename the notes\u202e file\nsecond line")["jobId"]
    server = Server()
    her = HerServer(other_user)
    profile = tmp_path / "chromium-profile"
    scope = Access(server.token).scope
    secrets_shown = {"token": server.token, "scope": scope, "session": Access(server.token).session,
                     "code": server.code}
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(str(profile), executable_path=chromium(),
                                                       args=CHROMIUM_ARGS, headless=True)
            page = ctx.new_page()
            page.set_default_timeout(30_000)
            server.sign_in(page)
            assert page.url == server.url(), page.url
            assert [c["name"] for c in ctx.cookies()] == [Access(server.token).cookie]
            # The bidi file name and task as text, in the diff, the changed files and the list (rendered).
            page.goto(server.url(f"/jobs/{job}"))
            assert "notes\\u202etxt.sh" in page.locator("#diff summary .path").first.inner_text()
            assert "\\u202e" in page.locator("#task").inner_text()
            assert "\u202e" not in page.content()
            page.goto(server.url())
            assert "rename the notes\\u202e file" in page.locator('[data-field="task"]').first.inner_text()
            assert "second line" not in page.locator("#jobs").inner_text()  # the list shows the first line
            # The attack: the reviewer's browser sent to her port, at the paths the cookie once had.
            for host in ("127.0.0.1", "localhost"):
                for path in ("/", "/review", "/review/", "/review/jobs/x", "/review/login", f"/review/{'0' * 32}"):
                    page.goto(f"http://{host}:{her.port}{path}")
            # The control: a cookie scoped the old way (host 127.0.0.1, Path=/review) does reach her server.
            ctx.add_cookies([{"name": "old_design", "value": "probe-" + scope[:6], "domain": "127.0.0.1",
                              "path": "/review", "httpOnly": True, "sameSite": "Strict"}])
            page.goto(f"http://127.0.0.1:{her.port}/review/jobs/x")
            ctx.close()
    finally:
        seen = her.stop()
        server.stop()
    log = json.dumps(seen)
    assert len(seen) >= 13 and "probe-" + scope[:6] in log, "the control: a /review cookie reaches her port"
    for what, value in secrets_shown.items():
        assert value not in log, f"her server received the {what}"
    # History: the sign-in address is there (the control that this is the right database), with no code.
    history = profile / "Default" / "History"
    assert history.is_file()
    copy = tmp_path / "History.copy"
    shutil.copyfile(history, copy)
    with sqlite3.connect(copy) as db:
        urls = [u for (u,) in db.execute("SELECT url FROM urls")]
    assert any(u.endswith("/review/login") for u in urls), urls
    assert not any(server.token in u or server.code in u for u in urls), "a credential is in the browser's history"
    shutil.rmtree(profile, ignore_errors=True)


def test_her_page_on_another_port_cannot_lock_the_person_out_with_a_cookie(other_user, tmp_path, repo, fake):
    """issue 41: her page set `proctor_review=x; Path=/`; the browser sent it after the real cookie, the server
    kept the last value, and the person got 401 for the cookie's year. The cookie's name is the token's now:
    her plants (the old name, a guess of the new shape) change nothing. The control: a cookie of the real name
    planted beside it (what she could do only knowing the token's HMAC) makes the request carry it twice,
    which is refused rather than guessed at."""
    from playwright.sync_api import sync_playwright

    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    run_job(repo, "T-plant")
    server = Server()
    plants = ["proctor_review=x; Path=/; Max-Age=31536000",
              "proctor_review_0123456789abcdef=x; Path=/; Max-Age=31536000"]
    her = HerServer(other_user, cookies=plants)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS, headless=True)
            ctx = browser.new_context()
            page = ctx.new_page()
            page.set_default_timeout(30_000)
            server.sign_in(page)
            page.goto(f"http://127.0.0.1:{her.port}/")  # her page plants its cookies on 127.0.0.1
            planted = sorted(c["name"] for c in ctx.cookies())
            after = page.goto(server.url())
            still_in = after.status if after else None
            ctx.add_cookies([{"name": Access(server.token).cookie, "value": "x", "domain": "127.0.0.1", "path": "/"}])
            doubled = page.goto(server.url())
            doubled_status = doubled.status if doubled else None
            browser.close()
    finally:
        her.stop()
        server.stop()
    assert "proctor_review" in planted and "proctor_review_0123456789abcdef" in planted, planted
    assert still_in == 200, "her cookies locked the person out"
    assert doubled_status == 401  # the control: the real name, twice, is refused


def test_a_taken_port_is_a_clear_error_and_nothing_is_printed_before_the_socket_listens(other_user):
    her = HerServer(other_user, free_port())
    try:
        p = subprocess.run([str(PROCTOR), "serve", "--no-queue", "--port", str(her.port)], capture_output=True,
                           text=True, timeout=60, check=False)
    finally:
        seen = her.stop()
    assert p.returncode == 2, p.stderr
    assert f"cannot listen on 127.0.0.1:{her.port}" in p.stderr and "taken" in p.stderr, p.stderr
    token = (Path(os.environ["PROCTOR_HOME"]) / "review-token").read_text().strip()
    assert "review page" not in p.stderr and "sign-in code" not in p.stderr and token not in p.stderr + p.stdout
    assert seen == []  # nobody was sent to her
    # The control: on a free port the address comes once the socket listens, and it answers at once.
    server = Server()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=1):
            pass
        assert "listening on 127.0.0.1:" in "".join(server.err)
    finally:
        server.stop()


def hers(user: pwd.struct_passwd, url: str) -> str:
    probe = (f"import urllib.request, urllib.error\n"
             f"try:\n    r = urllib.request.urlopen('{url}'); print(r.status, r.read()[:300])\n"
             f"except urllib.error.HTTPError as e:\n    print(e.code, e.read()[:300])\n")
    done = subprocess.run(["/usr/bin/python3", "-c", probe], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                          cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30,
                          check=False)
    return done.stdout + done.stderr


def test_another_local_user_is_refused_at_the_door_by_her_uid_unless_config_names_it(other_user):
    """issue 41: loopback is no boundary between local users. Her connection is attributed by its socket's
    uid when it is accepted and refused before a byte of it is read (her sign-in attempts, her cookies, her
    forwarded headers never reach the page). The control: `[serve] allow_uids` naming her lets her reach the
    sign-in page, where the token still decides."""
    server = Server()
    try:
        refused = hers(other_user, f"{server.base}/review")
    finally:
        server.stop()
    assert refused.startswith("403 ") and "PEER_REFUSED" in refused and f"uid {other_user.pw_uid}" in refused, refused
    (Path(os.environ["PROCTOR_HOME"]) / "config.toml").write_text(f"[serve]\nallow_uids = [{other_user.pw_uid}]\n")
    server = Server()
    try:
        let_in = hers(other_user, f"{server.base}/review")
    finally:
        server.stop()
    assert let_in.startswith("401 "), let_in


def test_a_job_id_is_not_a_capability_another_user_reads_nothing(other_user, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    job = run_job(repo, "T-v1")["jobId"]
    (Path(os.environ["PROCTOR_HOME"]) / "config.toml").write_text(f"[serve]\nallow_uids = [{other_user.pw_uid}]\n")
    server = Server()  # she is let past the door (test above): the credential is what stops her here
    try:
        got = hers(other_user, f"{server.base}/v1/jobs/{job}")
        ours = httpx.get(f"{server.base}/v1/jobs/{job}", headers={"Authorization": f"Bearer {server.token}"})
        docs = httpx.get(f"{server.base}/docs")
        spec = httpx.get(f"{server.base}/openapi.json")
        anything = httpx.get(f"{server.base}/redoc")
    finally:
        server.stop()
    assert got.startswith("401 ") and "UNAUTHENTICATED" in got, got
    # The control: this install's token is past the check (--no-queue: the queue, not the credential, answers).
    assert ours.status_code == 503 and ours.json()["code"] == "QUEUE_DISABLED", ours.text
    assert docs.status_code == 404 and anything.status_code == 404
    assert spec.status_code == 200 and spec.headers["content-type"] == "application/json"
    for r in (docs, spec, anything, ours):
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"], r.url
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
    assert "cdn" not in spec.text.lower()


def test_a_sign_in_flood_is_limited_and_leaves_one_row_a_window(tmp_path):
    """300 wrong tokens as fast as one client sends them: 10 sign-in pages, 290 short 429s, one ledger row; the
    right token still signs in (every local user shares 127.0.0.1: a flood must not lock the reviewer out)."""
    from proctor.mechanisms.ledger.store import Ledger

    server = Server()
    started = time.monotonic()
    try:
        with httpx.Client(base_url=server.base, timeout=10) as c:
            codes = [c.post("/review/login", data={"token": f"guess-{i}"}).status_code for i in range(300)]
            right = c.post("/review/login", data={"token": server.token})
    finally:
        server.stop()
    took = time.monotonic() - started
    assert codes.count(401) == 10 and codes.count(429) == 290, codes[:20]
    assert right.status_code == 303
    with Ledger.default() as led:
        rows = [r.payload for r in led.rows(kind="review.web.login")]
    failed = [r for r in rows if not r["ok"]]
    assert failed == [{"ok": False, "client": "every client", "failures": 300, "refused": 290, "windowS": 60.0,
                       "limit": 10}], rows
    assert [r for r in rows if r["ok"]] == [{"ok": True, "via": "token", "client": "127.0.0.1"}]
    print(f"sign-in flood: 301 attempts in {took:.1f} s, {len(failed)} ledger row for the failures")
