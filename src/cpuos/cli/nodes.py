"""``cpuos node ls|cordon|uncordon|drain NODE`` (admin key; against an API process of a
deployment of many hosts, ``cpuosd --role=api``: docs/DEPLOY.md)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from .._sync.sandbox import _SyncHTTP
from ._options import ApiKey, ApiUrl, JsonOut

NodeId = Annotated[str, typer.Argument(metavar="NODE", help="Node id.")]


def _json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _row(n: dict[str, Any]) -> str:
    cap = n.get("capacity") or {}
    state = ("alive" if n.get("alive") else "DEAD") + (", cordoned" if n.get("cordoned") else "")
    mem = f"{int(cap.get('memory_available_mib') or 0)}/{int(cap.get('memory_mib') or 0)}"
    return (f"{n['id']:<24} {state:<16} {n.get('running', 0):>7} {mem:>13} "
            f"{n.get('address', '')}")


def _call(method: str, path: str, api_url: str | None, api_key: str | None) -> Any:
    http = _SyncHTTP(api_url, api_key, request_timeout=600.0)
    try:
        return http.request(method, path)
    finally:
        http.close()


def register(app: typer.Typer, group: type) -> None:
    node_app = typer.Typer(cls=group, no_args_is_help=True,
                           help="Nodes of a deployment on many hosts (admin key).")
    app.add_typer(node_app, name="node")

    @node_app.command("ls")
    def node_ls(json_: JsonOut = False, api_url: ApiUrl = None,
                api_key: ApiKey = None) -> None:
        """The nodes: alive or dead, cordoned, running sandboxes, memory available/total
        (MiB), address."""
        nodes = _call("GET", "/nodes", api_url, api_key)["nodes"]
        if json_:
            _json(nodes)
            return
        typer.echo(f"{'NODE':<24} {'STATE':<16} {'RUNNING':>7} {'MEM MiB':>13} ADDRESS")
        for n in nodes:
            typer.echo(_row(n))

    for op, what in (("cordon", "No new sandboxes on the node (those there keep running)."),
                     ("uncordon", "The node takes new sandboxes again."),
                     ("drain", "Cordon the node, then pause every sandbox running there "
                               "(into the snapshot store: any node resumes them).")):
        def command(node: NodeId, json_: JsonOut = False, api_url: ApiUrl = None,
                    api_key: ApiKey = None, op: str = op) -> None:
            out = _call("POST", f"/nodes/{node}/{op}", api_url, api_key)
            if json_:
                _json(out)
            elif op == "drain":
                typer.echo(f"{node}: {len(out['paused'])} paused, {len(out['failed'])} failed")
                for f in out["failed"]:
                    typer.echo(f"  {f['id']}: {f['error']}: {f['message']}", err=True)
            else:
                typer.echo(_row(out))

        command.__doc__ = what
        node_app.command(op)(command)
