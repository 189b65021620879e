"""The review page in a real browser: Debian's headless Chromium driven by Playwright, against a real
`proctor serve --no-queue` and real jobs. Screenshots of the list, a job, a landing and a failed job's
validation output are written to $PROCTOR_SCREENSHOTS (default: .artifacts/screenshots in the checkout),
and the verdict banner's colour is read back from them: a failed job must look failed at a glance."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from conftest import sh
from playwright.sync_api import expect
from review_site import Server, run_job, start_job

from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.adapters.testing import Behaviour

SHOTS = Path(os.environ.get("PROCTOR_SCREENSHOTS") or Path(__file__).resolve().parents[1] / ".artifacts/screenshots")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 "--disable-sync", "--metrics-recording-only", "--disable-default-apps"]


def chromium() -> str:
    found = os.environ.get("PROCTOR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        msg = "Debian's chromium is not installed (make system-deps installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))  # type: ignore[attr-defined]
    server.sign_in(pg)
    assert pg.url == server.url()
    yield pg
    ctx.close()


def shot(pg, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, f"{path} is too small to show anything"
    return path


def mean_rgb(png: bytes) -> tuple[float, float, float]:
    """The mean colour of an 8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes): read with zlib alone."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data)
            assert depth == 8 and colour in (2, 6) and interlace == 0
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += data
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    prev, total, i = bytearray(stride), [0, 0, 0], 0
    for _ in range(height):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b, c = prev[x], prev[x - channels] if x >= channels else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        for x in range(0, stride, channels):
            total[0], total[1], total[2] = total[0] + line[x], total[1] + line[x + 1], total[2] + line[x + 2]
        prev = line
    n = width * height
    return total[0] / n, total[1] / n, total[2] / n


def rows(kind: str, job_id: str) -> list:
    with Ledger.default() as led:
        return led.rows(kind=kind, job_id=job_id)


def test_list_and_job_pages_tell_a_failed_job_from_a_good_one_at_a_glance(page, server, repo, fake):
    fake("claude", Behaviour(writes={"app.py": "def add(a, b):\n    return a + b\n"}))
    good = run_job(repo, "T-good", "python3 -c 'import app; assert app.add(2, 2) == 4'")
    fake("claude", Behaviour(writes={"app.py": "def add(a, b):\n    return a * b\n"}))
    bad = run_job(repo, "T-bad", "python3 -c 'import app; assert app.add(2, 3) == 5, \"add(2, 3) is not 5\"'")
    assert good["status"] == "completed" and bad["code"] == "VALIDATION_FAILED"

    page.goto(server.url())
    good_row, bad_row = (page.locator(f'tr[data-job="{j["jobId"]}"]') for j in (good, bad))
    assert good_row.locator('[data-field="status"]').inner_text() == "completed"
    assert bad_row.locator('[data-field="status"]').inner_text() == "failed"
    shot(page, "list")
    g = mean_rgb(good_row.locator('[data-field="status"]').screenshot())
    b = mean_rgb(bad_row.locator('[data-field="status"]').screenshot())
    assert g[1] > g[0] and b[0] > b[1] + 20, (g, b)  # the good badge greener, the failed one redder

    page.goto(server.url() + f"/jobs/{bad['jobId']}")
    verdict = page.locator("#verdict")
    assert verdict.locator(".verdict-status").inner_text() == "FAILED"
    validation = page.locator("#validation")
    assert "add(2, 3) is not 5" in validation.inner_text() and "exit 1" in validation.inner_text()
    red = mean_rgb(verdict.screenshot())
    shot(page, "failed-job-validation")

    page.goto(server.url() + f"/jobs/{good['jobId']}")
    assert page.locator("#verdict .verdict-status").inner_text() == "COMPLETED"
    green = mean_rgb(page.locator("#verdict").screenshot())
    assert red[0] > red[1] + 20 and green[1] > green[0] + 20, (red, green)
    diff = page.locator("#diff")
    assert "app.py" in diff.inner_text() and diff.locator("tr.add").count() >= 1
    assert diff.locator("tr.add .hl-k, tr.add .hl-kn, tr.add .hl-nf").count() >= 1  # highlighted Python
    shot(page, "job")
    assert page.errors == []  # type: ignore[attr-defined]


