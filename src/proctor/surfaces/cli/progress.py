"""Human progress on stderr: the phase, the elapsed time and the last output line of what runs in it.

Owns the rich implementation of the job's `Progress` seam. It never writes to stdout (that is the
result's) and is quiet when stderr is not a terminal, so logs and pipes get only the JSON.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING

from proctor.mechanisms.process.spawn import Watch
from proctor.mechanisms.terminal import visible
from proctor.services.job.progress import NullProgress

if TYPE_CHECKING:
    from rich.spinner import Spinner
    from rich.text import Text

    from proctor.contract import RunAgentResult


class RichProgress:
    """A live status line; the agent's output is shown, never parsed, here.

    Every piece of text shown passes through `terminal.visible` and is drawn as a rich `Text` (no markup,
    no emoji codes): no byte of the agent's reaches the terminal as a control sequence, so the spinner's
    redraws repeat nothing the agent chose. stdout and stderr are not redirected through the live display.

    The line is rebuilt on every refresh (12.5 per second), not on every update: the elapsed time kept
    showing 0.1 s for the 9 s an agent printed nothing while the line was a `Text` made once per update.
    A new phase starts with no output line: the agent's last line is not validation's.
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
        self._spinner = Spinner("dots")
        self._live = Live(console=self.console, refresh_per_second=12.5, transient=True, redirect_stdout=False,
                          redirect_stderr=False, get_renderable=self._render)
        self._closed = False
        self._live.start()

    def _render(self) -> Spinner:
        # Called by the live display's refresh thread: the text is read under the lock, the clock anew.
        with self._lock:
            self._spinner.update(text=self._text())
        return self._spinner

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
            self._phase, self._last = name, ""

    def watch(self, inner: Watch | None) -> Watch:
        """A watch that shows the last non-blank line of whatever runs in the current phase."""

        def w(stream: str, chunk: bytes) -> str | None:
            lines = [ln for ln in chunk.decode("utf-8", "replace").splitlines() if ln.strip()]
            if lines:
                with self._lock:
                    self._last = lines[-1]
            return inner(stream, chunk) if inner else None

        return w

    def say(self, line: str) -> None:
        """One line of the host's own on stderr (above the live line while it runs), escaped."""
        from rich.text import Text

        self.console.print(Text(visible(line)), soft_wrap=True)

    def close(self) -> None:
        """Take the live line off the screen; idempotent (a refused job never reaches `done`)."""
        if not self._closed:
            self._closed = True
            self._live.stop()

    def done(self, result: RunAgentResult) -> None:
        """The live line goes; the job's closing lines are the CLI's (surfaces.cli.closing), after any
        landing the repo's policy made."""
        self.close()


def for_stderr() -> RichProgress | NullProgress:
    return RichProgress() if sys.stderr.isatty() else NullProgress()
