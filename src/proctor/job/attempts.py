"""Launching an agent for one job: at most two attempts under one deadline, and what the exits mean.

Owns the retry rule (once, on a nonzero exit, in the same worktree; never after a timeout, a rate limit, an
approval stall, a stop, a cancel or a host kill, nor for an adapter that declares `retry = false`) and
turning each `Exit` into a status, a code and risks.
It never reads the agent's claims for the verdict and never touches git: the host does both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from proctor.adapters.output import READERS, WATCHERS, Backend, Reading, Usage
from proctor.adapters.spec import AdapterSpec
from proctor.contract import Code, Status
from proctor.job.classify import Patterns, classify, misconfigured
from proctor.job.process import Exit, ProcessRunner, Spawn, Watch
from proctor.progress import Progress

MAX_ATTEMPTS = 2  # one retry on a nonzero exit, unless the adapter declares retry = false

BLOCKED_MARKERS = ("Read-only file system", "Permission denied", "Operation not permitted", "proctor-landlock:")


@dataclass
class Outcome:
    status: Status = Status.failed
    code: Code = Code.AGENT_FAILED
    attempts: int = 0
    exit_codes: list[int | None] = field(default_factory=list)
    risks: list[str] = field(default_factory=list)
    retry_after: str | None = None
    reading: Reading = field(default_factory=Reading)
    cleanup: str = "none"
    # An HTTP status the CLI's protocol reported for the run that decided the outcome (never read from prose).
    backend: Backend | None = None
    # What the CLI's protocol reported using, every attempt's added up: a retried run spent on both.
    usage: Usage | None = None
    launched: bool = False  # some attempt's process really started (the spend governor's booking stands)


def blocked_line(ex: Exit) -> str | None:
    """A line of the agent's output that shows its confinement refusing it something, if any."""
    text = (ex.stderr[-200_000:] + b"\n" + ex.stdout[-200_000:]).decode("utf-8", "replace")
    for line in text.splitlines():
        if any(m in line for m in BLOCKED_MARKERS):
            return line.strip()[:300]
    return None


def run_attempts(
    *,
    spec: AdapterSpec,
    argv: Sequence[str],
    stdin: bytes | None,
    env: Mapping[str, str],
    cwd: Path,
    runner: ProcessRunner,
    progress: Progress,
    poll: Callable[[], str | None],
    timeout_s: int,
    term_grace_s: float,
    name: str,
    confined: bool,
    watch: Watch | None = None,
) -> Outcome:
    """Run the agent; the deadline is the job's, shared by both attempts (a retry gets what is left)."""
    out = Outcome()
    patterns = Patterns.build(spec.rate_limit_patterns, spec.approval_patterns)
    deadline = time.monotonic() + timeout_s
    last: Exit | None = None
    tries = MAX_ATTEMPTS if spec.retry else 1
    for attempt in range(1, tries + 1):
        progress.phase(f"running {spec.name} (attempt {attempt})")
        watcher = _both(WATCHERS[spec.output]() if spec.output in WATCHERS else None, watch)
        last = runner.run(Spawn(
            argv=argv, cwd=cwd, env=env, deadline_s=max(0.0, deadline - time.monotonic()), stdin=stdin,
            watch=progress.watch(watcher), poll=poll, name=f"{name}-{attempt}", term_grace_s=term_grace_s,
        ))
        out.attempts = attempt
        out.exit_codes.append(last.exit_code)
        out.cleanup = last.cleanup
        # Read once per attempt: the summary and claim come from the last one, classification from each.
        out.reading = READERS[spec.output](last.stdout.decode("utf-8", "replace"),
                                           last.stderr.decode("utf-8", "replace"))
        out.usage = out.reading.usage.plus(out.usage) if out.reading.usage else out.usage
        out.launched = out.launched or (last.launched and not last.spawn_error)
        _note_side_effects(out, last, confined)
        if _decided(out, last, patterns, spec, timeout_s):
            break
        if attempt < tries and deadline - time.monotonic() > 1:
            out.risks.append(f"agent exited {last.exit_code}; retried once in the same worktree")
            continue
        out.status, out.code = Status.failed, Code.AGENT_FAILED
        if not spec.retry:
            out.risks.append(f"agent exited {last.exit_code}; not retried: adapter {spec.name!r} declares "
                             "retry = false")
        else:
            out.risks.append(f"agent exited {last.exit_code} on attempt {attempt} of {tries}"
                             + ("" if attempt == tries else "; no time left for a retry"))
        break
    if out.status is Status.rate_limited:
        out.retry_after = out.retry_after or out.reading.retry_after
    return out


def _note_side_effects(out: Outcome, ex: Exit, confined: bool) -> None:
    blocked = blocked_line(ex) if confined else None
    if blocked:
        out.risks.append(f"the agent tried something its confinement refused: {blocked!r}")
    if ex.leftovers_killed:
        out.risks.append(f"the agent left {ex.leftovers_killed} process(es) running after it exited; "
                         f"killed by {ex.cleanup}")
    if ex.stdout_dropped or ex.stderr_dropped:
        out.risks.append(f"agent output exceeded the tail: {ex.stdout_dropped} stdout and "
                         f"{ex.stderr_dropped} stderr bytes were not kept")


