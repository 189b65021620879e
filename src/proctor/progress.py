"""Human progress on stderr: the phase, the elapsed time and the agent's last output line.

Owns the `Progress` seam and its rich implementation. It never writes to stdout (that is the result's)
and is quiet when stderr is not a terminal, so logs and pipes get only the JSON.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol

from proctor.process import Watch

if TYPE_CHECKING:
    from proctor.contract import RunAgentResult


class Progress(Protocol):
    def phase(self, name: str) -> None: ...
    def watch(self, inner: Watch | None) -> Watch | None: ...
    def done(self, result: RunAgentResult) -> None: ...


class NullProgress:
    def phase(self, name: str) -> None:
        pass

    def watch(self, inner: Watch | None) -> Watch | None:
        return inner

    def done(self, result: RunAgentResult) -> None:
        pass


class RichProgress:
    """A live status line; the agent's output is shown, never parsed, here."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self._start = time.monotonic()
        self._phase = "starting"
        self._last = ""
        self._lock = threading.Lock()
        self._status = self.console.status(self._text())
        self._status.start()

    def _text(self) -> str:
        from rich.markup import escape

        elapsed = time.monotonic() - self._start
        last = f"  [dim]{escape(self._last[-100:])}[/dim]" if self._last else ""
        return f"[bold]{escape(self._phase)}[/bold] {elapsed:6.1f}s{last}"

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase = name
            self._status.update(self._text())

    def watch(self, inner: Watch | None) -> Watch:
        def w(stream: str, chunk: bytes) -> str | None:
            lines = [ln for ln in chunk.decode("utf-8", "replace").splitlines() if ln.strip()]
            if lines:
                with self._lock:
                    self._last = lines[-1]
                    self._status.update(self._text())
            return inner(stream, chunk) if inner else None

        return w

    def done(self, result: RunAgentResult) -> None:
        self._status.stop()
        self.console.print(f"[bold]{result.status.value}[/bold] ({result.code.value}) in "
                           f"{result.duration_seconds:.1f}s; worktree {result.worktree_path}")


def for_stderr() -> Progress:
    return RichProgress() if sys.stderr.isatty() else NullProgress()
