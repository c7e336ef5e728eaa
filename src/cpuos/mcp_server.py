"""``cpuos mcp``: the sandbox tools (``cpuos.tools``) as a Model Context Protocol server,
with the official ``mcp`` SDK: over stdio (what desktop and IDE clients start), or
streamable HTTP when asked (``--http``). Results are shaped for a model: JSON text with
long output cut to its head and tail, figures and images as image content; a failure is a
result with ``isError`` set, saying why.

The sandboxes the server made are killed when it ends (``--keep`` leaves them to their
timeout).

Over HTTP the server acts with the API key it was started with (the admin's by default), so
every request must carry ``Authorization: Bearer <token>``: a token given to it, or one it
makes and prints at start. It listens on loopback unless told otherwise, and refuses another
address unless the token was given (a made-up token printed to a terminal is not meant for
other hosts), since the token then crosses the network in plain HTTP: put TLS in front.
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ._async.tools import AsyncTools
from ._tools_spec import TOOLS

try:
    import mcp_types as types
    from mcp.server.lowlevel import Server
except ImportError as e:  # an optional dependency: pip install 'cpuos[mcp]'
    raise ImportError("cpuos mcp needs the mcp package: pip install 'cpuos[mcp]'") from e


def build_server(tools: AsyncTools, *, keep: bool = False) -> Server[Any]:
    """The MCP server over ``tools`` (its sandboxes are killed at the end unless keep)."""

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=n, description=d, input_schema=s) for n, (d, s) in TOOLS.items()])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        r = await tools.call(params.name, params.arguments or {})
        content: list[Any] = [types.TextContent(type="text", text=r.text)]
        for mime, data in r.images:
            content.append(types.ImageContent(type="image", mime_type=mime,
                                              data=base64.b64encode(data).decode()))
        return types.CallToolResult(content=content, is_error=r.is_error)

    @asynccontextmanager
    async def lifespan(server: Server[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:
            await tools.close(kill=not keep)

    return Server("cpuos", version=_version(), instructions=(
        "Isolated Linux sandboxes: run Python in a persistent kernel (run_code, figures come "
        "back as images), shell commands (exec), and files. A sandbox is created on first "
        "use; create_sandbox makes another."), lifespan=lifespan,
        on_list_tools=list_tools, on_call_tool=call_tool)


def _version() -> str:
    from . import __version__
    return __version__


async def serve_stdio(tools: AsyncTools, *, keep: bool = False) -> None:
    from mcp.server.stdio import stdio_server

    server = build_server(tools, keep=keep)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def is_loopback(host: str) -> bool:
    """A listen address only this machine reaches (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return "cpm_" + secrets.token_urlsafe(32)


class BearerGuard:
    """ASGI: a request without ``Authorization: Bearer <token>`` (compared in constant time)
    is 401 before the MCP app sees it; lifespan events pass."""

    def __init__(self, app: Any, token: str) -> None:
        if not token:
            raise ValueError("an empty token")
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not self._ok(scope):
            await _unauthorized(send, scope["type"])
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: Any) -> bool:
        for k, v in scope.get("headers") or ():
            if k == b"authorization":
                scheme, _, got = bytes(v).partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    got.strip(), self._token)
        return False


async def _unauthorized(send: Any, kind: str) -> None:
    if kind == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps({"error": {"code": "unauthorized", "message": (
        "missing or wrong token: send 'Authorization: Bearer <token>' (the token cpuos mcp "
        "printed at start, or the one given to it)"), "details": {}}}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Bearer realm="cpuos mcp"')]})
    await send({"type": "http.response.body", "body": body})


def http_app(tools: AsyncTools, token: str, *, host: str = "127.0.0.1",
             keep: bool = False) -> Any:
    """The streamable HTTP app at /mcp, behind the bearer token."""
    server = build_server(tools, keep=keep)
    return BearerGuard(server.streamable_http_app(host=host), token)


def serve_http(tools: AsyncTools, token: str, *, host: str = "127.0.0.1", port: int = 8765,
               keep: bool = False) -> None:
    """Streamable HTTP at http://HOST:PORT/mcp; every request needs the token."""
    import uvicorn

    uvicorn.run(http_app(tools, token, host=host, keep=keep), host=host, port=port,
                log_level="warning")
