"""Templates over the API: list, inspect, build (the log streamed back), remove.

A build runs as its own process, ``cpuosd template build --events`` (cpuosd.templates.admin),
whose steps run in runsc sandboxes (cpuosd.templates.stepbox). Their network is a namespace
the daemon attaches to its own network for the build, as it does a sandbox's, with the
policy ``CPUOS_BUILD_NETWORK`` (off | on | allowlist | names, comma-separated; default:
``allowlist``, the package registries, unless the daemon's CPUOS_DEFAULT_NETWORK is ``off``,
then ``off``): deny sets, resolver and egress proxy included; each connection is a line of
the build's log (``net: ...``). It is detached when the build ends.
The build process is
spawned and owned by cpuosd.procs: it can be ended (SIGTERM: its mounts undone, its half-made
tree removed) when the client goes away, when it overruns ``CPUOS_TEMPLATE_BUILD_TIMEOUT``,
or when the daemon stops, and the daemon's own reaper never touches its children. One build
runs at a time (they are heavy; a second gets 409).

``POST /templates/build`` takes the source in the query (``builtin=python``, or ``file=`` a
spec or Dockerfile inside the uploaded context, or ``oci=true``) and the body: nothing for a
built-in; a tar (optionally gzip) of the context directory for a spec or Dockerfile; the
image tarball for ``oci``. The body is streamed to ``$CPUOS_HOME/uploads/<random>`` under a
size cap and a free-space check, and removed when the build ends. The answer is 4xx before
anything is built if the source is bad (the spec is parsed first), else 200 and NDJSON:
``{"log": line}``... then ``{"result": info}`` or ``{"error": {code, message}}``; a stream
that ends without either was cut (the SDK raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import APIRouter, Query, Request

from cpuos_agent import tarx
from fastapi.responses import StreamingResponse

from ..config import Config
from ..errors import ApiError, invalid, not_found
from ..network.policy import Policy
from ..network.service import Network
from ..paths import ID_RE
from ..procs import Child, spawn
from ..store import ACTIVE_STATES
from ..templates.builder import disk_usage, list_templates, remove_template, template_info
from .deps import ManagerDep, NetworkDep, StoreDep, Ws, is_admin, require_admin, services_of

log = logging.getLogger("cpuosd.templates")
router = APIRouter()

NDJSON = "application/x-ndjson"
MAX_CONTEXT_FILES = 100_000
FREE_MARGIN = 1 << 30  # an upload never takes the disk below this
TERM_GRACE = 30.0  # s a build has to clean up after SIGTERM


MAX_NET_LINES = 1000  # connection lines of one build kept until they are sent


def build_policy(cfg: Config) -> Policy | None:
    """The build steps' egress policy (CPUOS_BUILD_NETWORK); None: no network."""
    raw = (cfg.builds.network or "").strip()
    if not raw:
        raw = "off" if cfg.network.default_policy == "off" else "allowlist"
    value: Any = raw if raw in ("off", "on", "allowlist") else {
        "allow": [n.strip() for n in raw.split(",") if n.strip()]}
    try:
        p = Policy.parse(value)
    except ApiError as e:
        raise ApiError("internal", f"CPUOS_BUILD_NETWORK={raw[:200]!r}: {e.message}") from None
    return None if p.mode == "off" else p


class BuildNet:
    """A build's network: a namespace attached to the daemon's network under the build's id,
    its connections kept as log lines for the build's stream."""

    def __init__(self, net: Network, build_id: str, netns: str) -> None:
        self.net, self.id, self.netns = net, build_id, netns
        self.lines: list[str] = []
        self.dropped = 0

    @classmethod
    async def attach(cls, net: Network, policy: Policy) -> BuildNet:
        build_id = "build-" + secrets.token_hex(6)
        slot = await net.attach(build_id, policy)
        bn = cls(net, build_id, slot.netns_path)
        net.taps[build_id] = bn.record
        return bn

    def record(self, sid: str, rec: dict[str, Any]) -> None:
        if len(self.lines) >= MAX_NET_LINES:
            self.dropped += 1
            return
        where = rec.get("name") or rec.get("dst") or "?"
        rule = f" ({rec['rule']})" if rec.get("rule") else ""
        self.lines.append(f"net: {rec.get('verdict', '?')} {rec.get('proto', 'tcp')} "
                          f"{where}:{rec.get('port', '?')}{rule}")

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        if self.dropped:
            out.append(f"net: ({self.dropped} more connection(s) not shown)")
            self.dropped = 0
        return out

    async def detach(self) -> None:
        try:
            await self.net.detach(self.id)
        finally:
            self.net.taps.pop(self.id, None)


