"""Who is calling, checked before anything else: the API key, then the body's size.

``Guard`` is plain ASGI in front of the app. It answers 401 to a request without a valid
key *before a byte of its body is read* (FastAPI reads and parses a JSON body before it
runs any dependency, so a key check in a dependency comes after the body is in memory),
and 413 to a JSON body over ``MAX_JSON_BODY`` (by Content-Length, or counted as a
chunked body arrives). Streamed uploads (``STREAMED``: file writes, template builds, stdin
streams) have their own bounds where they are consumed.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ApiError

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


class Guard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        key = bearer_key(headers)
        if key is None:
            await _reply(send, ApiError(
                "unauthorized", "missing API key: send 'Authorization: Bearer <key>'"))
            return
        store = scope["app"].state.store
        wid = store.workspace_for_key(key)
        if wid is None:
            await _reply(send, ApiError("unauthorized", "invalid API key"))
            return
        scope.setdefault("state", {})["workspace"] = wid
        if any(m == scope["method"] and p.fullmatch(scope["path"]) for m, p in STREAMED):
            await self.app(scope, receive, send)
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

        await self.app(scope, counted, send)


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


def workspace(request: Request) -> str:
    """The caller's workspace (the Guard has checked the key)."""
    wid: Any = getattr(request.state, "workspace", None)
    if not isinstance(wid, str):  # not behind the Guard (it covers every keyed route)
        raise ApiError("unauthorized", "missing API key: send 'Authorization: Bearer <key>'")
    return wid


Ws = Annotated[str, Depends(workspace)]


def require_admin(request: Request, ws: str) -> None:
    if ws != request.app.state.store.workspace_by_name("default"):
        raise ApiError("permission_denied", "only the admin workspace may do this")