def test_land_and_discard_from_the_buttons(page, server, repo, fake):
    fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    first = run_job(repo, "T-land", "test -f fix.txt")
    fake("claude", Behaviour(writes={"other.txt": "other\n"}))
    second = run_job(repo, "T-discard")

    assert first["status"] == "completed", first
    page.goto(server.url() + f"/jobs/{first['jobId']}")
    page.click("#land")
    page.wait_for_selector("#flash")
    flash = page.locator("#flash").inner_text()
    assert "land done" in flash and "OK" in flash, flash
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == first["commit"]
    assert page.locator("#verdict").inner_text().count("landed") == 1
    shot(page, "land")
    assert [r.payload["via"] for r in rows("review.land", first["jobId"])] == ["web"]

    page.goto(server.url() + f"/jobs/{second['jobId']}")
    asked: list[str] = []

    def dismiss(d):
        asked.append(d.message)
        d.dismiss()

    page.once("dialog", dismiss)
    page.click("#discard")
    page.wait_for_timeout(500)
    assert asked and second["jobId"] in asked[0]
    assert Path(second["worktreePath"]).exists() and not rows("review.discard", second["jobId"])  # the control
    page.once("dialog", lambda d: d.accept())
    page.click("#discard")
    page.wait_for_selector("#flash")
    assert "discard done" in page.locator("#flash").inner_text()
    assert not Path(second["worktreePath"]).exists()
    assert f"wt/{second['jobId']}" not in sh("git", "branch", "--list", cwd=repo)


def test_a_running_jobs_row_follows_it_live_without_a_reload(page, server, repo, fake):
    fake("claude", Behaviour(writes={"a.txt": "a\n"}, stdout="step 1 of 3: reading the code\n", sleep=5))
    proc = start_job(repo, "T-live")
    try:
        deadline = time.monotonic() + 30
        while not list((Path(os.environ["PROCTOR_HOME"]) / "jobs").glob("*/progress.json")):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.1)
        page.goto(server.url())
        page.evaluate("window.__sameDocument = true")
        row = page.locator("tr[data-job]").first
        # Locator waits, not wait_for_function: the page's CSP forbids the eval that one needs.
        expect(row.locator('[data-field="progress"]')).to_contain_text("reading the code", timeout=30_000)
        assert row.locator('[data-field="status"]').inner_text() == "running"
        assert "running claude" in row.locator('[data-field="progress"]').inner_text()
        shot(page, "running")
        expect(row.locator('[data-field="status"]')).to_have_text("completed", timeout=60_000)
        assert page.evaluate("window.__sameDocument") is True, "the row was updated by a reload, not the stream"
        assert row.locator('[data-field="progress"]').inner_text() == ""
    finally:
        out, _ = proc.communicate(timeout=120)
    assert json.loads(out)["status"] == "completed"


HOSTILE = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">"


def test_an_agents_markup_runs_nothing_in_the_page(page, server, repo, fake):
    fake("claude", Behaviour(writes={"<img src=x onerror=alert(3)>.txt": HOSTILE + "\n"},
                             stdout=json.dumps({"type": "result", "is_error": False, "result": HOSTILE}) + "\n"))
    res = run_job(repo, "T-xss", f"echo '{HOSTILE}'; exit 1")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(server.url() + f"/jobs/{res['jobId']}")
    page.wait_for_timeout(500)
    assert page.evaluate("typeof window.__pwned") == "undefined" and dialogs == []
    assert "<script>window.__pwned=1</script>" in page.locator("#diff").inner_text()
    assert "<script>window.__pwned=1</script>" in page.locator("#validation").inner_text()
    assert page.locator("#diff img, #validation img, .claim img").count() == 0


def test_a_page_of_another_site_cannot_land_a_job_even_with_the_csrf_token(page, server, repo, fake, browser):
    fake("claude", Behaviour(writes={"fix.txt": "fixed\n"}))
    res = run_job(repo, "T-csrf", "test -f fix.txt")
    before = sh("git", "rev-parse", "master", cwd=repo).strip()
    page.goto(server.url() + f"/jobs/{res['jobId']}")
    csrf = page.locator('input[name="csrf"]').first.get_attribute("value")  # as if it had leaked
    target = server.url(f"/jobs/{res['jobId']}/land")
    evil = (f'<form id="f" method="post" action="{target}"><input name="csrf" value="{csrf}">'
            '<input name="mode" value="auto"></form>'
            f'<script>fetch("{target}", {{method: "POST", mode: "no-cors", credentials: "include", '
            f'body: new URLSearchParams({{csrf: "{csrf}"}})}}).finally(() => document.getElementById("f").submit())'
            '</script>').encode()

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(evil)))
            self.end_headers()
            self.wfile.write(evil)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        # localhost, not 127.0.0.1: another site to the browser, as a page of any origin would be.
        page.goto(f"http://localhost:{site.server_address[1]}/")
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(500)
    finally:
        site.shutdown()
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == before
    assert not rows("review.land", res["jobId"]), "a cross-site request reached land"
    # The control: the same browser, on the page itself, lands it.
    page.goto(server.url() + f"/jobs/{res['jobId']}")
    page.click("#land")
    page.wait_for_selector("#flash")
    assert sh("git", "rev-parse", "master", cwd=repo).strip() == res["commit"]
