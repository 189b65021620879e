"""A job's host-side record: the files proctor keeps of each run_agent job under $PROCTOR_HOME/jobs/<jobId>/.

Owns the job's id, its bookend rows in the ledger (`job.start` before anything happens, `job.end` with
the verdict, so a crash in between shows as an interrupted job, never as nothing), the result of a job
refused before it launched, and four files and reading them back:

    host.json      written as the job starts: the host's pid, that process's start time and the boot id,
                   so a later reader tells a job that is still running from one whose host died
    result.json    written as the job ends: the result JSON exactly as `run-agent` printed it
    request.json   beside it: the request it answered (the validation command `land` runs again)
    progress.json  rewritten while the job runs (`LiveProgress`): its phases and the last output line, so
                   a reader in another process (the review page) shows a running job's progress
(and validation.log beside them: the validation output in full, as the runner kept it).

They live under $PROCTOR_HOME, which no confined agent can read (docs "Confinement"); the ledger, not
these files, is the authority on a job's commit (`job.tree`), so a reader checks one against the other.
Writing never raises into the job path: a file that cannot be written costs `show` and `land` their
detail (land then refuses), never the job. It never decides anything.
"""

from __future__ import annotations

import json
import os
import re
import stat
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proctor.contract import Code, RunAgentRequest, RunAgentResult, Status
from proctor.home import proctor_home
from proctor.mechanisms import atomic
from proctor.mechanisms.confine import beneath
from proctor.mechanisms.ledger.store import Ledger, LedgerError, LedgerFull, LedgerTampered
from proctor.mechanisms.process.spawn import Watch
from proctor.mechanisms.terminal import visible
from proctor.services.job.progress import NullProgress, Progress

JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_RECORD_BYTES = 64 * 1024 * 1024  # a result holds output tails (64 KB a command): far below this


def unsafe_home(home: Path | None = None) -> str | None:
    """Why the state dir may not hold job state (None: it may): made (mode 0700) when missing, it must be
    this user's, writable by nobody else, under parents no other user can swap it in. Its keys, ledger and
    job records are what a job must never reach (issue 21: a job copied the listener's key out of it)."""
    home = home or proctor_home()
    try:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        return f"cannot make {home}: {exc.strerror}"
    return beneath.unsafe_dir(home) or beneath.unsafe_parent(home.parent)


def safe_job_id(job_id: object) -> bool:
    """A job id fit to be a path component (ids come from ledger rows, which a queue's signer shaped)."""
    return isinstance(job_id, str) and bool(JOB_ID_RE.fullmatch(job_id)) and ".." not in job_id


def job_dir(job_id: str) -> Path:
    if not safe_job_id(job_id):
        raise ValueError(f"job id {job_id!r} is not [A-Za-z0-9._-]+")
    return proctor_home() / "jobs" / job_id


def unsafe_dirs(job_id: str) -> str | None:
    """Why the job's record dir `$PROCTOR_HOME/jobs/<jobId>` may not be used (None: it may): it, `jobs/` and
    the state dir are made (mkdir, mode 0700) when missing, and each must be this user's and writable by
    nobody else. Nothing is written into one that fails."""
    try:
        d = job_dir(job_id)
    except ValueError as exc:
        return str(exc)
    why = unsafe_home(d.parent.parent) or beneath.private_dir(d.parent) or beneath.private_dir(d)
    return f"unsafe directory: {why}" if why else None