class TemplateBuilds:
    """The running build (at most one) and the tasks ending builds whose clients left."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.current: str | None = None
        self.children: set[Child] = set()
        self.ending: set[asyncio.Task[None]] = set()
        self.net: BuildNet | None = None  # the running build's network

    def begin(self, what: str) -> None:
        if self.current is not None:
            raise ApiError("conflict", f"a template build is running ({self.current}); "
                                       "one at a time", {"building": self.current})
        self.current = what

    def end_later(self, child: Child | None, upload: Path | None) -> asyncio.Task[None]:
        """End a build from outside the request (which may be cancelled): SIGTERM, a grace
        period, SIGKILL; then its upload goes, and the next build may start."""
        t = asyncio.get_running_loop().create_task(self._end(child, upload))
        self.ending.add(t)
        t.add_done_callback(self.ending.discard)
        return t

    async def _end(self, child: Child | None, upload: Path | None) -> None:
        try:
            if child is not None:
                await stop_build(child)
                self.children.discard(child)
            if upload is not None:
                await asyncio.to_thread(shutil.rmtree, upload, True)
        finally:
            net, self.net = self.net, None
            self.current = None
            if net is not None:
                await net.detach()

    async def shutdown(self) -> None:
        for child in list(self.children):
            child.killpg(signal.SIGTERM)
        if self.ending:
            await asyncio.wait(list(self.ending), timeout=TERM_GRACE + 5)


async def stop_build(child: Child) -> None:
    if child.returncode is None:
        child.killpg(signal.SIGTERM)
        try:
            await child.wait(TERM_GRACE)
        except TimeoutError:
            log.warning("template build %d ignored SIGTERM; killing it", child.pid)
    child.killpg(signal.SIGKILL)  # what is left of its group (a no-op once collected)
    with contextlib.suppress(TimeoutError):
        await child.wait(10)


def _builds(request: Request) -> TemplateBuilds:
    return services_of(request.app).builds


def _check_name(name: str, what: str = "name") -> str:
    if not ID_RE.fullmatch(name):
        raise invalid(f"template {what} must match ^[a-z0-9-]{{1,64}}$", field=what)
    return name


# what of a template's record is the host's business (where it lives on the host's disk,
# the file it was made from): shown to the admin only
HOST_FIELDS = ("rootfs", "tarball")


def _shown(info: dict[str, Any], admin: bool) -> dict[str, Any]:
    return info if admin else {k: v for k, v in info.items() if k not in HOST_FIELDS}


@router.get("/templates")
async def list_(request: Request, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    """The templates built on the daemon's host (host paths for the admin only)."""
    tdir = mgr.cfg.templates_dir
    items = await asyncio.to_thread(lambda: list_templates(tdir) if tdir.is_dir() else [])
    for i in items:
        if not i.get("size_bytes"):
            i["size_bytes"] = await asyncio.to_thread(disk_usage, Path(i["rootfs"]))
    admin = is_admin(request, ws)
    return {"templates": [_shown(i, admin) for i in items]}


