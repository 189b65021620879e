"""The review page's routes, mounted into `proctor serve`'s app (proctor.surfaces.api.app).

    GET  /review                     the sign-in page (a form); with a bearer token, a redirect to the page
    GET  /review/login               the sign-in form (a code or a token in its address is refused)
    POST /review/login               code=C (the one-time code, typed), or token=T: a session cookie
                                     (proctor.surfaces.web.access)
    GET  /review/static/NAME         the page's CSS and JS, from the package: no CDN, nothing fetched elsewhere
    under /review/<scope> (the page's secret path; the cookie's Path):
    GET  /                           the job list (filters: ?repo=PATH&status=S, S may be needs-review)
    GET  /jobs/{id}                  one job: task, verdict, diff, validation output, risks, gate, ledger
    POST /jobs/{id}/land             land it (mode, into, force + reason): proctor.services.review.land, via "web"
    POST /jobs/{id}/discard          discard it: proctor.services.review.gc.discard, via "web"
    GET  /events                     server-sent events: the list's rows whenever one changed (running jobs'
                                     phase and last output line from their progress.json)

Owns HTTP for the page: who is asking (access), post-redirect-get for the verbs with the outcome shown
once, and showing untrusted text one way: every value a template prints passes `terminal.visible` (the
Jinja `finalize` hook, so no template can forget it) before HTML escaping; the live stream's rows pass the
same function. A verb's outcome is the review layer's (a stable code); the page never decides whether a job
may land. Every page view of a job, and every verb, is a ledger row. The security headers are set on every
response of the origin by proctor.surfaces.api.app.
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
from fastapi.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape
from starlette.concurrency import run_in_threadpool

from proctor.surfaces.web.access import SECURITY_HEADERS
from proctor.services.job import record
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.ledger.summary import Summary
from proctor.services.race import pick as pick_mod
from proctor.services.race import races
from proctor.services.review import gc as gc_mod
from proctor.services.review import jobs as jobs_mod
from proctor.services.review import land as land_mod
from proctor.services.review.outcome import Code, Outcome
from proctor.mechanisms.terminal import visible
from proctor.surfaces.web import patch, views
from proctor.surfaces.web.access import EVERY_CLIENT, Access, Failures

PREFIX = "/review"
STATIC = {"review.css": "text/css", "review.js": "text/javascript"}
MODES = ("auto", "ff-only", "merge", "squash")
EVENT_POLL_S = 1.0  # how often the stream looks for a change
EVENT_FULL_S = 5.0  # and reads every job anew even when nothing it watches changed (a host that died)
STREAM_MAX_S = 600.0  # then the stream ends; EventSource reconnects (bounded work per open page)
MAX_FORM_BYTES = 16 * 1024
MAX_PARAM_CHARS = 4096  # of one query or form value (a path is at most PATH_MAX); longer is a 400
LIST_MAX = 500  # newest jobs on the list page; how many more there are is said (`proctor jobs` has them all)
FLASH_KEPT = 64
HEADERS = SECURITY_HEADERS  # also set on every response of the origin (guard.SecurityHeaders)


def shown(value: Any) -> Any:
    """Jinja's finalize: every printed string through `visible` (one line), then autoescape. Markup (the
    diff's highlighted lines, `block` below) was made safe where it was built."""
    if isinstance(value, Markup) or value is None or isinstance(value, (int, float, bool)):
        return value
    return visible(value)


def block(value: Any, most: int | None = None) -> Markup:
    """A block of text shown as lines (validation output, the task, a summary): `visible` keeping newlines."""
    return Markup(escape(visible("" if value is None else value, lines=True, most=most)))


def _env() -> Environment:
    env = Environment(loader=PackageLoader("proctor.surfaces.web", "templates"), autoescape=select_autoescape(["html"]),
                      trim_blocks=True, lstrip_blocks=True, finalize=shown)
    env.globals["assets"] = f"{PREFIX}/static"
    env.globals["login"] = f"{PREFIX}/login"
    env.filters["q"] = lambda v: quote(str(v), safe="")
    env.filters["block"] = block
    return env


