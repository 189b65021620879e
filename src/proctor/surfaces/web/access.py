"""Who may use the review page: the holder of this install's token, from a page the server itself served.

Owns the per-install token (`$PROCTOR_HOME/review-token`, 0600 in a 0700 home: no other local user can
read it, so no other local user can act on the page even though any of them can reach the loopback port),
the page's secret path, the session cookie a browser gets for it, the one-time sign-in codes, the count of
failed sign-ins, and the CSRF token every form carries.

Why a secret path: browsers scope cookies by host, not port (RFC 6265 8.5). Measured: another local user's
server on another loopback port, visited once, received `proctor_review` (then Path=/review) and with it
landed a job. So the page lives under `/review/<scope>`, scope = HMAC(token, "scope"), and the cookie is
`Path=/review/<scope>`: a browser sends it only to a URL under that path, and only someone who already holds
the token (or the signed-in browser's own profile) knows it. A per-port cookie name would not do (every port
still gets every cookie), nor a per-install loopback address (any local user may bind it on another port).

    POST /review/login          code=C (a form): a one-time code `proctor serve` printed once its socket
                                was listening, which the person types into the page: the cookie, then a
                                redirect to /review/<scope>. Never in an address: opened the usual way
                                (`xdg-open` -> `chromium URL`) a URL sits in the browser's command line,
                                which every local user reads in /proc (measured: a second user spent the
                                code first). A GET with ?code= spends the code and signs nobody in.
    POST /review/login          token=T (a form): the same, for a person who has the token file; the
                                token never goes in a URL (a GET with ?token= is refused unread)
    Authorization: Bearer T     the same, for a script (no cookie)
    POST under the scope        needs the cookie (or bearer) and a `csrf` field equal to HMAC(T, "csrf"),
                                compared in constant time; the request guard has already refused a foreign
                                Origin, and SameSite=Strict keeps the cookie off every cross-site request

The cookie's name is derived from the token too (`proctor_review_<HMAC>`): another local user's page on
another loopback port set `proctor_review=x; Path=/`, the browser sent it after the real one, the server
kept the last value, and the person was locked out for the cookie's year. She cannot name this one, and a
request carrying the name twice is refused whatever the values.

Failed sign-ins are counted for every client together, not per address: any local user sends from any
127.x.y.z (and a proxy header is never trusted: `server_config`), so 2,000 wrong tokens never met a
per-address limit. Past FAILS_PER_WINDOW in a window each is answered 429 (Retry-After) instead of a page,
and each window with a failure leaves one summary row, not a row an attempt (measured before: 300 rows in
2.6 s). The right credential always signs in, flood or not: a limit that also refused it would let anyone
lock the reviewer out (a 256-bit token is not guessed in any number of tries; the limit is about the cost
of answering and recording).
It never decides what a verb may do (proctor.services.review does).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.home import PrivateFileError, ensure_home, private_secret

# The page's CSP and framing rules; the API's guard sets them on every response of the origin.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store", "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}

TOKEN_FILE = "review-token"
COOKIE_PREFIX = "proctor_review_"
EVERY_CLIENT = "every client"  # what failed sign-ins are counted under (the module docstring says why)
CODE_TTL_S = 15 * 60  # a printed sign-in address works this long, and once
CODES_KEPT = 16
FAIL_WINDOW_S = 60.0
FAILS_PER_WINDOW = 10
CLIENTS_KEPT = 1024  # windows held at once; past it the oldest is summarised early


class TokenError(Exception):
    """The token file exists but cannot be used (unreadable, another owner, open to others)."""


def load_token(home: Path | None = None) -> str:
    """This install's token, made on first use (32 random bytes, URL-safe)."""
    path = (home or ensure_home()) / TOKEN_FILE
    try:
        token = private_secret(path, secrets.token_urlsafe(32) + "\n", most=200)
    except PrivateFileError as exc:
        raise TokenError(str(exc)) from None
    if len(token) < 32:
        raise TokenError(f"{path} holds no usable token (empty or cut short): remove it and start again")
    return token


@dataclass
class _Window:
    start: float
    failures: int = 0
    refused: int = 0  # of them past the limit, answered 429


class Failures:
    """Failed sign-ins per client: a limit per window, and one summary (`write(payload)`) per window."""

    def __init__(self, write: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._write = write
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def failed(self, client: str) -> bool:
        """Count a failed sign-in of `client`; True when it is past the window's limit (answer 429)."""
        with self._lock:
            self._close_expired()
            if client not in self._windows and len(self._windows) >= CLIENTS_KEPT:
                oldest = min(self._windows, key=lambda c: self._windows[c].start)
                self._emit(oldest, self._windows.pop(oldest))
            w = self._windows.setdefault(client, _Window(self._clock()))
            w.failures += 1
            if w.failures > FAILS_PER_WINDOW:
                w.refused += 1
            return w.failures > FAILS_PER_WINDOW

    def flush(self) -> None:
        """Summarise every open window now (the server is stopping)."""
        with self._lock:
            for client, w in self._windows.items():
                self._emit(client, w)
            self._windows.clear()

    def _close_expired(self) -> None:
        now = self._clock()
        for client, w in list(self._windows.items()):
            if now - w.start >= FAIL_WINDOW_S:
                self._emit(client, self._windows.pop(client))

    def _emit(self, client: str, w: _Window) -> None:
        self._write({"ok": False, "client": client, "failures": w.failures, "refused": w.refused,
                     "windowS": FAIL_WINDOW_S, "limit": FAILS_PER_WINDOW})


class Access:
    def __init__(self, token: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._token = token
        self._clock = clock
        # Values derived from the token, never the token itself: a cookie or a path that leaks (a browser
        # profile backup) is a session of this install's page, not the key to sign in anew.
        self.session = self._mac("session")
        self.csrf = self._mac("csrf")
        self.scope = self._mac("scope")[:32]
        self.cookie = COOKIE_PREFIX + self._mac("cookie")[:16]
        self._codes: dict[str, float] = {}
        self._lock = threading.Lock()

    def _mac(self, purpose: str) -> str:
        return hmac.new(self._token.encode(), purpose.encode(), hashlib.sha256).hexdigest()

    def token_ok(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self._token.encode())

    def new_code(self) -> str:
        """A sign-in code good for one use within CODE_TTL_S (what `proctor serve` prints)."""
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._codes[hashlib.sha256(code.encode()).hexdigest()] = self._clock() + CODE_TTL_S
            while len(self._codes) > CODES_KEPT:
                self._codes.pop(next(iter(self._codes)))
        return code

    def spend_code(self, code: str | None) -> bool:
        """True once for a live code; it is gone after. Kept as its hash: the lookup leaks no timing of it."""
        if not code:
            return False
        key = hashlib.sha256(code.encode()).hexdigest()
        with self._lock:
            expires = self._codes.pop(key, None)
        return expires is not None and self._clock() < expires

    def allowed(self, cookie_header: str | None, authorization: str | None) -> bool:
        """The session cookie, given exactly once in the request's Cookie header, or the token as a bearer."""
        values = [v for k, _, v in (c.strip().partition("=") for c in (cookie_header or "").split(";"))
                  if k == self.cookie]
        if len(values) == 1 and hmac.compare_digest(values[0].encode(), self.session.encode()):
            return True
        return self.bearer_ok(authorization)

    def bearer_ok(self, authorization: str | None) -> bool:
        if authorization and authorization[:7].lower() == "bearer ":
            return self.token_ok(authorization[7:].strip())
        return False

    def csrf_ok(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.csrf.encode())
