"""One spawn through a process runner: what it asks for (`Spawn`) and what it gave back (`Exit`).

Owns the request and result types of the `ProcessRunner` seam (proctor.mechanisms.process.local), and the two
callbacks a spawn may carry: `Watch` over its output, `Poll` for a reason to end it. It never launches anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from proctor.mechanisms.confine.limits import Limits

TAIL_BYTES = 1_000_000
TERM_GRACE_S = 2.0

# (stream name, chunk) -> a reason to end the run now, or None. Called from the drain threads.
Watch = Callable[[str, bytes], str | None]
# () -> a reason to end the run now (stop switch, cancel, lease lost), or None. Polled by the wait loop.
Poll = Callable[[], str | None]


@dataclass(frozen=True)
class Spawn:
    argv: Sequence[str]
    cwd: Path
    env: Mapping[str, str]
    deadline_s: float
    stdin: bytes | None = None  # None: /dev/null. Several agent CLIs hang forever on an open stdin pipe.
    tail_bytes: int = TAIL_BYTES
    watch: Watch | None = None
    poll: Poll | None = None
    name: str = "job"  # unique per run: names the cgroup
    term_grace_s: float = TERM_GRACE_S
    limits: Limits | None = None  # None: the runner's
    disk_roots: tuple[Path, ...] | None = None  # None: cwd and env's TMPDIR


@dataclass(frozen=True)
class Exit:
    exit_code: int | None  # None: never started (see spawn_error)
    timed_out: bool = False
    killed_reason: str | None = None  # poll/watch reason that ended the run
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    duration_s: float = 0.0
    cleanup: str = "none"  # "cgroup" | "subreaper"
    leftovers_killed: int = 0  # processes still alive after the main one exited
    spawn_error: str | None = None
    pid: int | None = None
    limits: tuple[str, ...] = ()  # what was enforced, e.g. "memory 8 GiB (+0 B swap) (cgroup v1)"
    limit_gaps: tuple[str, ...] = ()  # limits asked for and not enforced, with why
    launched: bool = True  # False: poll said stop/cancel at the last check before the spawn

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None