class BadParam(Exception):
    """A query or form value the page will not use (NUL, a control, over MAX_PARAM_CHARS): a 400."""


def param(value: str, name: str) -> str:
    if len(value) > MAX_PARAM_CHARS:
        raise BadParam(f"{name} is {len(value)} characters, over the limit of {MAX_PARAM_CHARS}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise BadParam(f"{name} holds a control character (NUL, a newline, ...): {visible(value, most=80)}")
    return value


class Site:
    """The page's state: the access check, the templates, the outcomes not yet shown, the ledger opener."""

    def __init__(self, access: Access, open_ledger: Callable[[], Ledger] = Ledger.default) -> None:
        self.access = access
        self.open_ledger = open_ledger
        self.root = f"{PREFIX}/{access.scope}"  # the page's secret path (proctor.surfaces.web.access says why)
        self.env = _env()
        self.flashes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.failures = Failures(self._failed_row)
        self.views = Summary()  # a job page's views: one row a job a minute, the rest counted (issue 41)
        patch.warm()

    def _failed_row(self, payload: dict[str, Any]) -> None:
        with self.open_ledger() as ledger:
            jobs_mod.note(ledger, "review.web.login", payload)

    def close(self) -> None:
        self.failures.flush()
        with self.open_ledger() as ledger:
            self.views.flush(ledger)

    def render(self, name: str, http_status: int = 200, **values: Any) -> HTMLResponse:
        """A page for a signed-in reviewer: it links under the secret path and its forms carry the CSRF token."""
        html = self.env.get_template(name).render(csrf=self.access.csrf, prefix=self.root, **values)
        return HTMLResponse(html, status_code=http_status, headers=HEADERS)

    def render_public(self, name: str, http_status: int, **values: Any) -> HTMLResponse:
        """A page for whoever asks (sign-in, refusals): it names neither the secret path nor the CSRF token."""
        html = self.env.get_template(name).render(csrf="", prefix=PREFIX, **values)
        return HTMLResponse(html, status_code=http_status, headers=HEADERS)

    def flash(self, outcome: dict[str, Any]) -> str:
        key = secrets.token_urlsafe(12)
        self.flashes[key] = outcome
        while len(self.flashes) > FLASH_KEPT:
            self.flashes.popitem(last=False)
        return key

    def signed_in(self, request: Request, via: str) -> Response:
        """The session cookie, scoped to the page's secret path, and a redirect to the page."""
        with self.open_ledger() as ledger:
            jobs_mod.note(ledger, "review.web.login", {"ok": True, "via": via, "client": _client(request)})
        resp = RedirectResponse(self.root, status_code=303, headers=HEADERS)
        resp.set_cookie(self.access.cookie, self.access.session, httponly=True, samesite="strict", path=self.root,
                        secure=request.url.scheme == "https")
        return resp


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _authorized(site: Site, request: Request) -> bool:
    return site.access.allowed(request.headers.get("cookie"), request.headers.get("authorization"))


def _denied(site: Site) -> HTMLResponse:
    return site.render_public("denied.html", 401)


def _bad(reason: str) -> PlainTextResponse:
    return PlainTextResponse(f"bad request: {reason}", status_code=400, headers=HEADERS)


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


def sign_in(site: Site) -> APIRouter:
    """The routes outside the secret path: sign-in and the public assets."""
    r = APIRouter(prefix=PREFIX, include_in_schema=False)

    def attempt(request: Request, ok: Callable[[], bool], via: str) -> Response:
        if ok():  # the right credential always signs in (access says why)
            return site.signed_in(request, via)
        if site.failures.failed(EVERY_CLIENT):
            return PlainTextResponse("too many failed sign-ins: wait a minute", status_code=429,
                                     headers={**HEADERS, "Retry-After": "60"})
        return site.render_public("denied.html", 401, bad_token=True)

    @r.get("")
    def front(request: Request) -> Response:
        if site.access.bearer_ok(request.headers.get("authorization")):
            return RedirectResponse(site.root, status_code=303, headers=HEADERS)
        return _denied(site)

    @r.get("/login")
    def login(request: Request, code: str = "", token: str = "") -> Response:
        if token:  # never compared: a token in a URL stays in the history; say so and sign nobody in
            return site.render_public("denied.html", 400, token_in_url=True)
        if code:  # an address is in the browser's command line for every local user: the code is spent unused
            site.access.spend_code(code)
            return site.render_public("denied.html", 400, code_in_url=True)
        return _denied(site)

    @r.post("/login")
    async def login_post(request: Request) -> Response:
        form = await _form(request) or {}
        if "token" in form:
            return attempt(request, lambda: site.access.token_ok(form["token"].strip()), "token")
        return attempt(request, lambda: site.access.spend_code(form.get("code")), "code")

    @r.get("/static/{name}")
    def static(name: str) -> Response:
        if name == "highlight.css":
            return Response(patch.stylesheet(), media_type="text/css", headers=HEADERS)
        if name not in STATIC:
            return PlainTextResponse("no such asset", status_code=404, headers=HEADERS)
        body = resources.files("proctor.surfaces.web").joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC[name], headers=HEADERS)

    return r


