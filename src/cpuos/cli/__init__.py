"""``cpuos``: the command line (typer + rich) over the sync SDK."""
