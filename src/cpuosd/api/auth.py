"""Who is calling, checked before anything else: the API key, then the body's size.

``Guard`` is plain ASGI in front of the app. It answers 401 to a request without a valid
key *before a byte of its body is read* (FastAPI reads and parses a JSON body before it
runs any dependency, so a key check in a dependency comes after the body is in memory),
and 413 to a JSON body over ``MAX_JSON_BODY`` (by Content-Length, or counted as a
chunked body arrives). Streamed uploads (``STREAMED``: file writes, template builds, stdin
streams) have their own bounds where they are consumed.

Every request and WebSocket that presented a valid key runs in a cancel scope filed under
that key (``LiveRequests``): revoking the key (or deleting its workspace) ends them at once
(an exec stream, a follower, a terminal), not only the requests that come after. A request
whose answer had not started gets 401; a started stream is cut (the client sees it end
early: the SDK raises); a WebSocket is closed with 4401.

The web console (cpuosd.console) calls the same routes with a session cookie instead of the
key (a session is its key's: revoked with it); a request that changes something must then
carry the session's CSRF token (``X-Cpuos-Csrf``), and a WebSocket must come from a page of
the daemon's own origin. The admin may act in another workspace (``X-Cpuos-Workspace: <id>``
or ``?workspace=<id>`` where a header cannot be set: EventSource, WebSocket, a download
link), and list every workspace's sandboxes and events (``workspace=*``).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qs

import anyio
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..console.sessions import (SAFE_METHODS, cookie_token, csrf_ok, header, live_session,
                                same_origin)
from ..errors import ApiError, not_found
from .deps import services_of

MAX_JSON_BODY = 8 << 20  # exec stdin rides in the JSON body
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
STREAMED = (("PUT", re.compile(r"^/sandboxes/[^/]+/files(/tar)?$")),
            ("POST", re.compile(r"^/templates/build$")),
            # stdin streams: unbounded by design, read only as fast as the command takes
            # them (cpuosd.agentconn.Stream.send_stdin: a window of flow control)
            ("POST", re.compile(r"^/sandboxes/[^/]+/commands/[0-9]+/stdin$")),
            ("POST", re.compile(r"^/sandboxes/[^/]+/execs/[^/]+/stdin$")))


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for k, v in headers:
        if k == b"authorization":
            scheme, _, key = v.decode("latin-1").partition(" ")
            key = key.strip()
            return key if scheme.lower() == "bearer" and key else None
    return None


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for k, v in headers:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return -1
    return None


class LiveRequests:
    """The requests and WebSockets in flight, by the id of the key that opened them."""

    def __init__(self) -> None:
        self.by_key: dict[str, set[anyio.CancelScope]] = {}

    async def run(self, key_id: str, scope: Scope, receive: Receive, send: Send,
                  app: ASGIApp) -> None:
        started = closed = False

        async def tracked(msg: Message) -> None:
            nonlocal started, closed
            if msg["type"] in ("http.response.start", "websocket.accept"):
                started = True
            elif msg["type"] in ("websocket.close", "websocket.http.response.start"):
                closed = True
            await send(msg)

        cs = anyio.CancelScope()
        scope.setdefault("state", {})["live_scope"] = cs
        mine = self.by_key.setdefault(key_id, set())
        mine.add(cs)
        try:
            with cs:
                await app(scope, receive, tracked)
        finally:
            mine.discard(cs)
            if not mine:
                self.by_key.pop(key_id, None)
        if not cs.cancelled_caught:
            return
        # revoked while it ran: say so where the protocol still lets us
        if scope["type"] == "websocket":
            if not closed:
                await send({"type": "websocket.close", "code": 4401,
                            "reason": "API key revoked"})
        elif not started:
            await _reply(send, ApiError("unauthorized", "API key revoked"))

    def cancel(self, key_ids: list[str] | set[str], keep: Any = None) -> int:
        """End what these keys have in flight but ``keep`` (the asking request's own scope:
        a key revoking itself gets its answer); how many requests that was."""
        n = 0
        for kid in key_ids:
            for cs in list(self.by_key.get(kid, ())):
                if cs is not keep:
                    cs.cancel()
                    n += 1
        return n


class Guard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # the handler checks the caller itself (and refuses with its close code); one
            # that is valid is filed, so revoking its key closes the socket
            found = websocket_caller(scope)
            if found is None:
                await self.app(scope, receive, send)
            else:
                await _live(scope).run(found[0], scope, receive, send, self.app)
            return
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path == "/ui" \
                or path.startswith("/ui/"):  # the console's page and sign-in: cpuosd.console
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        key = bearer_key(headers)
        store = services_of(scope["app"]).store
        if key is not None:
            found = store.key_lookup(key)
            if found is None:
                await _reply(send, ApiError("unauthorized", "invalid API key (unknown, "
                                            "revoked, or of a deleted workspace)"))
                return
        else:
            session = live_session(scope)
            if session is None:
                await _reply(send, ApiError("unauthorized", (
                    "console session expired or signed out: sign in again at /ui"
                    if cookie_token(headers) else
                    "missing API key: send 'Authorization: Bearer <key>'")))
                return
            if scope["method"] not in SAFE_METHODS and not csrf_ok(session, headers):
                await _reply(send, ApiError("permission_denied", (
                    "a console session's request that changes something needs the "
                    "session's X-Cpuos-Csrf header")))
                return
            found = (session.key_id, session.workspace)
        key_id, wid = found
        try:
            wid, every = target_workspace(scope, store, wid)
        except ApiError as e:
            await _reply(send, e)
            return
        state = scope.setdefault("state", {})
        state["workspace"], state["key_id"], state["all_workspaces"] = wid, key_id, every
        live = _live(scope)
        if any(m == scope["method"] and p.fullmatch(scope["path"]) for m, p in STREAMED):
            await live.run(key_id, scope, receive, send, self.app)
            return
        length = _content_length(headers)
        if length is not None and (length < 0 or length > MAX_JSON_BODY):
            await _reply(send, too_large(length))
            return
        seen = 0

        async def counted() -> Message:
            # a chunked body: counted as it arrives; the app's handler turns this into
            # the same 413 (FastAPI passes an HTTPException raised while reading through)
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > MAX_JSON_BODY:
                    raise HTTPException(413, too_large(seen).message)
            return msg

        await live.run(key_id, scope, counted, send, self.app)


def target_workspace(scope: Scope, store: Any, wid: str) -> tuple[str, bool]:
    """The workspace a request acts in: the key's, or (the admin only) the one it names
    in ``X-Cpuos-Workspace`` or ``?workspace=``; and whether it asked for every workspace
    (``*``: the sandbox list and the event stream)."""
    want = header(scope["headers"], b"x-cpuos-workspace")
    if want is None:
        q = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("workspace")
        want = q[-1] if q else None
    if want is None or want == "" or want == wid:
        return wid, False
    admin = wid == store.workspace_by_name("default")
    if want == "*":
        if not admin:
            raise ApiError("permission_denied", "only the admin sees every workspace "
                           "(workspace=*)")
        return wid, True
    if not admin or store.workspace(want) is None:
        raise not_found("workspace", want[:64])
    return want, False


def websocket_caller(scope: Scope) -> tuple[str, str] | None:
    """(key id, workspace) of a WebSocket's caller: its API key, or a console session
    whose page is of the daemon's own origin (a page of another site cannot ride on the
    cookie); None if neither, or if it names a workspace it may not act in."""
    store = services_of(scope["app"]).store
    key = bearer_key(scope["headers"])
    found: tuple[str, str] | None = None
    if key is not None:
        found = store.key_lookup(key)
    else:
        s = live_session(scope)
        if s is not None and same_origin(scope):
            found = (s.key_id, s.workspace)
    if found is None:
        return None
    try:
        wid, _ = target_workspace(scope, store, found[1])
    except ApiError:
        return None
    return found[0], wid


def _live(scope: Scope) -> LiveRequests:
    state = scope["app"].state
    live: LiveRequests | None = getattr(state, "live_requests", None)
    if live is None:
        live = state.live_requests = LiveRequests()
    return live


def too_large(n: int) -> ApiError:
    return ApiError("too_large", f"request body too large ({n} bytes; at most "
                                 f"{MAX_JSON_BODY} for a JSON request)",
                    {"limit": MAX_JSON_BODY})


async def _reply(send: Send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def live_requests(request: Request) -> LiveRequests:
    return _live(request.scope)


def all_workspaces(request: Request) -> bool:
    """The admin asked for every workspace (``workspace=*``)."""
    return bool(getattr(request.state, "all_workspaces", False))
