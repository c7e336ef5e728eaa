"""``cpuos key ls|create|revoke`` (the caller's workspace's API keys, or with the admin key
any workspace's: ``--workspace ID``) and ``cpuos workspace ls|create|rm`` (admin)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer

from .._models import ApiKeyInfo
from .._sync.workspace import Workspace
from ._options import ApiKey, ApiUrl, JsonOut

WorkspaceOpt = Annotated[str | None, typer.Option(
    "--workspace", "-w", help="Another workspace's id (admin key); default: the caller's.")]


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _key_row(k: ApiKeyInfo) -> str:
    state = f"revoked {_when(k.revoked_at)}" if k.revoked else "live"
    return (f"{k.id:<18} {k.label[:24]:<24} {_when(k.created_at):<20} {state}"
            + ("  (this key)" if k.current else ""))


def register(app: typer.Typer, group: type) -> None:
    key_app = typer.Typer(cls=group, no_args_is_help=True,
                          help="API keys of your workspace (or, admin, of any).")
    ws_app = typer.Typer(cls=group, no_args_is_help=True,
                         help="Workspaces: list, create, delete (admin key).")
    app.add_typer(key_app, name="key")
    app.add_typer(ws_app, name="workspace")

    @key_app.command("ls")
    def key_ls(workspace: WorkspaceOpt = None, json_: JsonOut = False,
               api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
        """The workspace's keys: id, label, made, live or revoked (never a key itself)."""
        with Workspace(api_url=api_url, api_key=api_key) as ws:
            keys = ws.keys(workspace=workspace)
        if json_:
            _json([{k: v for k, v in vars(x).items() if k != "key"} for x in keys])
            return
        typer.echo(f"{'ID':<18} {'LABEL':<24} {'MADE':<20} STATE")
        for k in keys:
            typer.echo(_key_row(k))

    @key_app.command("create")
    def key_create(
        label: Annotated[str, typer.Option(help="What the key is for (who holds it).")
                         ] = "default",
        workspace: WorkspaceOpt = None, json_: JsonOut = False,
        api_url: ApiUrl = None, api_key: ApiKey = None,
    ) -> None:
        """Make a key; it is printed (stdout) this once: keep it."""
        with Workspace(api_url=api_url, api_key=api_key) as ws:
            k = ws.create_key(label, workspace=workspace)
        if json_:
            _json(vars(k))
            return
        typer.echo(k.key)
        typer.echo(f"key {k.id} ({k.label}) of workspace {k.workspace_id}", err=True)

    @key_app.command("revoke")
    def key_revoke(
        key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key's id (key-...).")],
        workspace: WorkspaceOpt = None, api_url: ApiUrl = None, api_key: ApiKey = None,
    ) -> None:
        """Revoke a key at once (refused from its next request, its open streams ended).

        Not a workspace's own last live key (make another first); the admin may revoke
        another workspace's last key."""
        with Workspace(api_url=api_url, api_key=api_key) as ws:
            k = ws.revoke_key(key_id, workspace=workspace)
        typer.echo(f"revoked {k.id} ({k.label}) at {_when(k.revoked_at)}", err=True)

    @ws_app.command("ls")
    def ws_ls(deleted: Annotated[bool, typer.Option(help="Deleted ones too.")] = False,
              json_: JsonOut = False, api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
        """Every workspace: id, name, live keys, alive sandboxes (admin)."""
        with Workspace(api_url=api_url, api_key=api_key) as ws:
            items = ws.list_workspaces(deleted=deleted)
        if json_:
            _json(items)
            return
        typer.echo(f"{'ID':<16} {'NAME':<24} {'KEYS':>4} {'SANDBOXES':>9}  MADE")
        for w in items:
            gone = f"  deleted {_when(w['deleted_at'])}" if w.get("deleted_at") else ""
            typer.echo(f"{w['id']:<16} {w['name'][:24]:<24} {w['keys']:>4} "
                       f"{w['sandboxes']:>9}  {_when(w['created_at'])}{gone}")

    @ws_app.command("create")
    def ws_create(
        name: Annotated[str, typer.Argument(help="Its name: ^[a-z0-9-]{1,64}$.")],
        limit: Annotated[list[str] | None, typer.Option(
            "--limit", help="A maximum, NAME=N (max_sandboxes, max_vcpus, ...); repeatable.")
        ] = None,
        json_: JsonOut = False, api_url: ApiUrl = None, api_key: ApiKey = None,
    ) -> None:
        """Make a workspace; its first key is printed (stdout) this once (admin)."""
        limits: dict[str, int] = {}
        for item in limit or []:
            k, sep, v = item.partition("=")
            if not sep or not v.strip().isdigit():
                typer.echo(f"error: invalid_argument: --limit {item!r}: want NAME=N", err=True)
                raise typer.Exit(2)
            limits[k.strip()] = int(v)
        with Workspace(api_url=api_url, api_key=api_key) as ws:
            w = ws.create_workspace(name, limits=limits)
        if json_:
            _json(w)
            return
        typer.echo(w["key"])
        typer.echo(f"workspace {w['id']} ({w['name']}) made; its key is above", err=True)

    @ws_app.command("rm")
    def ws_rm(
        workspace_id: Annotated[str, typer.Argument(metavar="ID", help="The workspace's id.")],
        yes: Annotated[bool, typer.Option(
            "--yes", help="Do it (it kills the workspace's sandboxes).")] = False,
        api_url: ApiUrl = None, api_key: ApiKey = None,
    ) -> None:
        """Delete a workspace (admin): keys revoked, sandboxes killed, paused snapshots
        removed; its usage and audit records are kept."""
        if not yes:
            typer.echo("error: invalid_argument: deleting a workspace kills its sandboxes; "
                       "say --yes", err=True)
            raise typer.Exit(2)
        with Workspace(api_url=api_url, api_key=api_key) as ws:
            d = ws.delete_workspace(workspace_id)
        typer.echo(f"deleted workspace {d['id']} ({d['name']}): {d['keys_revoked']} key(s) "
                   f"revoked, {len(d['sandboxes_killed'])} sandbox(es) killed", err=True)