@router.get("/templates/{name}")
async def get(name: str, request: Request, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    info = template_info(mgr.cfg.templates_dir, _check_name(name))
    if info is None:
        raise not_found("template", name)
    return _shown(info, is_admin(request, ws))


@router.delete("/templates/{name}")
async def remove(name: str, request: Request, mgr: ManagerDep, store: StoreDep, ws: Ws,
                 force: bool = Query(False, description="remove even while sandboxes of this "
                                                        "template are alive (they may break)")
                 ) -> dict[str, Any]:
    require_admin(request, ws)
    _check_name(name)
    if template_info(mgr.cfg.templates_dir, name) is None:
        raise not_found("template", name)
    users = [r.id for r in store.list_sandboxes(None, ACTIVE_STATES)
             if r.template == name]
    if users and not force:
        raise ApiError("conflict", f"{len(users)} sandbox(es) of template {name!r} are alive; "
                                   "kill them first, or remove with force=true",
                       {"sandboxes": users[:50]})
    images = await mgr.forget_template(name)
    gone = await asyncio.to_thread(remove_template, mgr.cfg.templates_dir, name)
    return {"removed": name, "paths": len(gone), "snapshot_images": images}


@router.post("/templates/build", responses={200: {"content": {NDJSON: {}}}})
async def build(
    request: Request, net: NetworkDep, ws: Ws,
    builtin: str | None = Query(None, description="a built-in template: python, node, devbox"),
    file: str | None = Query(None, description="the spec (TOML) or Dockerfile inside the "
                                               "uploaded context (a tar, optionally gzip)"),
    oci: bool = Query(False, description="the body is an image tarball (docker save, OCI)"),
    name: str | None = Query(None, description="the template's name (needed with oci)"),
    force: bool = Query(False, description="rebuild even if this exact build is cached"),
) -> StreamingResponse:
    require_admin(request, ws)
    if sum([builtin is not None, file is not None, oci]) != 1:
        raise invalid("give one of builtin=NAME, file=PATH (with a context tar) or oci=true")
    if name is not None:
        _check_name(name)
    if oci and name is None:
        raise invalid("oci=true needs name=", field="name")
    builds = _builds(request)
    builds.begin(name or builtin or file or "oci")
    upload: Path | None = None
    child: Child | None = None
    try:
        argv = [sys.executable, "-m", "cpuosd", "template", "build", "--events"]
        if builtin is not None:
            argv.append(_check_name(builtin, "builtin"))
        else:
            upload = builds.cfg.home / "uploads" / secrets.token_hex(8)
            upload.mkdir(parents=True, mode=0o700)
            body = upload / "body"
            await _receive(request, body, builds.cfg.builds.max_upload)
            if oci:
                argv += ["--oci", str(body)]
            else:
                assert file is not None
                ctx = upload / "context"
                await asyncio.to_thread(_extract_context, body, ctx,
                                        builds.cfg.builds.max_upload)
                body.unlink()
                argv.append(str(ctx / _context_path(file, ctx)))
        if name is not None:
            argv += ["--name", name]
        if force:
            argv.append("--force")
        policy = build_policy(builds.cfg) if not oci else None  # (an image runs no steps)
        if net is not None and policy is not None:
            builds.net = await BuildNet.attach(net, policy)
            argv += ["--netns", builds.net.netns]
        child, lines = await _start(argv, builds.cfg)
        builds.children.add(child)
        first = await _first_event(lines, _hidden(upload))
    except BaseException:
        # a refused build is over before its answer goes out (the next may start at once);
        # the ending survives this request being cancelled
        await asyncio.shield(builds.end_later(child, upload))
        raise
    return StreamingResponse(_relay(first, lines, child, upload, builds, builds.net),
                             media_type=NDJSON,
                             headers={"Cache-Control": "no-store"})


async def _receive(request: Request, dest: Path, limit: int) -> None:
    """The body to ``dest``, streamed: at most ``limit`` bytes (CPUOS_MAX_TEMPLATE_UPLOAD),
    and never below FREE_MARGIN of free space on the daemon's disk."""
    declared = request.headers.get("content-length")
    free = shutil.disk_usage(dest.parent).free
    if declared and declared.isdigit():
        if int(declared) > limit:
            raise ApiError("too_large", f"upload of {declared} bytes is over the limit of "
                                        f"{limit}", {"limit": limit})
        if int(declared) > free - FREE_MARGIN:
            raise ApiError("no_space", f"not enough free space for a {declared}-byte upload",
                           {"free": free})
    n = 0
    with open(dest, "wb") as f:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError("too_large", f"upload over the limit of {limit} bytes",
                               {"limit": limit})
            if n % (64 << 20) < len(chunk) and \
                    shutil.disk_usage(dest.parent).free < FREE_MARGIN:
                raise ApiError("no_space", "the daemon's disk is nearly full", {})
            f.write(chunk)
    if n == 0:
        raise invalid("the body is empty: send the context tar or the image tarball")


def _context_path(file: str, ctx: Path) -> str:
    p = PurePosixPath(file)
    if not file or p.is_absolute() or ".." in p.parts or "\0" in file:
        raise invalid("file must be a relative path inside the context", field="file")
    if not (ctx / p).is_file():
        raise invalid(f"{file!r} is not a file in the uploaded context", field="file")
    return str(p)


def _extract_context(tar_path: Path, dest: Path, limit: int) -> None:
    """A context tar into ``dest``: directories and regular files only. A symlink, a hard
    link, a device or FIFO, an absolute name or ``..`` refuses the whole context (422
    naming the entry) before anything is written; bounded in entries and in bytes
    unpacked; written beneath ``dest`` without following any link (cpuos_agent.tarx). Our
    own checks, not tarfile's extraction filters: whether those hold depends on the
    interpreter's patch level (the ``data`` filter of Python 3.11.7, which the set-up's
    pyenv interpreter is, has the CVE-2025-4517 bypass; Debian 12's 3.11.2 has no filters
    at all)."""
    dest.mkdir(mode=0o700)
    try:
        with tarfile.open(tar_path, "r:*") as tf:
            try:
                members = tarx.check_members(tf, links=False, max_members=MAX_CONTEXT_FILES,
                                             max_bytes=limit)
            except tarx.TooBig:
                raise invalid(f"the context is too big (over {limit} bytes unpacked)"
                              ) from None
            except tarx.Refused as e:
                raise invalid(f"the context was refused, nothing written: {e}") from None
            total = sum(m.size for m, _ in members if m.isreg())
            if shutil.disk_usage(dest).free < FREE_MARGIN + total:
                raise ApiError("no_space", "not enough free space to unpack the context")
            tarx.extract_members(tf, members, str(dest), dir_mode=0o755)
    except tarfile.TarError as e:
        raise invalid(f"the context is not a valid tar: {e}") from None


async def _start(argv: list[str], cfg: Config) -> tuple[Child, asyncio.StreamReader]:
    r, w = os.pipe()
    env = dict(os.environ, CPUOS_HOME=str(cfg.home), CPUOS_TEMPLATES_DIR=str(cfg.templates_dir))
    try:
        child = spawn(argv, stdout=w, stderr=w, env=env)
    finally:
        os.close(w)
    reader = asyncio.StreamReader(limit=1 << 20)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                 os.fdopen(r, "rb", 0))
    return child, reader


