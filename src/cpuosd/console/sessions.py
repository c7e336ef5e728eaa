"""Console sessions: an API key exchanged for a cookie (``POST /ui/session``).

The browser never keeps the key: it sends it once, in the body of the sign-in request, and
gets back a random session token in an HttpOnly, SameSite=Strict cookie (Secure over TLS,
then named ``__Host-cpuos_session``) and a CSRF token in the answer's body, which the page
keeps in memory only and sends as ``X-Cpuos-Csrf`` with every request that changes
something. A session is the key's: it sees what the key sees, ends when the key is revoked
or its workspace deleted (checked on every request), when the user signs out, or after
``CPUOS_CONSOLE_SESSION_TTL`` (default 12 h). Sessions live in the daemon's memory (only the
SHA-256 of their token): a restarted daemon asks everyone to sign in again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import Scope

COOKIE = "cpuos_session"
COOKIE_TLS = "__Host-cpuos_session"  # Secure, Path=/, no Domain: the browser enforces it
CSRF_HEADER = b"x-cpuos-csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_SESSIONS = 10_000
TTL = 12 * 3600.0  # s (the daemon's: Config.api.console_session_ttl)


@dataclass
class Session:
    key_id: str
    workspace: str
    csrf: str
    created: float
    expires: float


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


class Sessions:
    """The live sessions, by the SHA-256 of their token."""

    def __init__(self, ttl: float | None = None, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl = TTL if ttl is None else ttl
        self.max = max_sessions
        self._by_hash: dict[bytes, Session] = {}

    def create(self, key_id: str, workspace: str) -> tuple[str, Session]:
        """A new session of this key: (its token, for the cookie; the session)."""
        now = time.time()
        if len(self._by_hash) >= self.max:
            self._expire(now)
            while len(self._by_hash) >= self.max:  # the oldest make way
                oldest = min(self._by_hash, key=lambda h: self._by_hash[h].created)
                del self._by_hash[oldest]
        token = secrets.token_urlsafe(32)
        s = Session(key_id, workspace, secrets.token_urlsafe(24), now, now + self.ttl)
        self._by_hash[_digest(token)] = s
        return token, s

    def get(self, token: str) -> Session | None:
        h = _digest(token)
        s = self._by_hash.get(h)
        if s is not None and s.expires <= time.time():
            del self._by_hash[h]
            return None
        return s

    def drop(self, token: str) -> bool:
        return self._by_hash.pop(_digest(token), None) is not None

    def drop_key(self, key_id: str) -> int:
        gone = [h for h, s in self._by_hash.items() if s.key_id == key_id]
        for h in gone:
            del self._by_hash[h]
        return len(gone)

    def _expire(self, now: float) -> None:
        for h in [h for h, s in self._by_hash.items() if s.expires <= now]:
            del self._by_hash[h]

    def __len__(self) -> int:
        return len(self._by_hash)


def sessions_of(app: Any) -> Sessions:
    """The app's sessions (made on first use: the daemon's wiring need not know)."""
    state = app.state
    s: Sessions | None = getattr(state, "console_sessions", None)
    if s is None:
        s = state.console_sessions = Sessions()
    return s


def cookie_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The session token from the request's Cookie header(s), if any (either name)."""
    for k, v in headers:
        if k != b"cookie":
            continue
        for part in v.decode("latin-1").split(";"):
            name, _, value = part.strip().partition("=")
            if name in (COOKIE, COOKIE_TLS) and value:
                return value
    return None


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


def csrf_ok(s: Session, headers: list[tuple[bytes, bytes]]) -> bool:
    given = header(headers, CSRF_HEADER)
    return given is not None and hmac.compare_digest(given.encode("latin-1"), s.csrf.encode())


def same_origin(scope: Scope) -> bool:
    """The request's Origin (a browser always sends one on a WebSocket and on cross-origin
    requests) names the host it was sent to: not a page of another site."""
    headers = scope["headers"]
    origin = header(headers, b"origin")
    host = header(headers, b"host")
    if origin is None or host is None:
        return False
    _, sep, rest = origin.partition("://")
    return bool(sep) and rest.rstrip("/").lower() == host.lower()


def live_session(scope: Scope) -> Session | None:
    """The request's console session, if its cookie names one whose key is still live (not
    revoked, its workspace not deleted)."""
    token = cookie_token(scope["headers"])
    if token is None:
        return None
    app = scope["app"]
    sessions = sessions_of(app)
    s = sessions.get(token)
    if s is None:
        return None
    from ..api.deps import services_of  # (here: api imports this module)

    if not services_of(app).store.key_live(s.key_id):
        sessions.drop_key(s.key_id)
        return None
    return s
