"""FastAPI app: POST /v1/jobs (a signed envelope -> 202 + job id), GET /v1/jobs/{id}, GET .../result?wait=S.

Owns mapping queue outcomes to HTTP: a body that is not JSON (or holds a number no float can hold, `1e999`)
or a malformed envelope is 400, a bad or untrusted signature 401, a signer not trusted for the kind 403, a
request or payload that does not fit the schema 422, an unknown job 404, a result not ready yet 202, a queue
that cannot take the job 503. Every refusal is `{"code": <stable code>, "detail": ...}`; nothing a client
sends is echoed into an error it cannot serialize. Host, Origin, body size and deadlines are checked before
any route, by `guard.RequestGuard`. It never signs on a caller's behalf: the caller's own signature is the
authentication of a POST, and the target host's listener checks it again before anything runs. A read
(`GET /v1/jobs/...`) needs this install's token or a read signed by the job's own sender (`reads`): the job
id is never a capability.

Every page of the origin is proctor's: no interactive docs page (FastAPI's loads a script from a public CDN
onto this origin), the OpenAPI document as JSON at /openapi.json only, the page's security headers on every
response (`guard.SecurityHeaders`), and 404 for any other path.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from proctor.surfaces.api.guard import HttpLimits, RequestGuard, SecurityHeaders, allowed_names
from proctor.surfaces.api.reads import check_read
from proctor.mechanisms.queue import sender
from proctor.mechanisms.queue.backend import QueueBackend, check_name, valid_job_id
from proctor.mechanisms.queue.envelope import MAX_TTL_S, EnvelopeError, Sealed, unseal, verify
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import TrustStore
from proctor.surfaces.api.quota import Quota
from proctor.surfaces.web import app as web
from proctor.surfaces.web.app import Site

MAX_WAIT_S = 60.0
JOB_ID = Path(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="A job id returned by POST /v1/jobs.")


class EnvelopeIn(BaseModel):
    """The wire envelope exactly as `proctor enqueue` publishes it."""

    model_config = ConfigDict(extra="forbid")
    v: int = Field(description="Envelope version; 1.")
    alg: str = Field(description="ed25519 or hmac-sha256.")
    body: str = Field(description="Base64 of the canonical JSON body that was signed.")
    sig: str = Field(description="Base64 signature over the domain and the body bytes.")


class Accepted(BaseModel):
    jobId: str
    target: str
    lane: str
    kind: str


class JobState(BaseModel):
    model_config = ConfigDict(extra="allow")
    jobId: str
    state: str
    target: str
    lane: str
    kind: str


class Problem(BaseModel):
    code: str = Field(description="Stable machine-readable reason, e.g. BAD_JSON, FORGED, BODY_TOO_LARGE.")
    detail: Any = Field(description="What a person reads: a sentence, or a list of problems.")


CODES = {400: "BAD_REQUEST", 401: "UNAUTHENTICATED", 403: "FORBIDDEN", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
         408: "REQUEST_TIMEOUT", 413: "BODY_TOO_LARGE", 415: "UNSUPPORTED_MEDIA_TYPE", 421: "MISDIRECTED_HOST",
         422: "INVALID_REQUEST", 500: "INTERNAL", 503: "UNAVAILABLE"}
log = logging.getLogger(__name__)


class ApiError(HTTPException):
    def __init__(self, status: int, code: str, detail: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, detail, headers)
        self.code = code


def problem(status: int, code: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"code": code, "detail": detail}, headers=headers)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range: not a finite float")
    return value


def _constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def parse_json(body: bytes) -> Any:
    """Strict JSON: no NaN/Infinity, no number that overflows a float; any failure is an ApiError 400."""
    try:
        return json.loads(body, parse_float=_finite, parse_constant=_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and int-digit limits are ValueErrors
        raise ApiError(400, "BAD_JSON", f"the body is not valid JSON: {str(exc)[:200]}") from None


def _errors(exc: ValidationError | RequestValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors without the input or context: both may hold what the client sent, unserializable."""
    out = []
    for err in exc.errors():
        out.append({"loc": [str(x) for x in err.get("loc", ())], "msg": str(err.get("msg", "")),
                    "type": str(err.get("type", ""))})
    return out


