"""Who may use the review page: the holder of this install's token, from a page the server itself served.

Owns the per-install token (`$PROCTOR_HOME/review-token`, 0600 in a 0700 home: no other local user can
read it, so no other local user can act on the page even though any of them can reach the loopback port),
the session cookie a browser gets for it, and the CSRF token every form carries.

    GET /review/login?token=T   sets the cookie (HttpOnly, SameSite=Strict, Path=/review) and redirects,
                                so the token leaves the address bar and the history entry at once
    Authorization: Bearer T     the same, for a script
    POST                        needs the cookie (or bearer) and a `csrf` field equal to HMAC(T, "csrf"),
                                compared in constant time; the request guard has already refused a foreign
                                Origin, and SameSite=Strict keeps the cookie off every cross-site request

It never decides what a verb may do (proctor.review does); it only says who is asking.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from proctor.home import PrivateFileError, ensure_home, private_secret

TOKEN_FILE = "review-token"
COOKIE = "proctor_review"


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


class Access:
    def __init__(self, token: str) -> None:
        self._token = token
        # The cookie holds a value derived from the token, not the token itself: a cookie that leaks (a
        # browser profile backup) is a session of this server, not the key to log in elsewhere.
        self.session = self._mac("session")
        self.csrf = self._mac("csrf")

    def _mac(self, purpose: str) -> str:
        return hmac.new(self._token.encode(), purpose.encode(), hashlib.sha256).hexdigest()

    def login_ok(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self._token.encode())

    def allowed(self, cookie: str | None, authorization: str | None) -> bool:
        if cookie is not None and hmac.compare_digest(cookie.encode(), self.session.encode()):
            return True
        if authorization and authorization.lower().startswith("bearer "):
            return self.login_ok(authorization[7:].strip())
        return False

    def csrf_ok(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.csrf.encode())
