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
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ApiError
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
            # the handler checks the key itself (and refuses with its close code); one that
            # is valid is filed, so revoking it closes the socket
            key = bearer_key(scope["headers"])
            found = services_of(scope["app"]).store.key_lookup(key) if key else None
            if found is None:
                await self.app(scope, receive, send)
            else:
                await _live(scope).run(found[0], scope, receive, send, self.app)
            return
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        key = bearer_key(headers)
        if key is None:
            await _reply(send, ApiError(
                "unauthorized", "missing API key: send 'Authorization: Bearer <key>'"))
            return
        store = services_of(scope["app"]).store
        found = store.key_lookup(key)
        if found is None:
            await _reply(send, ApiError("unauthorized", "invalid API key (unknown, revoked, "
                                                        "or of a deleted workspace)"))
            return
        key_id, wid = found
        state = scope.setdefault("state", {})
        state["workspace"], state["key_id"] = wid, key_id
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
