"""Launching an agent for one job: at most two attempts under one deadline, and what the exits mean.

Owns the retry rule (once, on a nonzero exit, in the same worktree; never after a timeout, a rate limit, an
approval stall, a stop, a cancel or a host kill, nor for an adapter that declares `retry = false`) and
turning each `Exit` into a status, a code and risks. A program that is not there is AGENT_NOT_FOUND before
any launch, never retried (issue 24: confined, it read as "the agent tried something its confinement
refused: exec codex: No such file" and ran twice).
It never reads the agent's claims for the verdict and never touches git: the host does both.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from proctor.mechanisms.adapters.output import READERS, WATCHERS, Backend, Reading, Usage
from proctor.mechanisms.adapters.spec import AdapterSpec
from proctor.mechanisms.confine.bwrap import tmpfs_dirs
from proctor.contract import Code, Status
from proctor.services.job.classify import Patterns, classify, misconfigured
from proctor.mechanisms.process.local import ProcessRunner
from proctor.mechanisms.process.spawn import Exit, Spawn, Watch
from proctor.services.job.progress import Progress

MAX_ATTEMPTS = 2  # one retry on a nonzero exit, unless the adapter declares retry = false

BLOCKED_MARKERS = ("Read-only file system", "Permission denied", "Operation not permitted", "proctor-landlock:")
# The Landlock helper's own words when its exec of the agent failed (confine/landlock_exec.c, exit 127), and
# bubblewrap's: the program is not there, which is no refusal of the confinement's.
_EXEC_MISSING = re.compile(r"^(?:proctor-landlock: exec|bwrap: execvp) (.+?): (?:No such file or directory|"
                           r"Not a directory)$", re.MULTILINE)
EXIT_NOT_FOUND = 127  # a shell's "command not found", and the Landlock helper's failed exec
_ABS_PATH = re.compile(r"(?<![\w.~-])(/[\w.+@%-]+(?:/[\w.+@%-]+)*)")


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
    """A line of the agent's output that shows its confinement refusing it something, if any (a failed
    exec of a missing program is not one: see `exec_missing`)."""
    text = (ex.stderr[-200_000:] + b"\n" + ex.stdout[-200_000:]).decode("utf-8", "replace")
    for line in text.splitlines():
        if any(m in line for m in BLOCKED_MARKERS) and not _EXEC_MISSING.match(line.strip()):
            return line.strip()[:300]
    return None


def missing_program(program: str, path: str | None, cwd: Path) -> str | None:
    """Why the agent's program cannot be started, seen before anything launches: a name on no directory
    of the PATH the agent gets, or a path that is no executable file. None: it can be started."""
    if os.sep in program:
        where = Path(program) if os.path.isabs(program) else cwd / program
        if where.is_file() and os.access(where, os.X_OK):
            return None
        return (f"agent program {program!r} is not an executable file" if where.exists() else
                f"agent program {program!r} does not exist")
    if shutil.which(program, path=path) is not None:
        return None
    dirs = [d for d in (path or "").split(os.pathsep) if d]
    shown = os.pathsep.join(dirs[:8]) + (f"{os.pathsep}... ({len(dirs)} dirs)" if len(dirs) > 8 else "")
    return f"agent program {program!r} was not found on the PATH the agent gets ({shown or 'empty'})"


def exec_missing(ex: Exit) -> str | None:
    """The program the confinement's exec could not find, from the wrapper's own last words."""
    if ex.exit_code not in (1, EXIT_NOT_FOUND):
        return None
    m = _EXEC_MISSING.search(ex.stderr[-4096:].decode("utf-8", "replace"))
    return m.group(1) if m else None


FILE_ERRORS = re.compile(r"no such file|cannot stat|cannot access|can't open|cannot open|not found|"
                         r"does not exist|enoent", re.IGNORECASE)


def tmpfs_hint(exit_code: int | None, output: str, path: str | None) -> str | None:
    """Why a failing exit under bubblewrap may be the sandbox's doing: a path the output names beside a file
    error ("cannot stat", "No such file", ...), or for an exit 127 a PATH directory, under a dir the sandbox
    replaces with a private, empty tmpfs (/tmp, /var/tmp, /run). Found in issue 24 (a tool under /tmp `not
    found`) and issue 43 (a script's `cp /tmp/x .` failing with "cannot stat" and no hint)."""
    if not exit_code:
        return None
    roots = [Path(d) for d in tmpfs_dirs()]

    def under(p: str) -> Path | None:
        return next((r for r in roots if r in Path(p).parents), None)

    tail = output[-8192:]
    named = [p for p in _ABS_PATH.findall(tail) if under(p)] if FILE_ERRORS.search(tail) else []
    on_path = ([d for d in (path or "").split(os.pathsep) if d.startswith("/") and under(d)]
               if exit_code == EXIT_NOT_FOUND else [])
    hit = (named or on_path or [None])[0]
    if hit is None:
        return None
    root = under(hit)
    what = "it names" if named else "on its PATH"
    return (f"exit {exit_code}: {hit} ({what}) is under {root}, which the sandbox replaces with a private, "
            f"empty tmpfs: nothing the host put there is visible to the job; keep the file or tool outside {root}")


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
    missing = missing_program(spec.command[0], env.get("PATH"), cwd)
    if missing is not None:
        # Before the first spawn: a retry, or a sandbox, cannot make a program appear.
        out.code = Code.AGENT_NOT_FOUND
        out.risks.append(f"{missing}; nothing was launched (not retried)")
        out.reading = Reading(summary=f"{spec.name}: {missing}")
        return out
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
        _note_side_effects(out, last, confined, env.get("PATH"), bwrapped=bool(argv) and Path(argv[0]).name == "bwrap")
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


def _note_side_effects(out: Outcome, ex: Exit, confined: bool, path: str | None = None,
                       bwrapped: bool = False) -> None:
    blocked = blocked_line(ex) if confined else None
    if blocked:
        out.risks.append(f"the agent tried something its confinement refused: {blocked!r}")
    hint = tmpfs_hint(ex.exit_code, ex.stderr.decode("utf-8", "replace"), path) if bwrapped else None
    if hint:
        out.risks.append(hint)
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
        out.reading = replace(out.reading, summary=out.reading.summary or f"{agent} could not be started")
        return True
    gone = exec_missing(ex) if not ex.killed_reason and not ex.timed_out else None
    if gone is not None:
        # Seen on the host's PATH, yet not inside the sandbox (a dir it hides): the same next time.
        out.status, out.code = Status.failed, Code.AGENT_NOT_FOUND
        out.risks.append(f"agent program {gone!r} was not found inside the sandbox (exit {ex.exit_code}); "
                         "not retried")
        out.reading = replace(out.reading, summary=f"{agent}: program {gone!r} not found inside the sandbox")
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
