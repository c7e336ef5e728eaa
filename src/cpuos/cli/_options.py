"""The options every ``cpuos`` command shares (defined once; cli.main and the command
modules it registers import them)."""

from __future__ import annotations

from typing import Annotated

import typer

ApiUrl = Annotated[str | None, typer.Option(
    "--api-url", envvar="CPUOS_API_URL", show_envvar=True,
    help="cpuosd address (default http://127.0.0.1:7770).")]
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="CPUOS_API_KEY", show_envvar=True,
    help="API key (default: the local daemon's admin.key).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
SandboxId = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")]
