"""FastAPI app: POST /v1/jobs (a signed envelope -> 202 + job id), GET /v1/jobs/{id}, GET .../result?wait=S.

Owns mapping queue outcomes to HTTP: a malformed envelope is 400, a bad or untrusted signature 401, a signer
not trusted for the kind 403, an invalid payload 422, an unknown job 404, a result not ready yet 202, a queue that cannot take the job 503. It never
signs on a caller's behalf: the caller's own signature is the authentication, and the target host's listener
checks it again before anything runs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Path, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from proctor.queue import sender
from proctor.queue.backend import QueueBackend, check_name, valid_job_id
from proctor.queue.envelope import EnvelopeError, Sealed, unseal, verify
from proctor.queue.sent import SentStore
from proctor.queue.signers import TrustStore

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
    detail: Any


def create_app(
    backend_factory: Callable[[], Awaitable[QueueBackend]], trust: TrustStore, sent: SentStore | None = None
) -> FastAPI:
    """`sent`: where this API records the envelopes it accepted (default: `$PROCTOR_HOME/queue-sent`). A job's
    state and result are bound to that record (the host its envelope named, its digest), never to the job
    record on the queue server, which anyone reaching the server can rewrite."""
    state: dict[str, QueueBackend] = {}
    sent_store = sent or SentStore()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["backend"] = await backend_factory()
        try:
            yield
        finally:
            await state["backend"].close()

    app = FastAPI(title="proctor queue", version="1", lifespan=lifespan)
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": Problem} for code in (400, 401, 403, 404, 422, 503)
    }

    @app.post("/v1/jobs", status_code=202, response_model=Accepted, responses=errors)
    async def post_job(envelope: EnvelopeIn) -> Accepted:
        env = unseal(envelope.model_dump())
        if isinstance(env, EnvelopeError):
            raise HTTPException(400, env.reason)
        signer = trust.signer(env.claimed.get("signer"))
        opened = verify(env, signer.verifier if signer else None)
        if isinstance(opened, EnvelopeError):
            raise HTTPException(401, f"{opened.code}: {opened.reason}")
        f = opened.fields
        kind, target, lane, job_id = f.get("kind"), f.get("target"), f.get("lane"), f.get("jobId")
        if not all(isinstance(x, str) for x in (kind, target, lane)) or not valid_job_id(job_id):
            raise HTTPException(400, "envelope body needs string kind, target, lane and a jobId [A-Za-z0-9_-]")
        if signer is None or kind not in signer.kinds:
            raise HTTPException(403, f"signer may not send kind {kind!r}")
        problems = sender.validate_payload(kind, f.get("payload"))
        try:
            check_name("host", target)
            check_name("lane", lane)
        except ValueError as exc:
            problems.append(str(exc))
        if not isinstance(f.get("expiresAt"), (int, float)) or f["expiresAt"] < time.time():
            problems.append("envelope has expired")
        if problems:
            raise HTTPException(422, problems)
        try:
            done = await sender.publish(state["backend"], Sealed(env.alg, env.body, env.sig), sent=sent_store)
        except Exception as exc:  # noqa: BLE001 - the queue is down or refused: the client may retry
            raise HTTPException(503, f"the queue did not accept the job: {type(exc).__name__}: {exc}") from None
        return Accepted(jobId=done.job_id, target=done.target, lane=done.lane, kind=done.kind)

    @app.get("/v1/jobs/{job_id}", response_model=JobState, responses=errors)
    async def get_job(job_id: str = JOB_ID) -> dict[str, Any]:
        out = await sender.status(state["backend"], trust, job_id, sent=sent_store)
        if out is None:
            raise HTTPException(404, f"no job {job_id}")
        return out

    @app.get("/v1/jobs/{job_id}/result", responses={**errors, 202: {"model": JobState}})
    async def get_result(
        job_id: str = JOB_ID, wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="Seconds to wait.")
    ) -> Any:
        res = await sender.wait(state["backend"], trust, job_id, wait, sent=sent_store)
        if isinstance(res, EnvelopeError) and res.code == "UNKNOWN_JOB":
            raise HTTPException(404, f"no job {job_id} was accepted by this API")
        if res is None or not isinstance(res, sender.SignedResult):
            out = await sender.status(state["backend"], trust, job_id, sent=sent_store)
            return JSONResponse(status_code=202, content=out)
        return {"jobId": job_id, **sender.result_view(res)}

    return app
