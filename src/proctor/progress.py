"""Human progress on stderr: the phase, the elapsed time and the agent's last output line.

Owns the `Progress` seam and its rich implementation. It never writes to stdout (that is the result's)
and is quiet when stderr is not a terminal, so logs and pipes get only the JSON.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol

from proctor.job.process import Watch
from proctor.terminal import visible

if TYPE_CHECKING:
    from rich.text import Text

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
    """A live status line; the agent's output is shown, never parsed, here.

    Every piece of text shown passes through `terminal.visible` and is drawn as a rich `Text` (no markup,
    no emoji codes): no byte of the agent's reaches the terminal as a control sequence, so the spinner's
    redraws repeat nothing the agent chose. stdout and stderr are not redirected through the live display.
    """

    LAST_CHARS = 100  # of the agent's raw last line
    SHOWN_CHARS = 200  # of its escaped form

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.spinner import Spinner

        self.console = Console(stderr=True, markup=False, emoji=False, highlight=False)
        self._start = time.monotonic()
        self._phase = "starting"
        self._last = ""
        self._lock = threading.Lock()
        self._spinner = Spinner("dots", text=self._text())
        self._live = Live(self._spinner, console=self.console, refresh_per_second=12.5, transient=True,
                          redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def _text(self) -> Text:
        from rich.text import Text

        elapsed = time.monotonic() - self._start
        text = Text.assemble((visible(self._phase), "bold"), f" {elapsed:6.1f}s")
        if self._last:
            last = visible(self._last[-self.LAST_CHARS:])
            if len(last) > self.SHOWN_CHARS:
                last = "…" + last[-self.SHOWN_CHARS:]
            text.append("  " + last, style="dim")
        return text

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase = name
            self._spinner.update(text=self._text())

    def watch(self, inner: Watch | None) -> Watch:
        def w(stream: str, chunk: bytes) -> str | None:
            lines = [ln for ln in chunk.decode("utf-8", "replace").splitlines() if ln.strip()]
            if lines:
                with self._lock:
                    self._last = lines[-1]
                    self._spinner.update(text=self._text())
            return inner(stream, chunk) if inner else None

        return w

    def done(self, result: RunAgentResult) -> None:
        from rich.text import Text

        self._live.stop()
        self.console.print(Text.assemble(
            (visible(result.status.value), "bold"),
            f" ({visible(result.code.value)}) in {result.duration_seconds:.1f}s; worktree "
            f"{visible(result.worktree_path)}"))


def for_stderr() -> Progress:
    return RichProgress() if sys.stderr.isatty() else NullProgress()
