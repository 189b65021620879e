"""How many jobs one principal may put on the queue through the HTTP API in a window: a signer's share.

Owns the sliding count per principal (a trusted signer's key id) and the answer past it: how long until a
slot frees. The queue's own quota (the stream's bytes, a lane's waiting jobs: mechanisms.queue.jetstream)
bounds every sender together; this bounds one, so one busy or stolen key cannot take the rest's room
(issue 41). In memory, per server process: it never decides whether a job is allowed, only how fast.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0
PRINCIPALS_KEPT = 4096  # principals tracked at once; the least recent are forgotten past it


class Quota:
    def __init__(self, per_window: int, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_window, self.window_s, self._clock = per_window, window_s, clock
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def take(self, principal: str) -> float | None:
        """Count one job of `principal`; None when it is within its share, else the seconds until it is."""
        now = self._clock()
        with self._lock:
            times = self._seen.pop(principal, None) or deque()
            while times and now - times[0] >= self.window_s:
                times.popleft()
            self._seen[principal] = times  # most recent last: the dict's order is the eviction order
            if len(times) >= self.per_window:
                return max(0.0, self.window_s - (now - times[0]))
            times.append(now)
            while len(self._seen) > PRINCIPALS_KEPT:
                self._seen.pop(next(iter(self._seen)))
        return None
