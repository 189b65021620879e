"""A CLI's output stream as the gate service reads it: cut into whole lines of any length up to a limit,
failing closed past it. It never decides what a line means (each dialect's `tool_uses` does); `json_events` reads the JSON of the
lines that hold a mark.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# The longest line of a CLI's output stream read whole (held in the host while it comes). A CLI's own
# lines are far shorter (its tool results are cut well below this); a longer one fails closed (BYPASS):
# keeping only its last 1,000,000 bytes let a tool call on such a line escape reconciliation (issue 22).
MAX_STREAM_LINE = 32 * 1024 * 1024


class StreamLines:
    """A byte stream cut into whole lines of any length up to `limit`. Past the limit `over` is set for good
    and the line's bytes are dropped (never held): the caller fails closed."""

    def __init__(self, limit: int = MAX_STREAM_LINE) -> None:
        self.limit = limit
        self.over = False
        self._parts: list[bytes] = []  # the line in progress, joined once whole (no quadratic copying)
        self._held = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        pieces = chunk.split(b"\n")
        tail = pieces.pop()
        lines = []
        if pieces:
            first = pieces[0]
            if not self._keep(first):
                lines.append(b"".join(self._parts))
            self._parts, self._held = [], 0
            lines.extend(pieces[1:])
        self._keep(tail)
        if any(len(ln) > self.limit for ln in lines):
            self.over = True
        return [ln for ln in lines if len(ln) <= self.limit]

    def _keep(self, piece: bytes) -> bool:
        """Adds to the line in progress; True when that line is now over the limit (and so dropped)."""
        if self._held + len(piece) > self.limit:
            self.over = True
            self._parts, self._held = [], self.limit + 1  # dropped, and stays over until its newline
            return True
        if piece:
            self._parts.append(piece)
            self._held += len(piece)
        return False

    def rest(self) -> bytes:
        """The last line, when the stream ended without a newline (emptied)."""
        text = b"".join(self._parts) if self._held <= self.limit else b""
        self._parts, self._held = [], 0
        return text


def json_events(text: str, mark: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of the lines holding `mark`. Split on newlines only: str.splitlines also splits on
    U+2028, which a CLI's JSON carries raw (Node's JSON.stringify), so a tool call holding one was never
    read (issue 22)."""
    for line in text.split("\n"):
        if mark not in line:
            continue
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(ev, dict):
            yield ev