def _write(job_id: str, name: str, text: str, *, checked: bool = False) -> str | None:
    """`name` in the job's record dir, replaced atomically; never into a dir that fails unsafe_dirs
    (`checked`: the caller saw it pass, and a private dir of this user's stays one)."""
    unsafe = None if checked else unsafe_dirs(job_id)
    if unsafe:
        return f"{name} not written: {unsafe}"
    path = job_dir(job_id) / name
    try:
        atomic.write(path, text.encode("utf-8"))
    except OSError as exc:
        return f"cannot write {path}: {exc}"
    return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot): a reused pid has another."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return int(raw[raw.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def started(job_id: str) -> str | None:
    """Called by the host right after the job's `job.start` row; None, or why host.json was not written."""
    pid = os.getpid()
    host = {"pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _boot_id()}
    return _write(job_id, "host.json", json.dumps(host))


def ended(request: Any, result: Any) -> str | None:
    """Called by the host after the job's `job.end` row: the result JSON and the request, as files."""
    req = request.model_dump(mode="json", by_alias=True) if hasattr(request, "model_dump") else dict(request)
    return (_write(result.job_id, "request.json", json.dumps(req, indent=2))
            or _write(result.job_id, "result.json", result.to_json()))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            data = fh.read(MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_RECORD_BYTES:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class Record:
    """What the host kept of one job; a missing or unreadable file is None."""

    result: dict[str, Any] | None
    request: dict[str, Any] | None
    host: dict[str, Any] | None
    progress: dict[str, Any] | None = None

    def host_alive(self) -> bool | None:
        """True while the process that ran the job lives; False once it died (or the machine rebooted);
        None when host.json was never written (a job from before it, or a write that failed)."""
        h = self.host
        if not h or not isinstance(h.get("pid"), int):
            return None
        boot = _boot_id()
        if h.get("boot_id") and boot and h["boot_id"] != boot:
            return False
        ticks = _start_ticks(h["pid"])
        if ticks is None:
            return False
        return h.get("start_ticks") in (None, ticks)


def load(job_id: str) -> Record:
    try:
        d = job_dir(job_id)
    except ValueError:
        return Record(None, None, None)
    return Record(_read_json(d / "result.json"), _read_json(d / "request.json"), _read_json(d / "host.json"),
                  _read_json(d / "progress.json"))


class LiveProgress:
    """The host's `Progress` for one job, passed through to `inner` and kept in progress.json.

    A phase is written as it starts unless the file was written less than `PHASE_EVERY_S` ago; then it is
    written when that time is up (a short job's eight phases cost two writes, not eight, on the job's own
    path: issue 25). The last output line at most every `LINE_EVERY_S` (an agent that prints a line a
    millisecond costs one small write a second, not a thousand). Nothing is dropped: a deferred write
    carries every phase so far, and `done` writes at once. Text is escaped (`terminal.visible`) and cut to
    `LINE_CHARS` before it is stored: the agent shaped it.

    "Never written" is None, not a time: `clock` (monotonic by default) counts from an origin nobody
    chose (boot on Linux, less inside a time namespace), so a first write held against 0.0 was deferred on
    a machine up less than `PHASE_EVERY_S` (issue 37: the suite failed on a machine up 56 minutes).
    """

    PHASE_EVERY_S = 0.25
    LINE_EVERY_S = 1.0
    LINE_CHARS = 300
    MAX_PHASES = 200

    def __init__(self, job_id: str, inner: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.job_id, self.inner, self._clock = job_id, inner, clock
        self._start = clock()
        self._lock = threading.Lock()
        self._phases: list[dict[str, Any]] = []
        self._last = ""
        self._written: float | None = None
        self._ended: str | None = None
        self._timer: threading.Timer | None = None
        self._due = 0.0  # when the pending timer writes
        self._writable = safe_job_id(job_id)
        self._checked: bool | None = None

    def _elapsed(self) -> float:
        return round(self._clock() - self._start, 1)

    def _write(self) -> None:
        """Under the lock: the whole state as one file, replaced atomically (a reader sees old or new)."""
        if not self._writable:
            return
        if self._checked is None:  # once: every phase and line rewrites the file, and the dir stays private
            self._checked = unsafe_dirs(self.job_id) is None
        self._written = self._clock()
        _write(self.job_id, "progress.json", checked=self._checked, text=json.dumps({
            "phase": self._phases[-1]["name"] if self._phases else "starting", "phases": self._phases,
            "lastLine": self._last, "elapsedS": self._elapsed(), "ended": self._ended,
            "updated": time.time()}))

    def phase(self, name: str) -> None:
        with self._lock:
            if len(self._phases) < self.MAX_PHASES:
                self._phases.append({"name": visible(name)[:self.LINE_CHARS], "at": self._elapsed()})
            self._last = ""
            self._write_within(self.PHASE_EVERY_S)
        self.inner.phase(name)

    def watch(self, inner: Watch | None) -> Watch | None:
        outer = self.inner.watch(inner)

        def w(stream: str, chunk: bytes) -> str | None:
            lines = [ln for ln in chunk[-4096:].decode("utf-8", "replace").splitlines() if ln.strip()]
            if lines:
                with self._lock:
                    self._last = visible(lines[-1][-self.LINE_CHARS:])[-self.LINE_CHARS:]
                    self._write_within(self.LINE_EVERY_S)
            return outer(stream, chunk) if outer else None

        return w

    def _write_within(self, every: float) -> None:
        """Under the lock: write now when the last write is `every` old, else once it is. What arrives too
        soon is written when its time is up, not lost because nothing more came."""
        now = self._clock()
        wait = 0.0 if self._written is None else every - (now - self._written)
        if wait <= 0:
            self._write()
        elif self._timer is None or self._due > now + wait:  # a phase does not wait out a line's second
            if self._timer is not None:
                self._timer.cancel()
            self._due = now + wait
            self._timer = threading.Timer(wait, self._flush)
            self._timer.daemon = True
            self._timer.start()

    def _flush(self) -> None:
        with self._lock:
            if threading.current_thread() is self._timer:  # not one cancelled as it fired
                self._timer = None
            if self._ended is None:
                self._write()

    def done(self, result: Any) -> None:
        with self._lock:
            self._ended = f"{result.status.value} ({result.code.value})"
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._write()
        self.inner.done(result)


def recorded(request: Any, ledger: Ledger, job_id: str, start: float, progress: Progress | None,
             body: Callable[[Progress], Any]) -> Any:
    """The job between its `job.start` and `job.end` rows, `body` run with the job's progress kept in
    progress.json. A row that cannot be written ends the job with a result all the same (DISK_FULL when
    the disk is full): the ledger keeps what it had, never half a row. The end row may use the ledger's
    reserve, so a disk that filled up during the job still records it."""
    space = ledger.space_problem()
    if space:
        return refused(request, [f"{space}; nothing was launched"], Code.DISK_FULL, start)
    try:
        ledger.append("job.start", {"jobId": job_id, "agent": request.agent, "ticket": request.ticket,
                                    "repo": request.repo, "mode": request.mode, "branch": request.branch,
                                    **({"continues": request.continues} if getattr(request, "continues", None) else {})},
                      job_id=job_id)
    except LedgerError as exc:
        return refused(request, [f"the job's start could not be recorded ({exc}); nothing was launched"],
                       ledger_code(exc), start)
    started(job_id)  # host.json: who runs the job, so review tells running from abandoned
    live = LiveProgress(job_id, progress or NullProgress())  # progress.json: the review page's
    try:
        result = body(live)
    except LedgerError as exc:
        result = refused(request, [f"a ledger row could not be written, so the job was ended: {exc}"],
                         ledger_code(exc), start)
    result.job_id = job_id
    try:
        ledger.append("job.end", {"jobId": job_id, "status": result.status.value, "code": result.code.value,
                                  "needs_human_review": result.needs_human_review,
                                  "worktreePath": result.worktree_path}, job_id=job_id, reserve=True)
    except LedgerError as exc:
        result.status, result.code, result.needs_human_review = Status.failed, ledger_code(exc), True
        result.known_risks = [*result.known_risks, f"the job's end could not be recorded: {exc}"]
    ended(request, result)  # result.json + request.json, for `proctor show` and `proctor land`
    return result


def ledger_code(exc: LedgerError) -> Code:
    if isinstance(exc, LedgerTampered):
        return Code.LEDGER_TAMPERED
    return Code.DISK_FULL if isinstance(exc, LedgerFull) else Code.HOST_ERROR


def validation_log(job_id: str) -> Path:
    """Where a job's validation output is kept in full (what the runner kept: 1 MB a stream), host-owned:
    under $PROCTOR_HOME, which no agent can read or write."""
    return proctor_home() / "jobs" / job_id / "validation.log"


def new_job_id() -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def refused(request_like: dict | RunAgentRequest | None, risks: list[str], code: Code, start: float) -> RunAgentResult:
    """A `failed` result for a job that never launched: the risks name why."""
    if isinstance(request_like, RunAgentRequest):
        agent, mode = request_like.agent, request_like.mode
    else:
        agent = str((request_like or {}).get("agent") or "")
        mode = (request_like or {}).get("mode")
    return RunAgentResult(
        status=Status.failed,
        summary=risks[0] if risks else "refused",
        known_risks=risks,
        needs_human_review=True,
        agent=agent,
        duration_seconds=round(time.monotonic() - start, 3),
        mode=mode if isinstance(mode, str) else None,
        code=code,
    )