def routes(site: Site) -> APIRouter:
    """The page itself, under its secret path."""
    r = APIRouter(prefix=site.root, include_in_schema=False)

    @r.get("")
    def job_list(request: Request, repo: str = "", status: str = "") -> Response:
        if not _authorized(site, request):
            return _denied(site)
        try:
            repo, status = param(repo, "repo"), param(status, "status")
        except BadParam as exc:
            return _bad(str(exc))
        with site.open_ledger() as ledger:
            rows = views.job_list(ledger, repo, status)
        return site.render("list.html", rows=rows[:LIST_MAX], older=max(0, len(rows) - LIST_MAX), repo=repo,
                           status=status, statuses=views.STATUS_FILTERS)

    @r.get("/jobs/{job_id}")
    def job_page(request: Request, job_id: str, flash: str = "") -> Response:
        if not _authorized(site, request):
            return _denied(site)
        try:
            job_id = param(job_id, "job id")
        except BadParam as exc:
            return _bad(str(exc))
        with site.open_ledger() as ledger:
            found = jobs_mod.find(ledger, job_id)
            if isinstance(found, Outcome):
                return site.render("missing.html", 404, job_id=job_id, outcome=found.to_dict())
            site.views.note(ledger, "review.show", {"ok": True, "jobId": found.job_id, "via": "web"},
                            principal="web", subject=found.job_id, job_id=found.job_id)
            page = views.job_page(ledger, found)
        return site.render("job.html", **page, modes=MODES, flash=site.flashes.pop(flash, None) if flash else None)

    async def posted(request: Request, name: str) -> dict[str, str] | Response:
        """A verb's form, signed in, from this page (its CSRF token), every value a plain parameter; else the
        refusal to answer with."""
        if not _authorized(site, request):
            return _denied(site)
        form = await _form(request)
        if form is None or not site.access.csrf_ok(form.get("csrf")):
            return PlainTextResponse(f"{name} refused (CSRF): the form did not come from this page; reload it",
                                     status_code=403, headers=HEADERS)
        try:
            for key, value in form.items():
                param(value, key)
        except BadParam as exc:
            return _bad(str(exc))
        return form

    async def verb(request: Request, job_id: str, act: Callable[[Ledger, jobs_mod.Job, dict[str, str]], Outcome],
                   name: str) -> Response:
        form = await posted(request, name)
        if isinstance(form, Response):
            return form

        def run() -> tuple[str, dict[str, Any]]:
            with site.open_ledger() as ledger:
                found = jobs_mod.find(ledger, job_id)
                if isinstance(found, Outcome):
                    return job_id, {"verb": name, **found.to_dict()}
                return found.job_id, {"verb": name, **act(ledger, found, form).to_dict()}

        jid, outcome = await run_in_threadpool(run)
        return RedirectResponse(f"{site.root}/jobs/{quote(jid, safe='')}?flash={site.flash(outcome)}",
                                status_code=303, headers=HEADERS)

    def do_land(ledger: Ledger, job: jobs_mod.Job, form: dict[str, str]) -> Outcome:
        # What lands is what the person saw: the whole patch, the very one the page was made from.
        now = views.landable_digest(job)
        if not now or form.get("shown") != now:
            why = ("the page does not show all of this job's diff (a line, file or part of one is cut): read it "
                   "with `proctor diff`, then `proctor land`" if not now else
                   "the diff is not the one this page showed: reload the page and read it again")
            jobs_mod.note(ledger, "review.land", {"ok": False, "code": "NOT_AS_SHOWN", "jobId": job.job_id,
                                                  "via": "web", "reason": why}, job.job_id)
            return Outcome(Code.NOT_AS_SHOWN, why)
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

    @r.get("/races/{race_id}")
    def race_page(request: Request, race_id: str, flash: str = "") -> Response:
        if not _authorized(site, request):
            return _denied(site)
        try:
            race_id = param(race_id, "race id")
        except BadParam as exc:
            return _bad(str(exc))
        with site.open_ledger() as ledger:
            found = races.find(ledger, race_id)
            if isinstance(found, str):
                return site.render("missing.html", 404, job_id=race_id,
                                   outcome={"ok": False, "code": "UNKNOWN_JOB", "reason": found})
            site.views.note(ledger, "review.show", {"ok": True, "raceId": found.race_id, "via": "web"},
                            principal="web", subject=found.race_id)
            page = views.race_page(ledger, found)
        return site.render("race.html", **page, flash=site.flashes.pop(flash, None) if flash else None)

    @r.post("/races/{race_id}/land")
    async def land_race(request: Request, race_id: str) -> Response:
        """Land the job the person picked on the race's page, as shown there, and discard the rest."""
        form = await posted(request, "land")
        if isinstance(form, Response):
            return form
        try:
            race_id = param(race_id, "race id")
        except BadParam as exc:
            return _bad(str(exc))

        def run() -> tuple[str, dict[str, Any]]:
            with site.open_ledger() as ledger:
                found = races.find(ledger, race_id)
                if isinstance(found, str):
                    return race_id, {"verb": "land", "ok": False, "code": "UNKNOWN_JOB", "reason": found}
                job = pick_mod.chosen(ledger, found, form.get("pick") or None)
                if isinstance(job, Outcome):
                    return found.race_id, {"verb": "land", **job.to_dict()}
                now = views.landable_digest(job)  # "" when the page cut anything: no land from it then
                if not now or form.get("shown") != now:  # what lands is what the page showed
                    why = "the diff is not the one this page showed (or the page cut it): reload and read it again"
                    jobs_mod.note(ledger, "review.land", {"ok": False, "code": "NOT_AS_SHOWN", "jobId": job.job_id,
                                                          "via": "web", "reason": why}, job.job_id)
                    return found.race_id, {"verb": "land", **Outcome(Code.NOT_AS_SHOWN, why).to_dict()}
                out = pick_mod.land_race(ledger, found.race_id, job.job_id, via="web")
                return found.race_id, {"verb": "land", **out.to_dict()}

        rid, outcome = await run_in_threadpool(run)
        return RedirectResponse(f"{site.root}/races/{quote(rid, safe='')}?flash={site.flash(outcome)}",
                                status_code=303, headers=HEADERS)

    @r.get("/events")
    async def events(request: Request, repo: str = "", status: str = "", job: str = "") -> Response:
        if not _authorized(site, request):
            return PlainTextResponse("not signed in", status_code=401, headers=HEADERS)
        try:
            repo, status, job = param(repo, "repo"), param(status, "status"), param(job, "job")
        except BadParam as exc:
            return _bad(str(exc))
        return StreamingResponse(_stream(site, request, repo, status, job), media_type="text/event-stream",
                                 headers={**HEADERS, "X-Accel-Buffering": "no"})

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
                yield b"event: jobs\ndata: " + json.dumps(views.shown_rows(changed)).encode() + b"\n\n"
        await asyncio.sleep(EVENT_POLL_S)


def mount(app: FastAPI, site: Site) -> None:
    app.include_router(sign_in(site))
    app.include_router(routes(site))

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(PREFIX, status_code=307)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204, headers=HEADERS)  # a browser asks; nothing to fetch, nothing logged
