"""The review page's routes under /review, mounted into `proctor serve`'s app (proctor.api.app).

    GET  /review                 the job list (filters: ?repo=PATH&status=S), newest first
    GET  /review/jobs/{id}       one job: verdict, diff, validation output, risks, gate decisions, ledger
    POST /review/jobs/{id}/land      land it (mode, into, force + reason): proctor.review.land, via "web"
    POST /review/jobs/{id}/discard   discard it: proctor.review.gc.discard, via "web"
    GET  /review/events          server-sent events: the list's rows whenever one changed (running jobs'
                                 phase and last output line from their progress.json)
    GET  /review/login?token=T   the per-install token for a session cookie (proctor.web.access)
    GET  /review/static/NAME     the page's CSS and JS, from the package: no CDN, nothing fetched elsewhere

Owns HTTP for the page: who is asking (access), the security headers (a CSP that allows only this
origin's own script and style, no framing, no referrer to another origin, no caching), post-redirect-get for the verbs
with the outcome shown once. A verb's outcome is the review layer's (a stable code); the page never
decides whether a job may land. Every page view of a job, and every verb, is a ledger row.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from proctor.job import record
from proctor.ledger import Ledger
from proctor.review import gc as gc_mod
from proctor.review import jobs as jobs_mod
from proctor.review import land as land_mod
from proctor.review.outcome import Outcome
from proctor.web import patch, views
from proctor.web.access import COOKIE, Access

PREFIX = "/review"
STATIC = {"review.css": "text/css", "review.js": "text/javascript"}
MODES = ("auto", "ff-only", "merge", "squash")
EVENT_POLL_S = 1.0  # how often the stream looks for a change
EVENT_FULL_S = 5.0  # and reads every job anew even when nothing it watches changed (a host that died)
STREAM_MAX_S = 600.0  # then the stream ends; EventSource reconnects (bounded work per open page)
MAX_FORM_BYTES = 16 * 1024
LIST_MAX = 500  # newest jobs on the list page; how many more there are is said (`proctor jobs` has them all)
FLASH_KEPT = 64
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store", "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def _env() -> Environment:
    env = Environment(loader=PackageLoader("proctor.web", "templates"), autoescape=select_autoescape(["html"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.globals["prefix"] = PREFIX
    env.filters["q"] = lambda v: quote(str(v), safe="")
    return env


class Site:
    """The page's state: the access check, the templates, the outcomes not yet shown, the ledger opener."""

    def __init__(self, access: Access, open_ledger: Callable[[], Ledger] = Ledger.default) -> None:
        self.access = access
        self.open_ledger = open_ledger
        self.env = _env()
        self.flashes: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def render(self, name: str, http_status: int = 200, **values: Any) -> HTMLResponse:
        html = self.env.get_template(name).render(csrf=self.access.csrf, **values)
        return HTMLResponse(html, status_code=http_status, headers=HEADERS)

    def flash(self, outcome: dict[str, Any]) -> str:
        key = secrets.token_urlsafe(12)
        self.flashes[key] = outcome
        while len(self.flashes) > FLASH_KEPT:
            self.flashes.popitem(last=False)
        return key


def _authorized(site: Site, request: Request) -> bool:
    return site.access.allowed(request.cookies.get(COOKIE), request.headers.get("authorization"))


def _denied(site: Site) -> HTMLResponse:
    return site.render("denied.html", 401)


