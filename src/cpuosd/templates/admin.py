"""``cpuosd template build|ls|rm``: template administration on the daemon's host.

Run by hand (``scripts/setup.sh`` builds the ``python`` template this way, before any
daemon runs) and by the daemon itself for ``POST /templates/build``. Build steps run in
runsc sandboxes either way; by hand they have no network (the built-in templates' steps need
none), through the daemon they reach the package registries through its egress proxy.
With ``--events`` the build writes one JSON object a line on stdout (the wire format of that
route):

    {"started": {"name", "source"}}    the spec parsed and checked; the build begins
    {"log": "a line of build output"}  any number
    {"result": {...template info}}     last, on success
    {"error": {"code", "message"}}     last, on failure

SIGTERM ends a build cleanly (its step's sandbox ended, the half-built tree removed): the daemon
sends it when the client goes away or the build overruns.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ..config import Config, ConfigError
from .builder import TemplateError, build, build_from_oci, disk_usage, list_templates, \
    remove_template
from .spec import TemplateSpec

Emit = Callable[[dict[str, Any]], None]


def _emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds: the builder's finally blocks clean up


def run_build(args: argparse.Namespace, emit: Emit) -> int:
    try:
        cfg = Config.from_env()
    except ConfigError as e:
        emit({"error": {"code": "invalid_argument", "message": str(e)}})
        return 1
    tdir = cfg.templates_dir
    try:
        if args.oci is not None:
            if not args.name:
                raise TemplateError("--oci needs --name")
            emit({"started": {"name": args.name, "source": "oci"}})
            info = build_from_oci(args.oci, args.name, tdir, force=args.force,
                                  on_line=lambda line: emit({"log": line}))
        else:
            spec = TemplateSpec.load(args.source, name=args.name)
            emit({"started": {"name": spec.name, "source": "spec"}})
            info = build(spec, tdir, force=args.force, on_line=lambda line: emit({"log": line}),
                         netns=args.netns, cfg=cfg)
    except TemplateError as e:
        emit({"error": {"code": "invalid_argument", "message": str(e)}})
        return 1
    except OSError as e:
        emit({"error": {"code": "internal", "message": f"template build failed: {e}"}})
        return 1
    emit({"result": info})
    return 0


def _human(args: argparse.Namespace) -> int:
    """The same build for a person at a terminal: log lines as they come, then a summary."""
    t0 = time.monotonic()
    result: dict[str, Any] = {}

    def emit(ev: dict[str, Any]) -> None:
        if "log" in ev:
            print(ev["log"], flush=True)
        elif "error" in ev:
            print(f"error: template: {ev['error']['message']}", file=sys.stderr)
        elif "result" in ev:
            result.update(ev["result"])

    rc = run_build(args, emit)
    if rc == 0:
        how = "cached" if result.get("cached") else f"built in {time.monotonic() - t0:.0f}s"
        print(f"template {result['name']} {result['digest']}: {how} ({result['rootfs']})")
    return rc


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="cpuosd template",
                                 description="build, list and remove templates on this host")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a template (a built-in name, a TOML spec, a "
                                     "Dockerfile, or --oci TARBALL)")
    b.add_argument("source", nargs="?", help="built-in name, spec file or Dockerfile")
    b.add_argument("--oci", type=Path, metavar="TARBALL")
    b.add_argument("--name")
    b.add_argument("--force", action="store_true")
    b.add_argument("--events", action="store_true",
                   help="JSON events on stdout, one a line (the daemon's build route)")
    b.add_argument("--netns", metavar="PATH",
                   help="the network namespace the build steps' sandboxes run in (the daemon "
                        "attaches one to its egress proxy for a build); default: none, the "
                        "steps have no network")
    sub.add_parser("ls", help="the templates built here, as JSON")
    r = sub.add_parser("rm", help="delete a template's builds")
    r.add_argument("name")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        if (a.source is None) == (a.oci is None):
            ap.error("give a SOURCE or --oci TARBALL (one of them)")
        signal.signal(signal.SIGTERM, _on_term)
        return run_build(a, _emit_json) if a.events else _human(a)
    try:
        tdir = Config.from_env().templates_dir
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.cmd == "ls":
        items = list_templates(tdir) if tdir.is_dir() else []
        for i in items:
            i.setdefault("size_bytes", disk_usage(Path(i["rootfs"])))
        print(json.dumps(items, indent=2, default=str))
        return 0
    try:
        gone = remove_template(tdir, a.name)
    except TemplateError as e:
        print(f"error: template: {e}", file=sys.stderr)
        return 1
    if not gone:
        print(f"error: not_found: no template {a.name!r} in {tdir}", file=sys.stderr)
        return 1
    print(f"removed {len(gone)} path(s) of template {a.name}")
    return 0
