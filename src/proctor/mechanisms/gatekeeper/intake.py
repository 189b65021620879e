"""The gate socket's intake: what its callers can make the host hold (connections at once, the bytes of their
open requests, the time a request may take), the server that turns a caller past a bound away unread, and
the answer as the hook client reads it. It never decides a call (GateService.handle does).
"""

from __future__ import annotations

import json
import socketserver
import threading
import time
from typing import Any

from proctor.mechanisms.gatekeeper.dialect import Answer

# The largest request: the hook client's 4 MiB of hook input, escaped again as a JSON string (quotes and
# backslashes doubled), with room to spare. 8 MiB before; lowered so that the whole budget below, with the
# allocator's overhead, stays under 10 MiB (8 MiB measured +10.5 MiB under the flood, tests/test_gate_flood.py).
MAX_REQUEST = 5 * 1024 * 1024
# The socket's bounds: every byte and thread behind it is the host's, outside the job's cgroup. Unbounded,
# 64 connections sending 8 MiB each and never closing grew the host to ~790 MiB (issue 21, item 6). A CLI's
# hook asks one call at a time (a few at once for parallel tool calls), each connection lives milliseconds,
# and the client sends its whole request at once then half-closes: more than these is a flood.
MAX_CONNECTIONS = 8
REQUEST_DEADLINE_S = 5.0  # from accept to the request's end (a slow-loris sender is cut off); answers are small
CHUNK = 64 * 1024
MAX_BUFFERED = MAX_REQUEST + CHUNK  # all open requests' bytes together: the largest request, alone, fits

# Why a connection was turned away, as the hook client (and so the model) hears it and the result counts it.
TURNED_AWAY = {
    "connections": f"more than {MAX_CONNECTIONS} connections to the gate at once",
    "size": f"a request over {MAX_REQUEST // (1024 * 1024)} MiB, or over what the gate buffers for all "
            f"open requests ({MAX_BUFFERED // (1024 * 1024)} MiB)",
    "slow": f"a request not sent whole within {REQUEST_DEADLINE_S:g}s",
}


class Intake:
    """What the gate socket's callers can make the host hold: connections at once, the bytes of their open
    requests together, the time one request may take. A caller past a bound gets a denied call and is
    counted in `turned_away`; nothing past the bound is read or kept."""

    def __init__(self, counts: dict[str, int], connections: int = MAX_CONNECTIONS,
                 buffered: int = MAX_BUFFERED) -> None:
        self._slots = threading.BoundedSemaphore(connections)
        self._lock = threading.Lock()
        self._free = buffered
        self.counts = counts

    def enter(self) -> bool:
        return self._slots.acquire(blocking=False)

    def leave(self) -> None:
        self._slots.release()

    def reserve(self, n: int) -> bool:
        with self._lock:
            if n > self._free:
                return False
            self._free -= n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._free += n

    def turn_away(self, reason: str) -> Answer:
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
        return Answer(stderr=f"[proctor GATE_UNAVAILABLE] the gate turned this call away: {TURNED_AWAY[reason]}",
                      exit=2)

    def read(self, sock: Any) -> tuple[bytes | Answer, int]:
        """The request, read in chunks each reserved before it is received (so the bytes held never pass
        the budget), until the sender half-closes; or the turning-away answer. Also the bytes reserved, for
        the caller to release once the request has been handled (its parsing holds copies of it)."""
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        chunks: list[bytes] = []  # joined once at the end: a growing bytearray measured 3-4x the bytes under a flood
        held = 0
        while True:
            left = deadline - time.monotonic()
            want = min(CHUNK, MAX_REQUEST + 1 - held)
            if left <= 0:
                return self.turn_away("slow"), held
            if not self.reserve(want):
                return self.turn_away("size"), held
            try:
                sock.settimeout(left)
                chunk = sock.recv(want)
            except TimeoutError:
                self.release(want)
                return self.turn_away("slow"), held
            except OSError:
                chunk = b""
            self.release(want - len(chunk))
            held += len(chunk)
            if not chunk:
                return b"".join(chunks), held
            if held > MAX_REQUEST:
                return self.turn_away("size"), held
            chunks.append(chunk)


class GateServer(socketserver.ThreadingUnixStreamServer):
    """A thread per connection while a slot is free; past that, a connection is answered (a deny) and
    closed from the accepting thread: no thread, no read."""

    daemon_threads = True

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler], intake: Intake) -> None:
        self.intake = intake
        super().__init__(path, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.intake.enter():
            send_answer(request, self.intake.turn_away("connections"), wait=False)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.intake.leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.intake.leave()


def send_answer(sock: Any, answer: Answer, *, wait: bool = True) -> None:
    """The answer as the hook client reads it. `wait=False`: only what the socket takes at once (a flood's
    connection that never reads must not hold the accepting thread)."""
    data = json.dumps({"stdout": answer.stdout, "stderr": answer.stderr, "exit": answer.exit}).encode()
    try:
        if wait:
            sock.settimeout(REQUEST_DEADLINE_S)
            sock.sendall(data)
        else:
            sock.setblocking(False)
            sock.send(data)
    except OSError:
        pass  # the caller is gone or never reads: it hears nothing, which its hook client takes as a deny
