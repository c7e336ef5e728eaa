"""Console sessions: an API key exchanged for a cookie (``POST /ui/session``).

The browser never keeps the key: it sends it once, in the body of the sign-in request, and
gets back a random session token in an HttpOnly, SameSite=Strict cookie (Secure over TLS,
then named ``__Host-cpuos_session``) and a CSRF token in the answer's body, which the page
keeps in memory only and sends as ``X-Cpuos-Csrf`` with every request that changes
something. A session is the key's: it sees what the key sees, ends when the key is revoked
or its workspace deleted (checked on every request), when the user signs out, or after
``CPUOS_CONSOLE_SESSION_TTL`` (default 12 h).

Sessions live in the state store (``console_sessions``: SQLite on one host, Postgres shared
by every API process and node of many hosts), by the SHA-256 of their token only, with the
key, its workspace and the expiry: a session made through one API process works through any
other and survives a restart; signing out removes it everywhere. The CSRF token is not
stored at all: it is an HMAC of the session's token (which only the cookie holds), so it is
the same on every process that sees the cookie and is of no use to a reader of the
database.
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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def _csrf(token: str) -> str:
    mac = hmac.new(token.encode("utf-8", "replace"), b"cpuos console csrf", hashlib.sha256)
    return mac.hexdigest()[:32]


class Sessions:
    """The console's sessions in the state store (``store``: cpuosd.store.Store), by the
    SHA-256 of their token."""

    def __init__(self, store: Any, ttl: float | None = None,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.store = store
        self.ttl = TTL if ttl is None else ttl
        self.max = max_sessions

    def create(self, key_id: str, workspace: str) -> tuple[str, Session]:
        """A new session of this key: (its token, for the cookie; the session). Past
        ``max_sessions`` the oldest make way."""
        now = time.time()
        token = secrets.token_urlsafe(32)
        self.store.session_create(_digest(token), key_id, workspace, now, now + self.ttl,
                                  self.max)
        return token, Session(key_id, workspace, _csrf(token), now, now + self.ttl)

    def get(self, token: str, *, live_key: bool = False) -> Session | None:
        """The token's session unless it expired (``live_key``: and its key is still live;
        a session of a key revoked since is removed)."""
        h = _digest(token)
        r = self.store.session_get(h)
        if r is None:
            return None
        if r["expires_at"] <= time.time():
            self.store.session_drop(h)
            return None
        if live_key and not r["live"]:
            self.store.session_drop_key(r["key_id"])
            return None
        return Session(r["key_id"], r["workspace_id"], _csrf(token), float(r["created_at"]),
                       float(r["expires_at"]))

    def drop(self, token: str) -> bool:
        return bool(self.store.session_drop(_digest(token)))

    def drop_key(self, key_id: str) -> int:
        return int(self.store.session_drop_key(key_id))

    def __len__(self) -> int:
        return int(self.store.session_count())


def sessions_of(app: Any) -> Sessions:
    """The app's sessions, over its state store (made on first use: the daemon's wiring
    need not know; the TTL is ``app.state.console_session_ttl`` when set)."""
    state = app.state
    s: Sessions | None = getattr(state, "console_sessions", None)
    if s is None:
        from ..api.deps import services_of  # (here: api imports this module)

        s = state.console_sessions = Sessions(services_of(app).store,
                                              getattr(state, "console_session_ttl", None))
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
    requests) names the host it was sent to: not a page of another site. On a node of many
    hosts that is the API process's (its forwarder sends it as ``X-Forwarded-Host``, a
    header no page can set on a WebSocket; cpuosd.cluster.nodes.NodeTokenGuard marks
    requests that carried the node token)."""
    headers = scope["headers"]
    origin = header(headers, b"origin")
    host = header(headers, b"host")
    if scope.get("state", {}).get("via_api_tier"):
        host = header(headers, b"x-forwarded-host") or host
    if origin is None or host is None:
        return False
    _, sep, rest = origin.partition("://")
    return bool(sep) and rest.rstrip("/").lower() == host.lower()


def live_session(scope: Scope) -> Session | None:
    """The request's console session, if its cookie names one whose key is still live (not
    revoked, its workspace not deleted): one query of the store."""
    token = cookie_token(scope["headers"])
    if token is None:
        return None
    return sessions_of(scope["app"]).get(token, live_key=True)
