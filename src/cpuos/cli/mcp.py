"""``cpuos mcp``: serve the sandbox tools over the Model Context Protocol (stdio, or
streamable HTTP with ``--http``, behind a bearer token)."""

from __future__ import annotations

from typing import Annotated

import typer
from ._options import ApiKey, ApiUrl


def register(app: typer.Typer) -> None:
    @app.command()
    def mcp(
        http: Annotated[bool, typer.Option(
            "--http", help="Serve streamable HTTP at http://HOST:PORT/mcp, not stdio.")] = False,
        host: Annotated[str, typer.Option(
            help="Listen address with --http (another than loopback needs --token).")
        ] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Listen port with --http.")] = 8765,
        token: Annotated[str | None, typer.Option(
            envvar="CPUOS_MCP_TOKEN", show_envvar=True,
            help="With --http: the bearer token every request must carry (default: a new "
                 "one, printed on stderr at start).")] = None,
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
        resume, kill) to an MCP client; over stdio unless --http. Over HTTP every request
        needs 'Authorization: Bearer TOKEN' (it acts with this command's API key)."""
        try:
            import anyio

            from ..mcp_server import is_loopback, new_token, serve_http, serve_stdio
        except ImportError as e:  # the optional dependency (cpuos[mcp])
            typer.echo(f"error: unavailable: {e}", err=True)
            raise typer.Exit(1) from None
        from .._async.tools import AsyncTools

        if http:
            if token is not None and not token.strip():
                typer.echo("error: invalid_argument: --token is empty", err=True)
                raise typer.Exit(2)
            if token is None and not is_loopback(host):
                typer.echo(f"error: invalid_argument: listening on {host} (not loopback) "
                           "needs --token (or CPUOS_MCP_TOKEN): the server acts with your "
                           "API key for whoever reaches it", err=True)
                raise typer.Exit(2)
        tools = AsyncTools(template=template, timeout=timeout, api_url=api_url,
                           api_key=api_key)
        if http:
            where = f"[{host}]" if ":" in host else host
            if token is None:
                token = new_token()
                typer.echo(f"cpuos mcp: http://{where}:{port}/mcp; send 'Authorization: Bearer "
                           f"{token}'", err=True)
            else:
                typer.echo(f"cpuos mcp: http://{where}:{port}/mcp (bearer token as given)",
                           err=True)
            serve_http(tools, token.strip(), host=host, port=port, keep=keep)
        else:
            anyio.run(lambda: serve_stdio(tools, keep=keep))