def _hidden(upload: Path | None) -> tuple[bytes, ...]:
    """The daemon's paths of an upload's context, as the build's messages may name them
    (``<upload>/context/Dockerfile:3``): the client is told ``Dockerfile:3``."""
    if upload is None:
        return ()
    ctx = upload / "context"
    return tuple({(str(p) + "/").encode() for p in (ctx, ctx.resolve())})


async def _event(lines: asyncio.StreamReader, hide: tuple[bytes, ...] = ()
                 ) -> dict[str, Any] | None:
    """The build's next event (a line that is not one of its JSON events is a log line),
    with the daemon's paths in ``hide`` taken out; None at the end of its output."""
    try:
        raw = await lines.readline()
    except (ValueError, asyncio.LimitOverrunError):  # an endless line: skip what is buffered
        raw = await lines.read(1 << 20)
        for h in hide:
            raw = raw.replace(h, b"")
        return {"log": raw[:4000].decode(errors="replace")}
    if not raw:
        return None
    for h in hide:
        raw = raw.replace(h, b"")
    try:
        ev = json.loads(raw)
    except ValueError:
        ev = None
    if isinstance(ev, dict) and len(ev) == 1 and next(iter(ev)) in (
            "started", "log", "result", "error"):
        return ev
    return {"log": raw.decode(errors="replace").rstrip("\n")}


async def _first_event(lines: asyncio.StreamReader, hide: tuple[bytes, ...] = ()
                       ) -> dict[str, Any]:
    """Up to the build's ``started``: an error before it (a bad spec, a bad image) is the
    request's error (4xx), not a line in a 200 stream."""
    seen: list[str] = []
    async with asyncio.timeout(120):
        while True:
            ev = await _event(lines, hide)
            if ev is None:
                raise ApiError("internal", "the template build ended before it started: "
                               + " | ".join(seen[-5:]))
            if "error" in ev:
                e = ev["error"]
                raise ApiError(str(e.get("code") or "internal"), str(e.get("message")))
            if "started" in ev:
                return ev
            seen.append(str(ev.get("log", ""))[:300])


async def _relay(first: dict[str, Any], lines: asyncio.StreamReader, child: Child,
                 upload: Path | None, builds: TemplateBuilds, net: BuildNet | None
                 ) -> AsyncIterator[bytes]:
    last: dict[str, Any] | None = None
    ended = False

    def net_lines() -> bytes:
        return b"".join((json.dumps({"log": x}) + "\n").encode()
                        for x in (net.take() if net is not None else ()))

    hide = _hidden(upload)
    try:
        yield (json.dumps(first) + "\n").encode()
        try:
            async with asyncio.timeout(builds.cfg.builds.timeout):
                while True:
                    ev = await _event(lines, hide)
                    if ev is None:
                        break
                    if "result" in ev or "error" in ev:
                        last = ev  # sent once the build has ended (see below)
                        continue
                    yield net_lines() + (json.dumps(ev, default=str) + "\n").encode()
        except TimeoutError:
            last = {"error": {"code": "timeout", "message": f"the template build overran "
                              f"{builds.cfg.builds.timeout:.0f}s; stopped"}}
        # the build has ended (or is ended now) and its upload is gone before the client
        # hears the outcome: a build right after it is not refused as concurrent
        ended = True
        await builds.end_later(child, upload)
        yield net_lines()
        if last is None:
            last = {"error": {"code": "internal", "message": "the template build exited "
                              f"with status {child.returncode} without a result"}}
        yield (json.dumps(last, default=str) + "\n").encode()
    finally:  # the client went away: the build is stopped, its upload removed
        if not ended:
            builds.end_later(child, upload)
