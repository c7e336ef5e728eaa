"""The E2B-compatible surface: E2B's own SDKs (``e2b``, ``e2b-code-interpreter``, JS ``e2b``,
``@e2b/code-interpreter``) work against cpuos unchanged, configured by their environment::

    E2B_API_URL=http://127.0.0.1:7770/e2b  E2B_SANDBOX_URL=http://127.0.0.1:7770/e2b
    E2B_API_KEY=<a cpuos key, or an e2b_<hex> key from POST /e2b/keys>

An adapter over cpuos's core, on the daemon's own listener, in front of cpuos's API:

* ``/e2b/...`` without sandbox headers: E2B's control plane (``control``; ``X-API-Key``);
* any request with ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` (the SDK sends them on all
  sandbox traffic; a leading ``/e2b`` is dropped): port 49983 is envd (``envd``: the Connect
  services; ``plain``: /files, /health, /envs), 49999 the code interpreter (``plain``),
  checked against the sandbox's access token first;
* the host form ``<port>-<id>.<domain>`` (``E2B_DOMAIN``) goes through the preview proxy
  (``ports``: E2B's ports are public unless the sandbox was made with
  ``allowPublicTraffic: false``; 49983/49999 are handed to this listener with the headers).

Everything else reaches cpuos's own app untouched."""

from __future__ import annotations

import logging
from functools import cached_property
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from . import ports
from .state import E2B, ENVD_PORT, JUPYTER_PORT, E2BError

if TYPE_CHECKING:
    from .plain import Plain

log = logging.getLogger("cpuosd.e2b")
PREFIX = "/e2b"
MAX_CONTROL_BODY = 1 << 20

__all__ = ["E2B", "E2BRouter", "install", "ports"]


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return str(v.decode("latin-1"))
    return None


async def _reply(send: Send, err: E2BError) -> None:
    import json

    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class E2BRouter:
    """ASGI, outermost on the daemon's listener (before cpuos's key Guard: the E2B surface
    has keys and tokens of its own, checked here before any body is read)."""

    def __init__(self, app: ASGIApp, e2b: E2B) -> None:
        self.app, self.e2b = app, e2b

    # the E2B apps, built at the first request that needs one: a daemon no E2B client talks
    # to never imports them (their FastAPI app, Connect services and protobuf modules: ~0.12 s
    # of CPU at each daemon start). Built in the event loop's thread, without awaiting.
    @cached_property
    def control(self) -> ASGIApp:
        from . import control

        return control.build(self.e2b)

    @cached_property
    def _envd(self) -> tuple[ASGIApp, ASGIApp]:
        from . import envd

        return envd.build(self.e2b)

    @property
    def process(self) -> ASGIApp:
        return self._envd[0]

    @property
    def filesystem(self) -> ASGIApp:
        return self._envd[1]

    @cached_property
    def plain(self) -> Plain:
        from .plain import Plain

        return Plain(self.e2b)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sid = _header(scope, b"e2b-sandbox-id")
        path: str = scope["path"]
        if sid is not None:
            await self._sandbox(scope, receive, send, sid, path)
        elif path in ("/files", PREFIX + "/files") and b"signature=" in scope.get(
                "query_string", b""):
            # a signed file URL (download_url/upload_url): no headers, the signature says
            if self._expired(scope):
                return await _reply(send, E2BError(401, "signature is already expired"))
            found = self._signature(scope, None)
            if found is None:
                return await _reply(send, E2BError(401, "invalid or expired signature"))
            await self._sandbox(scope, receive, send, found, path, signed=True)
        elif path == PREFIX or path.startswith(PREFIX + "/"):
            await self._control(scope, receive, send, path[len(PREFIX):] or "/")
        else:
            await self.app(scope, receive, send)

    async def _control(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        key = _header(scope, b"x-api-key")
        if key is None:
            auth = _header(scope, b"authorization") or ""
            scheme, _, rest = auth.partition(" ")
            key = rest.strip() if scheme.lower() == "bearer" else None
        if not key:
            return await _reply(send, E2BError(401, "missing API key: send X-API-Key"))
        wid = self.e2b.store.workspace_for_key(key)
        if wid is None:
            return await _reply(send, E2BError(401, "invalid API key"))
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_CONTROL_BODY):
            return await _reply(send, E2BError(413, "request body too large"))
        seen = 0

        async def bounded() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > MAX_CONTROL_BODY:
                    return {"type": "http.disconnect"}
            return msg

        sub = {**scope, "path": path, "raw_path": path.encode(), "root_path": "",
               "state": {**scope.get("state", {}), "workspace": wid}}
        await self.control(sub, bounded, send)

    @staticmethod
    def _expired(scope: Scope) -> bool:
        import time
        from urllib.parse import parse_qs

        q = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        exp = (q.get("signature_expiration") or [""])[0]
        return exp.lstrip("-").isdigit() and int(exp) < time.time()

    def _signature(self, scope: Scope, sid: str | None) -> str | None:
        """The sandbox a signed /files request is for (``sid``: the one its headers name),
        or None."""
        return self.e2b.signed_for(scope.get("query_string", b""), scope["method"], sid)

    async def _sandbox(self, scope: Scope, receive: Receive, send: Send, sid: str,
                       path: str, signed: bool = False) -> None:
        from .envd import CURRENT

        if path == PREFIX or path.startswith(PREFIX + "/"):
            path = path[len(PREFIX):] or "/"
        port_s = _header(scope, b"e2b-sandbox-port") or str(ENVD_PORT)
        try:
            port = int(port_s)
        except ValueError:
            return await _reply(send, E2BError(400, "bad E2b-Sandbox-Port"))
        if port not in (ENVD_PORT, JUPYTER_PORT):
            return await _reply(send, E2BError(
                400, f"port {port}: on this listener only envd ({ENVD_PORT}) and the code "
                f"interpreter ({JUPYTER_PORT}); reach your own ports through get_host(port) "
                "(the preview proxy)"))
        token = _header(scope, b"x-access-token")
        if not signed and path == "/files" and not self.e2b.check_token(sid, token) \
                and b"signature=" in scope.get("query_string", b""):
            if self._expired(scope):
                return await _reply(send, E2BError(401, "signature is already expired"))
            signed = self._signature(scope, sid) is not None
        try:
            target = self.e2b.target(sid, port, token,
                                     _header(scope, b"e2b-traffic-access-token"), signed)
        except E2BError as e:
            return await _reply(send, e)
        sub = {**scope, "path": path, "raw_path": path.encode(), "root_path": ""}
        tok = CURRENT.set(target)
        try:
            if port == JUPYTER_PORT:
                await self.plain.jupyter(sub, receive, send)
            elif path.startswith("/process.Process/"):
                await self.process(sub, receive, send)
            elif path.startswith("/filesystem.Filesystem/"):
                await self.filesystem(sub, receive, send)
            else:
                await self.plain.envd(sub, receive, send)
        finally:
            CURRENT.reset(tok)


def install(app: Any, cfg: Any) -> E2B:
    """Mount the E2B surface on cpuos's app (outermost middleware); ``attach`` it to the
    core once that is up (the daemon's lifespan)."""
    e2b = E2B(cfg)
    app.state.e2b = e2b
    app.add_middleware(E2BRouter, e2b=e2b)
    return e2b
