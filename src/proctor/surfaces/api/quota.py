"""How many jobs one principal may put on the queue through the HTTP API in a window: a signer's share.

Owns the window a count falls in and the answer past it: how long until the next. The queue's own quota (the
stream's bytes, a lane's waiting jobs: mechanisms.queue.jetstream) bounds every sender together; this bounds
one, so one busy or stolen key cannot take the rest's room (issue 41). The count lives in the queue engine
(`QueueBackend.take_slot`), so every API server of a fleet draws on the same share, not one each. Windows
are fixed minutes of the wall clock, the one clock the servers share: at a window's edge a signer may send
up to twice its share in a short while, never more. It never decides whether a job is allowed, only how fast.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from proctor.mechanisms.queue.backend import QueueBackend

WINDOW_S = 60.0


class Quota:
    def __init__(self, per_window: int, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.per_window, self.window_s, self._clock = per_window, window_s, clock

    async def take(self, principal: str, queue: QueueBackend) -> float | None:
        """Count one job of `principal`; None when it is within its share, else the seconds until it is.
        Raises what the engine raises when the count cannot be taken (the caller refuses: uncounted is
        not granted)."""
        now = self._clock()
        window = int(now // self.window_s)
        # A key names the principal by digest: signer names are the trust store's, not the engine's syntax.
        key = f"signer.{hashlib.sha256(principal.encode()).hexdigest()[:32]}.{window}"
        if await queue.take_slot(key, self.per_window):
            return None
        return (window + 1) * self.window_s - now