def _decided(out: Outcome, ex: Exit, patterns: Patterns, spec: AdapterSpec, timeout_s: int) -> bool:
    """Set the outcome from one exit; False only for an ordinary failure that may be retried."""
    agent = spec.name
    if ex.spawn_error:
        missing = ex.spawn_error.startswith(("FileNotFoundError", "PermissionError", "NotADirectoryError"))
        out.status, out.code = Status.failed, Code.AGENT_NOT_FOUND if missing else Code.HOST_ERROR
        out.risks.append(f"agent {agent!r} could not be started: {ex.spawn_error}")
        return True
    if ex.timed_out:
        out.status, out.code = Status.timed_out, Code.TIMED_OUT
        out.risks.append(f"agent killed at the {timeout_s}s deadline (whole tree, by {ex.cleanup}); "
                         "no retry after a timeout")
        return True
    # Any run the host ended is judged by why it was ended, whatever the exit code: a CLI that exits 0 on
    # SIGTERM must not turn a kill into `completed`.
    reason = ex.killed_reason or ""
    if reason.startswith(("cancelled", "stopped")):
        out.status = Status.failed
        out.code = Code.CANCELLED if reason.startswith("cancelled") else Code.STOPPED
        out.risks.append(f"job {reason}; " + ("the agent's process tree was killed" if ex.launched
                                              else "checked right before the launch: nothing was launched"))
        return True
    if reason.startswith("resource_limit"):
        out.status, out.code = Status.failed, Code.RESOURCE_LIMIT
        out.risks.append(f"agent killed at a resource limit (whole tree, by {ex.cleanup}): "
                         f"{reason.removeprefix('resource_limit: ')}; not retried")
        return True
    if reason.startswith("approval"):
        out.status, out.code = Status.approval_required, Code.APPROVAL_REQUIRED
        out.risks.append(f"the host ended the run: {reason}; not retried")
        return True
    if reason.startswith("bypass"):
        out.status, out.code = Status.failed, Code.BYPASS
        out.risks.append(f"the host ended the run: {reason} (its hooks were not loaded); not retried")
        return True
    if reason.startswith("rate_limit_event"):
        out.status, out.code = Status.rate_limited, Code.RATE_LIMITED
        out.backend = Backend(429, "rate_limit_event (status rejected)")
        out.risks.append(f"the CLI reported {reason}; the host ended the run (no retry)")
        return True
    if reason:
        out.status, out.code = Status.failed, Code.AGENT_FAILED
        out.risks.append(f"the host ended the run: {reason}")
        return True
    out.backend = out.reading.backend if ex.exit_code != 0 else None  # a retry that exited 0 answered
    if ex.exit_code == 0:
        out.status, out.code = Status.completed, Code.OK
        return True
    if out.backend is not None and out.backend.status == 429:
        out.status, out.code = Status.rate_limited, Code.RATE_LIMITED
        out.risks.append(f"agent exited {ex.exit_code} and the CLI reported HTTP 429 ({out.backend.source}): "
                         "rate_limited; not retried")
        return True
    # stderr and the CLI's own error events only, never the model's prose: a failed run on "implement the
    # rate limiter" must not read as rate limited (found in review). Text CLIs report all of stdout.
    text = ex.stderr.decode("utf-8", "replace") + "\n" + out.reading.error_text
    verdict = classify(ex.exit_code, text, patterns)
    if verdict.status is not None:
        out.status = verdict.status
        out.code = Code.RATE_LIMITED if verdict.status is Status.rate_limited else Code.APPROVAL_REQUIRED
        out.retry_after = verdict.retry_after
        out.risks.append(f"agent exited {ex.exit_code} and its output matched {verdict.matched!r}: "
                         f"{verdict.status.value}; not retried")
        return True
    said = misconfigured(ex.exit_code, text, spec.misconfigured_exit_codes)
    if said is None and out.backend is not None and out.backend.status in (401, 403):
        said = f"HTTP {out.backend.status} ({out.backend.source})"
    if said is not None:
        # The same login, key or auth type fails the same way again: never retried, the CLI's words shown.
        out.status, out.code = Status.failed, Code.AGENT_MISCONFIGURED
        own = out.reading.summary.strip()  # the CLI's own message, when its reader found one: shown too
        detail = said if not own or own in said else f"{said}: {own}"
        out.reading = replace(out.reading, summary=f"{spec.name} cannot run as configured: {detail}")
        out.risks.append(f"agent exited {ex.exit_code}: the CLI cannot run as configured ({said}); not retried")
        return True
    return False


def _both(first: Watch | None, second: Watch | None) -> Watch | None:
    """One watch for the runner: the output reader's and the gate's, either may end the run."""
    if first is None or second is None:
        return first or second

    def watch(stream: str, chunk: bytes) -> str | None:
        return first(stream, chunk) or second(stream, chunk)

    return watch