async def _form(request: Request) -> dict[str, str] | None:
    """An urlencoded form (what the page's forms send); None for anything else or a form over its cap."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/x-www-form-urlencoded":
        return None
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return None
    try:
        parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return None
    return {k: v[0] for k, v in parsed.items()}


def routes(site: Site) -> APIRouter:
    r = APIRouter(prefix=PREFIX, include_in_schema=False)

    @r.get("/login")
    def login(request: Request, token: str = "") -> Response:
        ok = site.access.login_ok(token)
        with site.open_ledger() as ledger:
            jobs_mod.note(ledger, "review.web.login", {"ok": ok})
        if not ok:
            return site.render("denied.html", 401, bad_token=True)
        resp = RedirectResponse(PREFIX, status_code=303, headers=HEADERS)
        resp.set_cookie(COOKIE, site.access.session, httponly=True, samesite="strict", path=PREFIX,
                        secure=request.url.scheme == "https")
        return resp

    @r.get("")
    def job_list(request: Request, repo: str = "", status: str = "") -> Response:
        if not _authorized(site, request):
            return _denied(site)
        with site.open_ledger() as ledger:
            rows = views.job_list(ledger, repo, status)
        return site.render("list.html", rows=rows[:LIST_MAX], older=max(0, len(rows) - LIST_MAX), repo=repo,
                           status=status)

    @r.get("/jobs/{job_id}")
    def job_page(request: Request, job_id: str, flash: str = "") -> Response:
        if not _authorized(site, request):
            return _denied(site)
        with site.open_ledger() as ledger:
            found = jobs_mod.find(ledger, job_id)
            if isinstance(found, Outcome):
                return site.render("missing.html", 404, job_id=job_id, outcome=found.to_dict())
            jobs_mod.note(ledger, "review.show", {"ok": True, "jobId": found.job_id, "via": "web"}, found.job_id)
            page = views.job_page(ledger, found)
        return site.render("job.html", **page, modes=MODES, flash=site.flashes.pop(flash, None) if flash else None)

    async def verb(request: Request, job_id: str, act: Callable[[Ledger, jobs_mod.Job, dict[str, str]], Outcome],
                   name: str) -> Response:
        if not _authorized(site, request):
            return _denied(site)
        form = await _form(request)
        if form is None or not site.access.csrf_ok(form.get("csrf")):
            return PlainTextResponse(f"{name} refused (CSRF): the form did not come from this page; reload it",
                                     status_code=403, headers=HEADERS)

        def run() -> tuple[str, dict[str, Any]]:
            with site.open_ledger() as ledger:
                found = jobs_mod.find(ledger, job_id)
                if isinstance(found, Outcome):
                    return job_id, {"verb": name, **found.to_dict()}
                return found.job_id, {"verb": name, **act(ledger, found, form).to_dict()}

        jid, outcome = await run_in_threadpool(run)
        return RedirectResponse(f"{PREFIX}/jobs/{quote(jid, safe='')}?flash={site.flash(outcome)}", status_code=303,
                                headers=HEADERS)

    def do_land(ledger: Ledger, job: jobs_mod.Job, form: dict[str, str]) -> Outcome:
        mode = form.get("mode", "auto")
        if mode not in MODES:
            mode = "auto"
        force = form.get("force") == "on"
        return land_mod.land(ledger, job, into=form.get("into", "").strip() or None, mode=mode,  # type: ignore[arg-type]
                             force=force, reason=form.get("reason", "").strip() if force else "", via="web")

    def do_discard(ledger: Ledger, job: jobs_mod.Job, form: dict[str, str]) -> Outcome:
        return gc_mod.discard(ledger, job, via="web")

    @r.post("/jobs/{job_id}/land")
    async def land(request: Request, job_id: str) -> Response:
        return await verb(request, job_id, do_land, "land")

    @r.post("/jobs/{job_id}/discard")
    async def discard(request: Request, job_id: str) -> Response:
        return await verb(request, job_id, do_discard, "discard")

    @r.get("/events")
    async def events(request: Request, repo: str = "", status: str = "", job: str = "") -> Response:
        if not _authorized(site, request):
            return PlainTextResponse("not signed in", status_code=401, headers=HEADERS)
        return StreamingResponse(_stream(site, request, repo, status, job), media_type="text/event-stream",
                                 headers={**HEADERS, "X-Accel-Buffering": "no"})

    @r.get("/static/{name}")
    def static(name: str) -> Response:
        if name == "highlight.css":
            return Response(patch.stylesheet(), media_type="text/css", headers=HEADERS)
        if name not in STATIC:
            return PlainTextResponse("no such asset", status_code=404, headers=HEADERS)
        body = resources.files("proctor.web").joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC[name], headers=HEADERS)

    return r


def _mark(ledger: Ledger, running: list[str]) -> tuple[Any, ...]:
    """Cheap to read, and changed whenever a list row can have: the ledger's last row id (a job started,
    ended, was landed) and the running jobs' progress.json times (a phase, an output line)."""
    last = ledger.read(lambda db: db.execute("SELECT max(id) FROM rows").fetchone()[0])
    times = []
    for job_id in running:
        try:
            times.append((record.job_dir(job_id) / "progress.json").stat().st_mtime_ns)
        except (OSError, ValueError):
            times.append(None)
    return (last, *times)


async def _stream(site: Site, request: Request, repo: str, status: str, job: str) -> AsyncIterator[bytes]:
    """`event: jobs` with the rows that changed since the last event (all of them first): the list's rows
    under the same filters as the page, or only job `job`'s."""
    yield b"retry: 2000\n\n"
    sent: dict[str, str] = {}
    running: list[str] = []
    seen: tuple[Any, ...] | None = None
    began = time.monotonic()
    full = began - EVENT_FULL_S
    while time.monotonic() - began < STREAM_MAX_S and not await request.is_disconnected():
        def look() -> list[dict[str, Any]] | None:
            nonlocal seen, full
            with site.open_ledger() as ledger:
                mark = _mark(ledger, running)
                if mark == seen and time.monotonic() - full < EVENT_FULL_S:
                    return None
                seen, full = mark, time.monotonic()
                rows = views.job_list(ledger, repo, status)
                # The page lists the newest LIST_MAX: a row it does not show would make it reload forever.
                return [r for r in rows if r["jobId"] == job] if job else rows[:LIST_MAX]

        rows = await run_in_threadpool(look)
        if rows is not None:
            running[:] = [r["jobId"] for r in rows if r["status"] == "running"]
            changed = []
            for row in rows:
                text = json.dumps(row, sort_keys=True)
                if sent.get(row["jobId"]) != text:
                    sent[row["jobId"]] = text
                    changed.append(row)
            if changed:
                yield b"event: jobs\ndata: " + json.dumps(changed).encode() + b"\n\n"
        await asyncio.sleep(EVENT_POLL_S)


def mount(app: FastAPI, site: Site) -> None:
    app.include_router(routes(site))

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(PREFIX, status_code=307)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204, headers=HEADERS)  # a browser asks; nothing to fetch, nothing logged
