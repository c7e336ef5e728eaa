"""``cpuos audit ID [--follow] [--json]`` (a sandbox's audit trail) and ``cpuos audit verify``
(the daemon's check of the whole hash chain)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer

from .._sync.sandbox import _SyncHTTP
from ._options import ApiKey, ApiUrl



def _summary(row: dict[str, Any]) -> str:
    d, k = row.get("detail") or {}, row.get("kind")
    if k == "command":
        what = d.get("shell") if "shell" in d else " ".join(map(str, d.get("argv") or []))
        if d.get("source") == "api":
            return f"[api] {what}  -> exit {d.get('exit_code')} in {d.get('duration')}s"
        return f"[pid {d.get('pid')} uid {d.get('uid')}] {what}"
    if k == "file_write":
        if d.get("source") == "api":
            return f"[api] {d.get('path')} {d.get('size')} B sha256 {d.get('sha256')}"
        return f"[pid {d.get('pid')} {d.get('process')}] {d.get('path')} " \
               f"{','.join(d.get('flags') or [])}"
    if k == "lifecycle" and "to" in d:
        why = f" ({d['reason']})" if d.get("reason") else ""
        return f"{d.get('from')} -> {d.get('to')}{why}"
    if k == "connection":
        return f"{d.get('verdict')} {d.get('proto')} {d.get('name') or d.get('dst')}:" \
               f"{d.get('port')}"
    return json.dumps(d, sort_keys=True)


def _print(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(row, separators=(",", ":")) + "\n")
    else:
        t = time.strftime("%H:%M:%S", time.localtime(row["time"]))
        typer.echo(f"{row['seq']:>8} {t} {row['kind']:<10} {_summary(row)}")
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    @app.command("audit")
    def audit(
        sandbox_id: Annotated[str, typer.Argument(
            metavar="ID", help="Sandbox id, or `verify` to check the whole chain.")],
        follow: Annotated[bool, typer.Option("--follow", "-f",
                                             help="Keep printing rows as they come.")] = False,
        json_: Annotated[bool, typer.Option("--json", help="JSON lines (one row each).")
                         ] = False,
        kind: Annotated[list[str] | None, typer.Option(
            "--kind", help="Only this kind (repeatable): command, file_write, connection, "
                           "lifecycle, limit, port, dropped.")] = None,
        since: Annotated[str | None, typer.Option(help="From this time (epoch s or ISO).")
                         ] = None,
        until: Annotated[str | None, typer.Option(help="Before this time.")] = None,
        api_url: ApiUrl = None, api_key: ApiKey = None,
    ) -> None:
        """What happened in a sandbox: commands (through the API and inside), file writes,
        connections, lifecycle, limits, ports. `cpuos audit verify` checks the chain."""
        http = _SyncHTTP(api_url, api_key)
        try:
            if sandbox_id == "verify":
                out = http.request("GET", "/audit/verify")
                if json_:
                    sys.stdout.write(json.dumps(out, indent=2) + "\n")
                else:
                    for p in out["problems"]:
                        typer.echo(f"seq {p['seq']}: {p['problem']}"
                                   + (f" (sandbox {p['sandbox']})" if p.get("sandbox") else ""))
                    head = out.get("head")
                    if head is None:  # not the admin: this workspace's part of the chain
                        typer.echo(f"{'ok' if out['ok'] else 'BROKEN'} for this workspace's "
                                   f"sandboxes: {out['problem_count']} problem(s)")
                    else:
                        typer.echo(f"{'ok' if out['ok'] else 'BROKEN'}: {out['rows']} rows "
                                   f"checked, {out['problem_count']} problem(s); head seq "
                                   f"{head['seq']} {head['hash']}")
                if not out["ok"]:
                    raise typer.Exit(1)
                return
            params: dict[str, Any] = {"kind": kind or [], "limit": 10000}
            if since:
                params["since"] = since
            if until:
                params["until"] = until
            after = 0
            while True:
                r = http.request("GET", f"/sandboxes/{sandbox_id}/audit",
                                 params={**params, "after": after,
                                         "wait": 10 if follow else 0})
                for row in r["rows"]:
                    _print(row, json_)
                after = r["next_after"]
                if not r["rows"] and not follow:
                    return
        except KeyboardInterrupt:
            return
        finally:
            http.close()

