"""``cpuos mcp``: serve the sandbox tools over the Model Context Protocol (stdio, or
streamable HTTP with ``--http``)."""

from __future__ import annotations

from typing import Annotated

import typer
from ._options import ApiKey, ApiUrl



def register(app: typer.Typer) -> None:
    @app.command()
    def mcp(
        http: Annotated[bool, typer.Option(
            "--http", help="Serve streamable HTTP at http://HOST:PORT/mcp, not stdio.")] = False,
        host: Annotated[str, typer.Option(help="Listen address with --http.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Listen port with --http.")] = 8765,
        template: Annotated[str, typer.Option(
            "--template", "-t", help="Template of the sandboxes it creates.")] = "python",
        timeout: Annotated[str, typer.Option(
            help="Lifetime of the sandboxes it creates.")] = "15m",
        keep: Annotated[bool, typer.Option(
            help="Leave its sandboxes running when it ends (else they are killed).")] = False,
        api_url: ApiUrl = None,
        api_key: ApiKey = None,
    ) -> None:
        """Serve the sandbox tools (create_sandbox, run_code, exec, files, ports, pause,
        resume, kill) to an MCP client; over stdio unless --http."""
        try:
            import anyio

            from ..mcp_server import serve_http, serve_stdio
        except ImportError as e:  # the optional dependency (cpuos[mcp])
            typer.echo(f"error: unavailable: {e}", err=True)
            raise typer.Exit(1) from None
        from .._async.tools import AsyncTools

        tools = AsyncTools(template=template, timeout=timeout, api_url=api_url,
                           api_key=api_key)
        if http:
            serve_http(tools, host=host, port=port, keep=keep)
        else:
            anyio.run(lambda: serve_stdio(tools, keep=keep))
