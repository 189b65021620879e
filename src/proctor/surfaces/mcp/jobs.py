"""The jobs this server started: each in a thread of its own running the host's `run_agent`, with its progress.

A job lives as long as the server that started it: when the client goes (stdin closes) or the server is told
to stop, every running job is cancelled — its tree killed, its `job.end` row written (`CANCELLED`) — before
the process exits. At most `max_jobs` run at once (TOO_MANY_JOBS past it). It never reads or writes the
ledger itself (the host does, and the surface writes the rows naming the client).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proctor.contract import Code as JobCode
from proctor.contract import Requester, RunAgentRequest, RunAgentResult, Status
from proctor.mechanisms.config.load import load_config
from proctor.mechanisms.config.model import Config
from proctor.mechanisms.policy.governor import Prebooked
from proctor.mechanisms.process.spawn import Watch
from proctor.mechanisms.terminal import visible
from proctor.services.job.record import new_job_id
from proctor.services.job.run_agent import run_agent
from proctor.surfaces.mcp.results import SHUTTING_DOWN, TOO_MANY_JOBS, Refusal

log = logging.getLogger("proctor.mcp")

DEFAULT_MAX_JOBS = 4  # jobs running at once in one server: a model in a loop cannot start a hundred
SHUTDOWN_WAIT_S = 30.0  # for the cancelled jobs' trees to die and their end rows to be written
LINE_CHARS = 200  # of a job's last output line, as progress shows it


class JobProgress:
    """The host's `Progress` for one job run here: its phases, the last output line, whether it ended.

    Written by the job's thread, read by whichever tool call asks. Every phase is kept (a waiting
    `job_result` notifies each, a short one included); the output line only as it stands when looked at,
    and `updates` counts every change so a waiter notifies only when there is something new.
    """

    MAX_PHASES = 100

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._phases: list[tuple[str, float]] = []
        self._phase = "starting"
        self._last = ""
        self._updates = 0

    def _elapsed(self) -> float:
        return round(time.monotonic() - self._start, 1)

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase, self._last = name, ""
            if len(self._phases) < self.MAX_PHASES:
                self._phases.append((visible(name), self._elapsed()))
            self._updates += 1

    def _line(self, line: str) -> None:
        with self._lock:
            self._last = line[-LINE_CHARS:]
            self._updates += 1

    def watch(self, inner: Watch | None) -> Watch:
        def w(stream: str, chunk: bytes) -> str | None:
            lines = [ln for ln in chunk.decode("utf-8", "replace").splitlines() if ln.strip()]
            if lines:
                self._line(lines[-1])
            return inner(stream, chunk) if inner else None

        return w

    def done(self, result: RunAgentResult) -> None:
        self.phase(f"{result.status.value} ({result.code.value})")

    def say(self, line: str) -> None:
        log.info("%s", visible(line))
        self._line(line)

    def close(self) -> None:
        pass

    def phases(self, start: int = 0) -> list[tuple[str, float]]:
        """The phases from the `start`th on: (name, seconds since the job started)."""
        with self._lock:
            return self._phases[start:]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": visible(self._phase), "lastLine": visible(self._last), "elapsedS": self._elapsed(),
                    "updates": self._updates}


@dataclass
class LiveJob:
    job_id: str
    request: RunAgentRequest
    progress: JobProgress = field(default_factory=JobProgress)
    finished: threading.Event = field(default_factory=threading.Event)
    result: RunAgentResult | None = None
    cancelled: str | None = None  # why, once the server cancels it
    thread: threading.Thread | None = None
    race: str | None = None  # the race it runs in: its winner alone may land on its own, not each job

    def cancel(self) -> str | None:
        return self.cancelled

    def live(self) -> dict[str, Any]:
        return {**self.progress.snapshot(), "running": not self.finished.is_set()}


class Jobs:
    """The jobs this server started, each in a thread of its own running the host's `run_agent`."""

    def __init__(self, config_file: str | None = None, max_jobs: int = DEFAULT_MAX_JOBS) -> None:
        self.config_file = config_file
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._jobs: dict[str, LiveJob] = {}
        self._closing: str | None = None

    def get(self, job_id: str) -> LiveJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def by_prefix(self, ident: str) -> LiveJob | None:
        with self._lock:
            found = [j for i, j in self._jobs.items() if ident and i.startswith(ident)]
        return found[0] if len(found) == 1 else None

    def config(self) -> Config:
        return load_config(self.config_file)

    def room(self, wanted: int) -> None:
        """Refuse (TOO_MANY_JOBS, SHUTTING_DOWN) unless `wanted` more jobs could start now."""
        with self._lock:
            self._room(wanted)

    def _room(self, wanted: int) -> None:
        if self._closing:
            raise Refusal(SHUTTING_DOWN, f"the server is shutting down ({self._closing}): no job starts")
        busy = sum(1 for j in self._jobs.values() if not j.finished.is_set())
        if busy + wanted > self.max_jobs:
            raise Refusal(TOO_MANY_JOBS, f"this server runs {busy} jobs already (its limit is {self.max_jobs})"
                          + (f", and {wanted} more were asked for at once" if wanted > 1 else "")
                          + "; wait for one with job_result")

    def start(self, request: RunAgentRequest, config: Config, admitted: Callable[[str], None],
              requester: Requester | None = None, *, job_id: str | None = None, booked: Prebooked | None = None,
              race: str | None = None) -> LiveJob:
        """Start a job unless the server is closing or full; `admitted(job_id)` runs first (the ledger row:
        when it raises, nothing starts). `job_id`, `booked`, `race`: a race's job, its id and booking made
        when the race was admitted."""
        job = LiveJob(job_id or new_job_id(), request, race=race)
        with self._lock:
            self._room(1)
            admitted(job.job_id)
            self._jobs[job.job_id] = job
        job.thread = threading.Thread(target=self._run, args=(job, config, requester, booked),
                                      name=f"job-{job.job_id}", daemon=True)
        job.thread.start()
        return job

    def start_race(self, requests: list[RunAgentRequest], config: Config, requester: Requester | None,
                   ids: tuple[str, ...], booked: tuple[Prebooked, ...], race: str) -> list[LiveJob]:
        """A race's jobs, all started or none (room for every one, under one hold of the lock)."""
        made = [LiveJob(job_id, request, race=race) for job_id, request in zip(ids, requests)]
        with self._lock:
            self._room(len(made))
            for job in made:
                self._jobs[job.job_id] = job
        for job, pre in zip(made, booked):
            job.thread = threading.Thread(target=self._run, args=(job, config, requester, pre),
                                          name=f"job-{job.job_id}", daemon=True)
            job.thread.start()
        return made

    def _run(self, job: LiveJob, config: Config, requester: Requester | None, booked: Prebooked | None) -> None:
        try:
            job.result = run_agent(job.request, config=config, progress=job.progress, cancel=job.cancel,
                                   job_id=job.job_id, requester=requester, booked=booked)
        except BaseException as exc:
            log.exception("job %s: the host raised", job.job_id)
            job.result = RunAgentResult(status=Status.failed, summary=f"the host failed: {exc}",
                                        known_risks=[f"the host failed: {type(exc).__name__}: {exc}"],
                                        agent=job.request.agent, code=JobCode.HOST_ERROR, job_id=job.job_id)
        finally:
            job.finished.set()

    def shutdown(self, reason: str, wait_s: float = SHUTDOWN_WAIT_S) -> list[str]:
        """Cancel every running job (the host kills its tree and writes its end row) and wait for them;
        idempotent. Returns the ids of the jobs it cancelled."""
        with self._lock:
            self._closing = self._closing or reason
            jobs = [j for j in self._jobs.values() if not j.finished.is_set()]
        for job in jobs:
            job.cancelled = job.cancelled or reason
        deadline = time.monotonic() + wait_s
        for job in jobs:
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
            if not job.finished.is_set():
                log.warning("job %s did not end within %.0f s of its cancel", job.job_id, wait_s)
        return [j.job_id for j in jobs]