def create_app(
    backend_factory: Callable[[], Awaitable[QueueBackend]] | None,
    trust: TrustStore,
    sent: SentStore | None = None,
    *,
    bind: str = "127.0.0.1",
    allow_hosts: Iterable[str] = (),
    limits: HttpLimits | None = None,
    review: Site | None = None,
    read_token: str | None = None,
    quota: Quota | None = None,
) -> FastAPI:
    """`sent`: where this API records the envelopes it accepted (default: `$PROCTOR_HOME/queue-sent`). A job's
    state and result are bound to that record (the host its envelope named, its digest), never to the job
    record on the queue server, which anyone reaching the server can rewrite.

    `bind` and `allow_hosts`: the names a request's Host (and a browser's Origin) may carry, besides
    127.0.0.1, localhost and [::1], always on the port the request arrived on. `limits`: body cap and
    deadlines (serve the app with `guard.server_config` for the header deadline and connection cap).

    `backend_factory` None: no queue (`proctor serve --no-queue`); every /v1 route answers 503
    QUEUE_DISABLED. `review`: the review page (proctor.surfaces.web) under /review, behind the same guard.
    `read_token`: this install's token, which reads any job (`reads`); None: only signed reads. `quota`: a
    signer's share of POST /v1/jobs (default: `limits.jobs_per_signer_per_minute` a wall-clock minute)."""
    state: dict[str, QueueBackend] = {}
    sent_store = sent or SentStore()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if backend_factory is None:
            try:
                yield
            finally:
                if review is not None:
                    review.close()  # the failed sign-ins of the window still open: one summary row each
            return
        state["backend"] = await backend_factory()
        try:
            yield
        finally:
            await state["backend"].close()
            if review is not None:
                review.close()

    def backend() -> QueueBackend:
        if "backend" not in state:
            raise ApiError(503, "QUEUE_DISABLED", "this server runs without a queue (proctor serve --no-queue)")
        return state["backend"]

    limits = limits or HttpLimits()
    quota = quota or Quota(limits.jobs_per_signer_per_minute)
    app = FastAPI(title="proctor queue", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  swagger_ui_oauth2_redirect_url=None)
    app.add_middleware(RequestGuard, names=allowed_names(bind, allow_hosts), limits=limits)
    app.add_middleware(SecurityHeaders)  # outermost: the guard's own refusals carry the headers too

    def reader(request: Request, job_id: str) -> None:
        """The read's credential, before anything of the job is looked up (`reads`)."""
        known = sent_store.get(job_id)
        refused = check_read(request.headers, request.method, request.url.path,
                             sender=known.signer if known else None, trust=trust, token=read_token)
        if refused is not None:
            raise ApiError(refused.status, refused.code, refused.reason)
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": Problem} for code in (400, 401, 403, 404, 408, 413, 421, 422, 429, 503)
    }

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = getattr(exc, "code", None) or CODES.get(exc.status_code, f"HTTP_{exc.status_code}")
        return problem(exc.status_code, code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return problem(422, "INVALID_REQUEST", _errors(exc))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in the HTTP API", exc_info=exc)
        return problem(500, "INTERNAL", "internal error; the server log has the details")

    if review is not None:
        web.mount(app, review)

    body_schema = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": EnvelopeIn.model_json_schema()}}}}

    duplicate_doc = {"description": "DUPLICATE: this very envelope was accepted already; nothing was queued "
                                    "again, and its job's result is still this envelope's answer",
                     "content": {"application/json": {"schema": {"type": "object", "required": ["jobId", "code"],
                                                                 "properties": {"jobId": {"type": "string"},
                                                                                "code": {"const": "DUPLICATE"}}}}}}

    @app.post("/v1/jobs", status_code=202, response_model=Accepted, openapi_extra=body_schema,
              responses={**errors, 200: duplicate_doc, 409: {"model": Problem}})
    async def post_job(request: Request) -> Any:
        queue = backend()
        media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(415, "UNSUPPORTED_MEDIA_TYPE", f"the body must be application/json, not {media[:80]!r}")
        try:
            envelope = EnvelopeIn.model_validate(parse_json(await request.body()))
        except ValidationError as exc:
            raise ApiError(422, "INVALID_ENVELOPE", _errors(exc)) from None
        env = unseal(envelope.model_dump())
        if isinstance(env, EnvelopeError):
            raise ApiError(400, env.code, env.reason)
        signer = trust.signer(env.claimed.get("signer"))
        opened = verify(env, signer.verifier if signer else None)
        if isinstance(opened, EnvelopeError):
            raise ApiError(401, opened.code, f"{opened.code}: {opened.reason}")
        f = opened.fields
        kind, target, lane, job_id = f.get("kind"), f.get("target"), f.get("lane"), f.get("jobId")
        if not all(isinstance(x, str) for x in (kind, target, lane)) or not valid_job_id(job_id):
            raise ApiError(400, "MALFORMED", "envelope body needs string kind, target, lane and a jobId [A-Za-z0-9_-]")
        if signer is None or kind not in signer.kinds:
            raise ApiError(403, "KIND_NOT_ALLOWED", f"signer may not send kind {kind!r}")
        try:
            wait = await quota.take(signer.name, queue)
        except Exception as exc:  # noqa: BLE001 - a share that cannot be counted is not granted
            raise ApiError(503, "QUEUE_UNAVAILABLE",
                           f"the signer's share could not be counted: {type(exc).__name__}: {exc}") from None
        if wait is not None:
            raise ApiError(429, "SIGNER_QUOTA", f"signer {signer.name} sent {quota.per_window} jobs in this "
                           f"{quota.window_s:.0f} s window, its share: retry in {wait:.0f} s",
                           {"Retry-After": str(max(1, round(wait)))})
        problems = sender.validate_payload(kind, f.get("payload"))
        try:
            check_name("host", target)
            check_name("lane", lane)
        except ValueError as exc:
            problems.append(str(exc))
        if not isinstance(f.get("expiresAt"), (int, float)) or f["expiresAt"] < time.time():
            problems.append("envelope has expired")
        elif not isinstance(f.get("issuedAt"), (int, float)) or f["expiresAt"] - f["issuedAt"] > MAX_TTL_S:
            problems.append(f"an envelope lives at most {MAX_TTL_S} seconds (issuedAt to expiresAt)")
        if problems:
            raise ApiError(422, "INVALID_PAYLOAD", problems)
        try:  # a job for a host or lane no listener ever opened is kept for no one: nothing is stored for it
            known = await queue.has_listener(target, lane)
        except Exception as exc:  # noqa: BLE001 - the queue is down: the client may retry
            raise ApiError(503, "QUEUE_UNAVAILABLE", f"the queue did not answer: {type(exc).__name__}: {exc}") from None
        if not known:
            raise ApiError(404, "UNKNOWN_TARGET", f"no listener of host {target!r} has opened lane {lane!r}: "
                           "a job for it would wait for no one (start `proctor listen` there first)")
        sealed = Sealed(env.alg, env.body, env.sig)
        reused = sender.reused_id(sealed, sent_store)
        if reused is not None:  # another envelope owns this id here: queueing this one would rebind it
            raise ApiError(409, reused.code, reused.message)
        try:
            done = await sender.publish(queue, sealed, sent=sent_store)
        except sender.PublishRefused as exc:  # the queue server's own permissions: retrying will not help
            raise ApiError(403, "QUEUE_REFUSED", str(exc)) from None
        except sender.QueueFull as exc:  # the quota: later, as jobs run or expire
            raise ApiError(429, "QUEUE_FULL", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the queue is down or refused: the client may retry
            raise ApiError(503, "QUEUE_UNAVAILABLE",
                           f"the queue did not accept the job: {type(exc).__name__}: {exc}") from None
        if done.duplicate:  # a retried POST: 200, not 202, for nothing new was accepted
            return JSONResponse(status_code=200, content={
                "jobId": done.job_id, "target": done.target, "lane": done.lane, "kind": done.kind,
                "code": done.code, "acceptedAt": done.accepted_at, "detail": done.notice()})
        return Accepted(jobId=done.job_id, target=done.target, lane=done.lane, kind=done.kind)

    @app.get("/v1/jobs/{job_id}", response_model=JobState, responses=errors)
    async def get_job(request: Request, job_id: str = JOB_ID) -> dict[str, Any]:
        reader(request, job_id)
        out = await sender.status(backend(), trust, job_id, sent=sent_store)
        if out is None:
            raise ApiError(404, "UNKNOWN_JOB", f"no job {job_id}")
        return out

    @app.get("/v1/jobs/{job_id}/result", responses={**errors, 202: {"model": JobState}})
    async def get_result(
        request: Request, job_id: str = JOB_ID,
        wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="Seconds to wait."),
    ) -> Any:
        reader(request, job_id)
        queue = backend()
        res = await sender.wait(queue, trust, job_id, wait, sent=sent_store)
        if isinstance(res, EnvelopeError) and res.code == "UNKNOWN_JOB":
            raise ApiError(404, "UNKNOWN_JOB", f"no job {job_id} was accepted by this API")
        if res is None or not isinstance(res, sender.SignedResult):
            out = await sender.status(queue, trust, job_id, sent=sent_store)
            return JSONResponse(status_code=202, content=out)
        return {"jobId": job_id, **sender.result_view(res)}

    return app
