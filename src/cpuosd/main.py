"""``cpuosd``: run the daemon (``cpuosd [--host H] [--port P] [--home DIR] [--role R]``),
print its configuration (``cpuosd config``), drain a node (``cpuosd drain``), or administer
templates on this host (``cpuosd template build|ls|rm``, see cpuosd.templates.admin)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from .config import Config, ConfigError, effective


def load_config(home: str | None = None, host: str | None = None,
                port: int | None = None, role: str | None = None) -> Config:
    """The configuration of this process's environment, with the command line's overrides;
    a bad value: a one-line error and exit status 2."""
    try:
        cfg = Config.from_env()
    except ConfigError as e:
        print(f"cpuosd: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    changes: dict[str, object] = {}
    if home:
        changes["home"] = Path(home)
    if host:
        changes["host"] = host
    if port:
        changes["port"] = port
    if role:
        changes["cluster"] = dataclasses.replace(cfg.cluster, role=role)
    return cfg.replace(**changes) if changes else cfg


def serve(host: str | None = None, port: int | None = None, home: str | None = None,
          log_file: str | None = None, role: str | None = None) -> None:
    import uvicorn

    from . import diagnose, homedir, logs
    from .api.app import create_app

    homedir.private_umask()  # before anything is opened (finding 9: SQLite's side files)
    diagnose.install()  # SIGUSR1 / SIGUSR2: threads' and tasks' stacks to stderr

    cfg = load_config(home, host, port, role)
    if cfg.cluster.role == "api":  # (no sandboxes here: needs no root)
        serve_api(cfg, log_file)
        return
    if os.geteuid() != 0:
        print("cpuosd: must run as root (runsc checkpoint/restore and cgroups need it)",
              file=sys.stderr)
        raise SystemExit(2)
    logs.setup(path=log_file, cfg=cfg.logs)  # JSON lines, rate-limited, rotated
    # descriptors: the soft limit up to the hard one (root: 65536 at least), half of it kept
    # in reserve for the daemon itself (cpuosd.fdbudget)
    from .api.listener import guarded_http
    from .fdbudget import raise_nofile

    raise_nofile(conn_fds=cfg.limits.conn_fds)
    try:
        app = create_app(cfg)  # (--role=node: its id and token are checked here)
    except ValueError as e:
        print(f"cpuosd: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning",
                log_config=None, access_log=False, timeout_graceful_shutdown=5,
                http=guarded_http(cfg.api), limit_concurrency=cfg.api.max_connections + 1,
                timeout_keep_alive=int(cfg.api.keepalive))


def show_config(argv: list[str]) -> int:
    """``cpuosd config [--home DIR] [--json]``: the effective configuration (every declared
    variable, its value here, what it does; secrets masked)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="cpuosd config")
    ap.add_argument("--home", help="state directory (default $CPUOS_HOME or /var/lib/cpuos)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = effective(load_config(a.home))
    if a.json:
        print(json.dumps({name: value for name, value, _ in rows}, indent=2))
        return 0
    width = max(len(name) for name, _, _ in rows)
    for name, value, doc in rows:
        print(f"{name:<{width}}  {value or '-'}  # {doc}")
    return 0


def serve_api(cfg: Config, log_file: str | None) -> None:
    """``cpuosd --role=api``: the public API forwarded to the nodes (cpuosd.cluster.api)."""
    import uvicorn

    from . import logs
    from .api.listener import guarded_http
    from .cluster.api import create_api_app, tune_malloc
    from .fdbudget import raise_nofile

    logs.setup(path=log_file, cfg=cfg.logs)
    tune_malloc()
    raise_nofile(conn_fds=cfg.limits.conn_fds)
    try:
        app = create_api_app(cfg)
    except ValueError as e:
        print(f"cpuosd: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", log_config=None,
                access_log=False, timeout_graceful_shutdown=5, http=guarded_http(cfg.api),
                limit_concurrency=cfg.api.max_connections + 1,
                timeout_keep_alive=int(cfg.api.keepalive))


def drain_self(argv: list[str]) -> int:
    """``cpuosd drain``: on a node (its preStop hook, deploy/kubernetes), cordon it and
    pause every sandbox running there into the snapshot store, through its own API
    (CPUOS_PORT, CPUOS_NODE_TOKEN)."""
    import json

    import httpx

    cfg = load_config()
    token = cfg.cluster.node_token
    if not token:
        print("cpuosd drain: CPUOS_NODE_TOKEN is not set (a node's token)", file=sys.stderr)
        return 2
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    try:
        r = httpx.post(f"http://{host}:{cfg.port}/node/drain", timeout=httpx.Timeout(
            10.0, read=None), headers={"X-Cpuos-Node-Token": token})
    except httpx.HTTPError as e:
        print(f"cpuosd drain: the node did not answer: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"cpuosd drain: {r.status_code}: {r.text[:300]}", file=sys.stderr)
        return 1
    out = r.json()
    print(json.dumps(out) if "--json" in argv else
          f"{out['node']}: {len(out['paused'])} paused, {len(out['failed'])} failed")
    return 0 if not out["failed"] else 1


def audit_verify(argv: list[str]) -> int:
    """``cpuosd audit verify [--home DIR] [--json]``: the host-side check of the audit chain
    (the daemon need not run): the database and key on disk; with CPUOS_DATABASE_URL the
    chain every node appends to in Postgres (as ``GET /audit/verify``), with the key
    (CPUOS_AUDIT_KEY_FILE) and this home's ``audit.head`` (the row its node last wrote)."""
    import argparse
    import json

    from . import homedir
    from .accounting.audit import read_head, verify_database, verify_file

    homedir.private_umask()  # reading WAL databases may create their -shm file
    ap = argparse.ArgumentParser(prog="cpuosd audit verify")
    ap.add_argument("--home", help="state directory (default $CPUOS_HOME or /var/lib/cpuos)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cfg = load_config(a.home)
    try:  # (the key is only read: a verifier never makes one)
        key_text = cfg.audit_key_path.read_text().strip()
    except OSError as e:
        print(f"cpuosd audit verify: no audit key at {cfg.audit_key_path}: {e.strerror}",
              file=sys.stderr)
        return 2
    if cfg.cluster.database_url:
        out = verify_database(cfg.cluster.database_url, bytes.fromhex(key_text),
                              read_head(cfg.home / "audit.head"))
    else:
        out = verify_file(cfg.home, cfg.audit_key_path)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for p in out["problems"]:
            print(f"seq {p['seq']}: {p['problem']}"
                  + (f" (sandbox {p['sandbox']})" if p.get("sandbox") else ""))
        print(f"{'ok' if out['ok'] else 'BROKEN'}: {out['rows']} rows checked, "
              f"{out['problem_count']} problem(s); head seq {out['head']['seq']}")
    return 0 if out["ok"] else 1


def main(argv: list[str] | None = None) -> None:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["template"]:
        from .templates.admin import main as template_main

        raise SystemExit(template_main(argv[1:]))
    if argv[:2] == ["audit", "verify"]:
        raise SystemExit(audit_verify(argv[2:]))
    if argv[:1] == ["config"]:
        raise SystemExit(show_config(argv[1:]))
    if argv[:1] == ["drain"]:
        raise SystemExit(drain_self(argv[1:]))
    ap = argparse.ArgumentParser(prog="cpuosd", description="the cpuos daemon "
                                 "(`cpuosd template --help`: template administration; "
                                 "`cpuosd config`: the effective configuration)")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--home", help="state directory (default $CPUOS_HOME or /var/lib/cpuos)")
    ap.add_argument("--log-file", help="log here, rotated by size (default $CPUOS_LOG_FILE, "
                                       "else stderr)")
    ap.add_argument("--role", choices=("all", "node", "api"),
                    help="all: one host (the default, $CPUOS_ROLE); node: runs sandboxes "
                         "for API processes; api: the public API, forwarded to the nodes "
                         "(docs/DEPLOY.md)")
    a = ap.parse_args(argv)
    serve(a.host, a.port, a.home, a.log_file, a.role)


if __name__ == "__main__":
    main()
