"""Frequent rows kept to one a principal a minute: what a read-heavy client costs the ledger is bounded.

Owns the window: the first row of a (kind, principal, subject) in a window is written at once, as it comes;
the rest of that window are counted, and their count is one summary row (`summarised: n`) written when the
next such row comes after the window, or at `flush` (the server ending). Measured before (issue 41): 1,000
MCP `list_jobs` calls wrote 1,000 rows. It never drops the fact that a read happened, only its repetition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proctor.mechanisms.ledger.store import Ledger

WINDOW_S = 60.0
KEYS_KEPT = 1024  # windows held at once; past it the oldest is summarised early


@dataclass
class _Window:
    start: float
    kind: str
    payload: dict[str, Any]
    job_id: str | None
    more: int = 0  # rows of the window after its first, not written


@dataclass
class Summary:
    """`note(ledger, kind, payload, principal=, subject=)` in place of `ledger.append` for frequent rows."""

    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _windows: dict[tuple[str, str, str], _Window] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, ledger: Ledger, kind: str, payload: dict[str, Any], *, principal: str, subject: str = "",
             job_id: str | None = None) -> str | None:
        """The row, or only its count when one like it was written within the window; None, or why a row
        could not be written (the caller's answer stands)."""
        key = (kind, principal, subject)
        now = self.clock()
        with self._lock:
            w = self._windows.get(key)
            if w is not None and now - w.start < self.window_s:
                w.more += 1
                return None
            due = [self._windows.pop(key)] if w is not None else []
            if len(self._windows) >= KEYS_KEPT:
                due.append(self._windows.pop(min(self._windows, key=lambda k: self._windows[k].start)))
            self._windows[key] = _Window(now, kind, payload, job_id)
        try:
            for old in due:
                self._summarise(ledger, old)
            ledger.append(kind, payload, job_id=job_id)
        except Exception as exc:  # noqa: BLE001 - a ledger that refuses a row costs the row, not the answer
            return f"the {kind} row could not be written: {exc}"
        return None

    def flush(self, ledger: Ledger) -> None:
        """Every window's count written now (the server is ending)."""
        with self._lock:
            due = list(self._windows.values())
            self._windows.clear()
        for w in due:
            self._summarise(ledger, w)

    def _summarise(self, ledger: Ledger, w: _Window) -> None:
        if w.more:
            ledger.append(w.kind, {**w.payload, "summarised": w.more, "window_s": self.window_s}, job_id=w.job_id)
