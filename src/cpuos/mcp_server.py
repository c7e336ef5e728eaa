"""``cpuos mcp``: the sandbox tools (``cpuos.tools``) as a Model Context Protocol server,
with the official ``mcp`` SDK: over stdio (what desktop and IDE clients start), or
streamable HTTP when asked (``--http``). Results are shaped for a model: JSON text with
long output cut to its head and tail, figures and images as image content; a failure is a
result with ``isError`` set, saying why.

The sandboxes the server made are killed when it ends (``--keep`` leaves them to their
timeout).
"""

from __future__ import annotations

import base64
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


def serve_http(tools: AsyncTools, *, host: str = "127.0.0.1", port: int = 8765,
               keep: bool = False) -> None:
    """Streamable HTTP at http://HOST:PORT/mcp."""
    import uvicorn

    server = build_server(tools, keep=keep)
    app = server.streamable_http_app(host=host)
    uvicorn.run(app, host=host, port=port, log_level="warning")
