"""The HTTP API (FastAPI). OpenAPI at /openapi.json.

Every route but /health needs ``Authorization: Bearer <key>``; a key sees only
its own workspace (another workspace's sandbox is a 404). Errors are
``{"error": {"code", "message", "details"}}`` with the matching status.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import re
import shutil
import time
from dataclasses import asdict
from functools import partial
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpuos_agent import protocol as P
from cpuos_agent.protocol import parse_duration

from .auth import Guard, Ws, bearer_key, is_admin, require_admin
from .browser import router as browser_router
from .interp import router as interp_router
from .templates import TemplateBuilds, router as templates_router
from .audit import router as audit_router, start_audit
from ..accounting.trace import Traced
from .commands import router as commands_router
from .pty import router as pty_router
from .dirs import router as dirs_router
from .streams import MaxBytesQ
from .usage import router as usage_router, sandbox_metrics
from .workspaces import router as workspaces_router
from ..proxy.preview import Preview
from .. import e2b as e2b_surface
from ..backends.microvm.selection import BackendUnavailable, select_backend
from .. import homedir
from ..config import Config
from ..accounting.quotas import Limits, check_limits_body
from ..accounting.usage import Enforcer, Meter
from ..errors import ApiError, invalid, not_found
from ..events import EventBus, SandboxEvent, log_event
from ..backends.base import Backend
from ..network.backend import Networked
from ..network.policy import Policy
from ..network.secrets import stored_names
from ..network.service import Network, RecordWriter
from ..paths import ID_RE, check_path
from .streams import file_response
from .schemas import document
from ..procs import become_subreaper
from ..lifecycle.manager import Manager
from ..store import ACTIVE_STATES, LIVE_STATES, SandboxRow, Store, open_store

log = logging.getLogger("cpuosd.api")
VERSION = "0.1.0"
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


# ---- request models ---------------------------------------------------------------------
def _duration(v: Any, what: str) -> float:
    try:
        return parse_duration(v, what)
    except ValueError as e:
        raise ValueError(str(e)) from None


MAX_IDLE_TIMEOUT = 24 * 3600.0


def idle_duration(v: Any, what: str = "idle_timeout") -> float:
    """An idle timeout: a duration, or 0 (``0``, ``"0"``, ``"0s"``): never."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
        return 0.0
    if isinstance(v, str) and v.strip().lower() in ("0", "0s", "0m", "never"):
        return 0.0
    secs = _duration(v, what)
    if secs > MAX_IDLE_TIMEOUT:
        raise ValueError(f"{what}: at most {MAX_IDLE_TIMEOUT:.0f}s (or 0: never)")
    return secs


def _check_env(v: dict[str, str]) -> dict[str, str]:
    if len(v) > 256:
        raise ValueError("at most 256 environment variables")
    for k, val in v.items():
        if not ENV_KEY.fullmatch(k):
            raise ValueError(f"bad environment variable name {k[:80]!r}")
        if "\x00" in val or len(val) > 32768:
            raise ValueError(f"bad value for environment variable {k}")
    return v


class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid")
    template: str = "python"
    timeout: float | str = 300.0
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    env: dict[str, str] = Field(default_factory=dict)
    vcpus: int | None = Field(None, ge=1, le=64, description="default: the workspace's "
                              "default_vcpus, else the daemon's (2)")
    memory_mib: int | None = Field(None, ge=128, le=262144, description="default: the "
                                   "workspace's default_memory_mib, else 2048")
    disk_mib: int | None = Field(None, ge=64, le=1 << 22, description=(
        "MiB the root filesystem's writable layer may hold (ENOSPC inside past it); "
        "default: the workspace's default_disk_mib, else CPUOS_DEFAULT_DISK_MIB"))
    pids: int | None = Field(None, ge=16, le=1 << 22, description=(
        "processes and threads the sandbox's commands may have; default: the "
        "workspace's default_pids, else CPUOS_DEFAULT_PIDS"))
    on_timeout: Literal["kill", "pause"] = "kill"
    idle_timeout: float | str | None = Field(None, description=(
        "pause it after this long idle: no call needing the machine, no open stream or "
        "preview connection, no CPU use inside (0: never; default: the workspace's "
        "default_idle_timeout, else CPUOS_IDLE_TIMEOUT, 10m); any such call resumes it"))
    network: str | dict[str, Any] | None = Field(None, description=(
        "egress policy: off | on | allowlist | {\"allow\": [\"pypi.org\", "
        "\"*.github.com\"]} (default: the daemon's CPUOS_DEFAULT_NETWORK)"))
    wake_on_request: bool = Field(True, description="a request to an exposed port of the "
                                  "paused sandbox resumes it")
    secrets: dict[str, Any] | None = Field(None, description=(
        "{NAME: {\"value\": \"...\", \"hosts\": [\"api.example.com\"]}}: NAME in the "
        "sandbox is a placeholder; the egress proxy puts the value in the headers of "
        "requests to those hosts only"))

    @field_validator("template")
    @classmethod
    def _t(cls, v: str) -> str:
        if not ID_RE.fullmatch(v):
            raise ValueError("template name must match ^[a-z0-9-]{1,64}$")
        return v

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float:
        return _duration(v, "timeout")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("idle_timeout")
    @classmethod
    def _idle(cls, v: Any) -> float | None:
        return None if v is None else idle_duration(v)


class ExposePort(BaseModel):
    model_config = ConfigDict(extra="forbid")
    port: int = Field(ge=1, le=65535)
    public: bool | None = Field(None, description="no token needed (default: as it was, "
                                "else false)")


class WorkspaceSettings(BaseModel):
    """Only the settings named in the body change; null removes one (back to the
    daemon's default)."""
    model_config = ConfigDict(extra="forbid")
    default_network: str | dict[str, Any] | None = None
    spending_cap: float | None = Field(None, ge=0, description=(
        "USD per calendar month (UTC); at it, create and resume are refused (402) and "
        "running sandboxes are paused"))
    default_vcpus: int | None = Field(None, ge=1, le=64)
    default_memory_mib: int | None = Field(None, ge=128, le=262144)
    default_disk_mib: int | None = Field(None, ge=64, le=1 << 22)
    default_pids: int | None = Field(None, ge=16, le=1 << 22)
    default_idle_timeout: float | str | None = Field(None, description=(
        "idle timeout of its sandboxes that name none (0: never; unset: the daemon's "
        "CPUOS_IDLE_TIMEOUT, 10m)"))

    @field_validator("default_idle_timeout")
    @classmethod
    def _idle(cls, v: Any) -> float | None:
        return None if v is None else idle_duration(v, "default_idle_timeout")


class SetNetwork(BaseModel):
    model_config = ConfigDict(extra="forbid")
    network: str | dict[str, Any]


class SetTimeout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float | str | None = Field(None, description="kill (or pause) it this long "
                                        "from now")
    idle_timeout: float | str | None = Field(None, description="its new idle timeout, from "
                                             "now (0: never)")

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float | None:
        return None if v is None else _duration(v, "timeout")

    @field_validator("idle_timeout")
    @classmethod
    def _idle(cls, v: Any) -> float | None:
        return None if v is None else idle_duration(v)


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str | list[str] = Field(description="a shell command line (run by bash -c) or an argv")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="default: the template's workdir (/work)")
    timeout: float | str | None = None
    stdin: str | None = Field(None, description="text fed to the command's stdin")
    stdin_b64: str | None = Field(None, description="bytes (base64) fed to stdin")
    stdin_stream: bool = Field(False, description="keep its stdin open for POST "
                               "/sandboxes/{id}/execs/{exec_id}/stdin (streamed, flow-"
                               "controlled; the started frame names the exec id)")

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("cmd must not be empty")
            if "\x00" in v:
                raise ValueError("cmd contains a NUL byte")
        else:
            if not v or any("\x00" in a for a in v) or len(v) > 4096:
                raise ValueError("argv must be 1..4096 strings without NUL bytes")
        return v

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float | None:
        return None if v is None else _duration(v, "timeout")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(1, ge=1, le=16)


class NewWorkspace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")
    limits: dict[str, int] = Field(default_factory=dict, description=(
        "maxima: max_sandboxes, max_vcpus, max_memory_mib, max_disk_mib and max_pids (per "
        "sandbox), "
        "max_total_vcpus and max_total_memory_mib (its running sandboxes together)"))


class SetLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: dict[str, int]


PathQ = Annotated[str, Query(description="path inside the sandbox (relative: to /work)")]



# ---- app --------------------------------------------------------------------------------
def bootstrap(cfg: Config, store: Store) -> None:
    """First start: a default workspace and an admin key at $CPUOS_HOME/admin.key (0600)."""
    if cfg.admin_key_path.exists() and store.workspace_by_name("default"):
        return
    wid = store.workspace_by_name("default") or store.create_workspace("default")
    key = store.add_key(wid, "admin")
    fd = os.open(cfg.admin_key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(cfg.admin_key_path, 0o600)


SIZE_DEFAULTS = ("default_vcpus", "default_memory_mib", "default_disk_mib", "default_pids")


def sandbox_size(body: CreateSandbox, workspace: dict[str, Any] | None, cfg: Config,
                 limits: Limits) -> dict[str, int]:
    """vcpus, memory_mib, disk_mib and pids of a new sandbox: as asked (admission refuses
    what is over the workspace's maxima), else the workspace's defaults, else the daemon's,
    each at most the workspace's maximum."""
    settings = (workspace or {}).get("settings") or {}
    out = {}
    for name in ("vcpus", "memory_mib", "disk_mib", "pids"):
        v = getattr(body, name)
        if v is None:
            v = min(int(settings.get(f"default_{name}") or getattr(cfg, f"default_{name}")),
                    getattr(limits, f"max_{name}"))
        out[name] = int(v)
    return out


def sandbox_json(row: SandboxRow) -> dict[str, Any]:
    now = time.time()
    return {
        "id": row.id, "template": row.template, "state": row.state, "reason": row.reason,
        "backend": row.backend, "created_at": row.created_at, "started_at": row.started_at,
        "ended_at": row.ended_at, "deadline": row.deadline,
        "timeout_remaining": max(0.0, row.deadline - now)
        if row.deadline and row.state == "running" else None,
        "vcpus": row.spec.get("vcpus"), "memory_mib": row.spec.get("memory_mib"),
        "pids": row.spec.get("pids"), "disk_mib": row.spec.get("disk_mib"),
        "network": row.spec.get("network"), "metadata": row.metadata,
        "on_timeout": row.on_timeout, "paused_at": row.paused_at,
        "snapshot_bytes": row.snapshot_bytes,
        "idle_timeout": float(row.spec.get("idle_timeout") or 0.0),
    }


async def start_network(cfg: Config, backend: Backend, store: Store, events: EventBus
                        ) -> Network | None:
    """The daemon's network (per-sandbox namespaces, nftables, resolver, egress proxy) where
    it can run: the gVisor or microVM backend, nft installed, CPUOS_NETWORK not 0."""
    if not cfg.network:
        log.info("network: off (CPUOS_NETWORK=0): sandboxes have no network")
        return None
    if backend.capabilities.name not in ("gvisor", "microvm"):
        log.warning("network: not yet for the %s backend: its sandboxes have no network",
                    backend.capabilities.name)
        return None
    if shutil.which("nft") is None:
        log.warning("network: nft is not installed (apt-get install nftables): sandboxes "
                    "have no network")
        return None

    records = RecordWriter(store, events)
    net = Network(records.put, cfg.home / "secrets")
    net.records = records

    def forget_secrets(ev: SandboxEvent) -> None:
        # a sandbox's secrets and CA go when it ends, unless a fork of it still uses them
        if ev.kind not in ("killed", "error"):
            return
        row = store.get_sandbox(ev.sandbox)
        mine = stored_names(row.spec.get("network") if row else None)
        if not mine:
            return
        for other in store.list_sandboxes(None, LIVE_STATES):
            mine -= stored_names(other.spec.get("network"))
        net.secrets.forget(sorted(mine))

    events.subscribe(forget_secrets)
    await net.start()
    return net


async def stop_for_cap(mgr: Manager, workspace_id: str, sid: str) -> str:
    """What a sandbox of a workspace at its spending cap gets: paused where the backend
    can checkpoint (it costs only its snapshot's storage), else killed."""
    if mgr.backend.capabilities.checkpoint:
        await mgr.pause(workspace_id, sid, reason="spending_cap")
        return "paused"
    await mgr.kill(sid, reason="spending_cap")
    return "killed"


def create_app(cfg: Config | None = None) -> FastAPI:
    cfg = cfg or Config()
    node_token = None
    if cfg.role == "node":  # (many hosts: cpuosd.cluster.nodes, docs/DEPLOY.md)
        from ..cluster.nodes import check_token, node_id_of

        cfg.node_id = node_id_of(cfg)
        node_token = check_token(cfg.node_token, "node")
        if not cfg.database_url:
            log.warning("--role=node without CPUOS_DATABASE_URL: this node's state is its "
                        "own SQLite, which no API process on another host can read")
    elif cfg.role != "all":
        raise ValueError(f"role {cfg.role!r}: create_app serves --role=all or --role=node "
                         "(--role=api: cpuosd.cluster.api)")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not become_subreaper():
            log.warning("could not become a child subreaper: pauses may be slow")
        fixed = homedir.secure(cfg.home)  # 0700; files in it: no group/other bits
        if fixed:
            log.warning("took group/other permissions off %s", ", ".join(fixed))
        try:  # before any state is touched: a refused start changes nothing
            backend = await asyncio.to_thread(select_backend, cfg)
        except BackendUnavailable as e:
            # the reason, on one line; uvicorn would log the traceback after it: drop that
            log.error("cpuosd refuses to start: %s", e)
            logging.getLogger("uvicorn.error").addFilter(
                lambda r: BackendUnavailable.__name__ not in r.getMessage())
            raise
        store = open_store(cfg.db_path, cfg.database_url)
        bootstrap(cfg, store)
        events = EventBus()
        events.subscribe(log_event)
        audit = start_audit(cfg, events, store)
        if cfg.audit and cfg.audit_runtime and backend.capabilities.name == "gvisor":
            backend = Traced(backend, audit, cfg.sandboxes_dir)
        meter = Meter(store)
        events.subscribe(meter.on_event)
        network = await start_network(cfg, backend, store, events)
        if network is not None:
            backend = Networked(backend, network, cfg.sandboxes_dir)
        mgr = Manager(cfg, store, backend, events)
        enforcer = Enforcer(store, meter, events, partial(stop_for_cap, mgr))
        mgr.admission.check_spending = enforcer.check_cap
        await mgr.startup()
        meter.reconcile()
        cap_task = asyncio.ensure_future(enforcer.run())
        node_rt = None
        if cfg.role == "node":  # registration and heartbeat (cpuosd.cluster.nodes)
            from ..cluster.nodes import start_node

            node_rt = app.state.node = await start_node(cfg, store, backend, mgr)
        app.state.meter = meter
        app.state.store, app.state.mgr, app.state.network = store, mgr, network
        app.state.audit = audit
        app.state.builds = TemplateBuilds(cfg)
        preview = Preview(mgr, network, cfg.port + 1 if cfg.preview_port < 0
                          else cfg.preview_port, cfg.host)
        await preview.start()
        app.state.preview = preview
        app.state.e2b.attach(mgr, store, preview)  # the E2B surface (cpuosd.e2b)
        preview.route = e2b_surface.ports.router(app.state.e2b, (cfg.host, cfg.port))
        try:
            yield
        finally:
            cap_task.cancel()
            await asyncio.gather(cap_task, return_exceptions=True)
            if node_rt is not None:
                await node_rt.close()
            await enforcer.close()
            await preview.close()
            app.state.e2b.close()
            await app.state.builds.shutdown()
            await mgr.shutdown()
            if network is not None:
                await network.close()
            await asyncio.to_thread(audit.close)
            store.close()

    app = FastAPI(title="cpuos", version=VERSION, lifespan=lifespan)
    app.add_middleware(Guard)  # the key is checked before any body is read
    e2b_surface.install(app, cfg)  # /e2b and E2B's sandbox headers, before the Guard
    if node_token is not None:  # outermost: a node answers API processes only
        from ..cluster.nodes import NodeTokenGuard

        app.add_middleware(NodeTokenGuard, token=node_token)
    app.include_router(templates_router)
    app.include_router(audit_router)
    app.include_router(commands_router)
    app.include_router(pty_router)
    app.include_router(dirs_router)
    app.include_router(browser_router)
    app.include_router(interp_router)
    document(app)  # the answers' schemas in /openapi.json (sdk/js's types)
    app.include_router(usage_router)
    app.include_router(workspaces_router)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError("internal", f"internal error: {type(e).__name__}").body(),
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = [{"loc": [str(x) for x in err.get("loc", ())], "msg": str(err.get("msg"))}
                for err in e.errors()]
        msg = "; ".join(f"{'.'.join(x['loc'][1:]) or x['loc'][0]}: {x['msg']}" for x in errs)
        return JSONResponse(invalid(msg or "invalid request", errors=errs).body(),
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "invalid_argument", 401: "unauthorized",
                413: "too_large"}.get(
            e.status_code, "internal" if e.status_code >= 500 else "invalid_argument")
        return JSONResponse({"error": {"code": code, "message": str(e.detail), "details": {}}},
                            status_code=e.status_code)

    def mgr(request: Request) -> Manager:
        m: Manager = request.app.state.mgr
        return m

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Open to anyone: ok, version, backend; with the admin's key also the runtime
        (runsc's path and version, platform, network), which is the host's business."""
        backend = mgr(request).backend
        out = {"ok": True, "version": VERSION, "backend": backend.capabilities.name}
        key = bearer_key(list(request.scope["headers"]))
        wid = request.app.state.store.workspace_for_key(key) if key else None
        if wid is not None and is_admin(request, wid):
            out.update(backend.runtime())
        return out

    @app.post("/workspaces", status_code=201)
    async def new_workspace(body: NewWorkspace, request: Request, ws: Ws) -> dict[str, Any]:
        store: Store = request.app.state.store
        require_admin(request, ws)
        if store.workspace_by_name(body.name):
            raise ApiError("conflict", f"workspace {body.name!r} exists")
        wid = store.create_workspace(body.name, check_limits_body(body.limits))
        return {"id": wid, "name": body.name, "key": store.add_key(wid, "default"),
                "limits": asdict(mgr(request).admission.limits(wid))}

    @app.put("/workspaces/{wid}/limits")
    async def set_limits(wid: str, body: SetLimits, request: Request, ws: Ws
                         ) -> dict[str, Any]:
        """Set a workspace's maxima (admin); names not given take the defaults."""
        require_admin(request, ws)
        store: Store = request.app.state.store
        if store.workspace(wid) is None:
            raise not_found("workspace", wid)
        store.set_workspace_limits(wid, check_limits_body(body.limits))
        return {"id": wid, "limits": asdict(mgr(request).admission.limits(wid))}

    @app.put("/workspaces/{wid}/settings")
    async def set_settings(wid: str, body: WorkspaceSettings, request: Request, ws: Ws
                           ) -> dict[str, Any]:
        """A workspace's settings (admin): ``default_network``, the egress policy of its
        sandboxes that name none (off | on | allowlist | {"allow": [...]}; null: the
        daemon's CPUOS_DEFAULT_NETWORK); ``spending_cap`` (USD a month; null: none);
        ``default_idle_timeout`` (its sandboxes' idle timeout when they name none; 0: never;
        null: the daemon's CPUOS_IDLE_TIMEOUT); the size defaults ``default_vcpus`` ..."""
        require_admin(request, ws)
        store: Store = request.app.state.store
        w = store.workspace(wid)
        if w is None:
            raise not_found("workspace", wid)
        settings = dict(w["settings"])
        given = body.model_fields_set
        if not given:
            raise invalid("name at least one setting: " + ", ".join(
                WorkspaceSettings.model_fields))
        if "default_network" in given:
            if body.default_network is None:
                settings.pop("default_network", None)
            else:
                settings["default_network"] = Policy.parse(body.default_network).to_json()
        for name in ("spending_cap", "default_idle_timeout", *SIZE_DEFAULTS):
            if name in given:
                v = getattr(body, name)
                if v is None:
                    settings.pop(name, None)
                else:
                    settings[name] = v
        store.set_workspace_settings(wid, settings)
        return {"id": wid, "settings": settings}

    @app.get("/workspace")
    async def my_workspace(request: Request, ws: Ws) -> dict[str, Any]:
        """The caller's workspace: its maxima and what its sandboxes hold; for the admin
        also the host's capacity and what all sandboxes reserve (``host``)."""
        info = request.app.state.store.workspace(ws) or {"id": ws}
        return {**info, **mgr(request).admission.usage(ws, host=is_admin(request, ws))}

    @app.post("/sandboxes", status_code=201)
    async def create(body: CreateSandbox, request: Request, ws: Ws) -> dict[str, Any]:
        cfg_ = mgr(request).cfg
        if float(body.timeout) > cfg_.max_timeout:
            raise invalid(f"timeout may be at most {cfg_.max_timeout:.0f}s", field="timeout")
        if body.network is not None:
            network: dict[str, Any] | None = Policy.parse(body.network).to_json()
        else:  # the workspace's default, else the daemon's
            w = request.app.state.store.workspace(ws) or {}
            network = (w.get("settings") or {}).get("default_network")
        env = dict(body.env)
        if body.secrets:
            net: Network | None = request.app.state.network
            if net is None:
                raise invalid("secrets need the daemon's network, which is off here",
                              field="secrets")
            placeholders, view, ca = net.secrets.add(body.secrets)
            clash = sorted(set(placeholders) & set(env))
            if clash:
                net.secrets.forget([*(v["placeholder"] for v in view.values()), ca])
                raise invalid(f"{clash[0]} is both a secret and an environment variable",
                              field="secrets")
            env.update(placeholders)
            pol = Policy.stored(network) if network else Policy.parse(
                mgr(request).cfg.default_network)
            pol.secrets, pol.ca = view, ca
            network = pol.to_json()
        wsrow = request.app.state.store.workspace(ws)
        size = sandbox_size(body, wsrow, cfg_, mgr(request).admission.limits(ws))
        idle = body.idle_timeout
        if idle is None:
            idle = ((wsrow or {}).get("settings") or {}).get("default_idle_timeout")
        idle_timeout = float(cfg_.idle_timeout if idle is None else idle)
        try:
            row = await mgr(request).create(ws, body.template, float(body.timeout),
                                            body.metadata, env, size["vcpus"],
                                            size["memory_mib"], body.on_timeout,
                                            network=network, pids=size["pids"],
                                            disk_mib=size["disk_mib"],
                                            idle_timeout=idle_timeout)
        except BaseException:
            # refused before a row existed (admission, template): no event will clean up
            if body.secrets and request.app.state.network is not None:
                request.app.state.network.secrets.forget(sorted(stored_names(network)))
            raise
        if not body.wake_on_request:
            row.spec["wake_on_request"] = False
            request.app.state.store.update_sandbox(row.id, spec=row.spec)
        return sandbox_json(row)

    @app.post("/sandboxes/{sid}/network")
    async def set_network(sid: str, body: SetNetwork, request: Request, ws: Ws
                          ) -> dict[str, Any]:
        """A new egress policy; a running sandbox's new connections follow it at once."""
        policy = Policy.parse(body.network).to_json()
        return sandbox_json(await mgr(request).set_network(ws, sid, policy))

    def previews(request: Request) -> Preview:
        pv: Preview = request.app.state.preview
        if request.app.state.network is None:
            raise ApiError("conflict", "previews need the sandbox network, which is off here "
                           "(the gVisor backend with CPUOS_NETWORK on)")
        return pv

    @app.post("/sandboxes/{sid}/ports", status_code=201)
    async def expose(sid: str, body: ExposePort, request: Request, ws: Ws) -> dict[str, Any]:
        """A preview URL for a server on ``port`` inside the sandbox: its token-protected
        URLs (path and host forms), or open to anyone with ``public``."""
        return await previews(request).expose(ws, sid, body.port, body.public)

    @app.get("/sandboxes/{sid}/ports")
    async def ports(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        return {"ports": previews(request).list(ws, sid)}

    @app.delete("/sandboxes/{sid}/ports/{port}")
    async def unexpose(sid: str, port: int, request: Request, ws: Ws) -> dict[str, Any]:
        await previews(request).unexpose(ws, sid, port)
        return {"unexposed": port}

    @app.get("/sandboxes/{sid}/metrics")
    async def metrics(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        """What the host measures of a running sandbox now: CPU seconds (and the average
        CPU % since it started), memory used and its limit, tasks and their limit, bytes
        on its network link. A paused sandbox has only its snapshot's size."""
        m = mgr(request)
        return await sandbox_metrics(m, m.get(ws, sid))

    @app.get("/sandboxes/{sid}/connections")
    async def connections(sid: str, request: Request, ws: Ws,
                          limit: int = Query(100, ge=1, le=1000),
                          after: int = Query(0, ge=0, description="only records after this n")
                          ) -> dict[str, Any]:
        """Every outbound attempt of the sandbox, newest first: time, proto, dst, port, name,
        verdict (allowed | denied | error), rule, bytes each way."""
        mgr(request).get(ws, sid)
        net: Network | None = request.app.state.network
        if net is not None and net.records is not None:
            await net.records.flush()  # what happened up to now is on record
        return {"connections": request.app.state.store.list_connections(sid, limit, after)}

    @app.post("/sandboxes/{sid}/pause")
    async def pause(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        """Checkpoint memory, processes and files to disk and stop the sandbox."""
        return sandbox_json(await mgr(request).pause(ws, sid))

    @app.post("/sandboxes/{sid}/resume")
    async def resume(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        return sandbox_json(await mgr(request).resume(ws, sid))

    @app.post("/sandboxes/{sid}/fork", status_code=201)
    async def fork(sid: str, body: ForkRequest, request: Request, ws: Ws) -> dict[str, Any]:
        await mgr(request).ready(ws, sid, "fork")  # (one paused for idleness: resumed)
        rows = await mgr(request).fork(ws, sid, body.n)
        return {"sandboxes": [sandbox_json(r) for r in rows]}

    @app.get("/sandboxes")
    async def list_(request: Request, ws: Ws, all: bool = False) -> dict[str, Any]:
        states: tuple[str, ...] = ("creating", "running", "pausing", "paused", "resuming",
                                   "killing", "killed", "error") if all else ACTIVE_STATES
        rows = request.app.state.store.list_sandboxes(ws, states)
        return {"sandboxes": [sandbox_json(r) for r in rows]}

    @app.get("/sandboxes/{sid}")
    async def info(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        return sandbox_json(mgr(request).get(ws, sid))

    @app.delete("/sandboxes/{sid}")
    async def kill(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        mgr(request).get(ws, sid)
        await mgr(request).kill(sid, reason="killed")
        return sandbox_json(mgr(request).get(ws, sid))

    @app.post("/sandboxes/{sid}/timeout")
    async def set_timeout(sid: str, body: SetTimeout, request: Request, ws: Ws
                          ) -> dict[str, Any]:
        if body.timeout is None and body.idle_timeout is None:
            raise invalid("give timeout, idle_timeout or both", field="timeout")
        if body.timeout is not None and float(body.timeout) > mgr(request).cfg.max_timeout:
            raise invalid("timeout too long", field="timeout")
        if body.idle_timeout is not None:
            mgr(request).set_idle_timeout(ws, sid, float(body.idle_timeout))
        if body.timeout is None:
            return sandbox_json(mgr(request).get(ws, sid))
        return sandbox_json(mgr(request).set_timeout(ws, sid, float(body.timeout)))

    @app.get("/sandboxes/{sid}/execs")
    async def execs(sid: str, request: Request, ws: Ws) -> dict[str, Any]:
        mgr(request).get(ws, sid)
        return {"execs": request.app.state.store.list_execs(sid)}

    @app.post("/sandboxes/{sid}/exec",
              responses={200: {"content": {P.CONTENT_TYPE: {}},
                               "description": "a stream of frames (see cpuos_agent.protocol): "
                               "started, out (fd 1|2, raw bytes), then exit or error"}})
    async def exec_(sid: str, body: ExecRequest, request: Request, ws: Ws) -> StreamingResponse:
        lv = await mgr(request).ready(ws, sid)
        argv = body.cmd
        stdin: bytes | None = None
        if body.stdin is not None and body.stdin_b64 is not None:
            raise invalid("give stdin or stdin_b64, not both", field="stdin")
        if body.stdin is not None:
            stdin = body.stdin.encode()
        elif body.stdin_b64 is not None:
            try:
                stdin = base64.b64decode(body.stdin_b64, validate=True)
            except (binascii.Error, ValueError):
                raise invalid("stdin_b64 is not valid base64", field="stdin_b64") from None
        timeout = None if body.timeout is None else float(body.timeout)
        cwd = None if body.cwd is None else check_path(body.cwd, "cwd")
        if body.stdin_stream and stdin is not None:
            raise invalid("give stdin or stdin_stream, not both", field="stdin_stream")
        frames = await mgr(request).exec_start(lv, argv, body.env, cwd, timeout, stdin,
                                               stdin_stream=body.stdin_stream)
        return StreamingResponse(frames, media_type=P.CONTENT_TYPE,
                                 headers={"Cache-Control": "no-store"})

    # ---- files --------------------------------------------------------------------------
    @app.put("/sandboxes/{sid}/files")
    async def put_file(sid: str, path: PathQ, request: Request, ws: Ws) -> dict[str, Any]:
        lv = await mgr(request).ready(ws, sid, "files")
        return await mgr(request).write_file(lv, check_path(path), request.stream())

    @app.get("/sandboxes/{sid}/files",
             responses={200: {"content": {"application/octet-stream": {}, P.CONTENT_TYPE: {}},
                              "description": "the file's bytes (Content-Length when its size "
                              "is exact; a failure mid-way cuts the response short), or with "
                              f"Accept: {P.CONTENT_TYPE} frames: data..., then eof or error"}})
    async def get_file(sid: str, path: PathQ, request: Request, ws: Ws,
                       max_bytes: MaxBytesQ = None) -> StreamingResponse:
        lv = await mgr(request).ready(ws, sid, "files")
        body = await mgr(request).read_file(lv, check_path(path), max_bytes)
        return file_response(body, request.headers.get("accept", ""))

    @app.delete("/sandboxes/{sid}/files")
    async def remove_file(sid: str, path: PathQ, request: Request, ws: Ws) -> dict[str, Any]:
        lv = await mgr(request).ready(ws, sid, "files")
        p = check_path(path)
        if p == "/":
            raise invalid("refusing to remove /", field="path")
        await mgr(request).file_call(lv, "remove", p)
        return {"removed": p}

    @app.get("/sandboxes/{sid}/files/list")
    async def list_files(sid: str, request: Request, ws: Ws, path: PathQ = "/work"
                         ) -> dict[str, Any]:
        lv = await mgr(request).ready(ws, sid, "files")
        return {"entries": await mgr(request).file_call(lv, "list", check_path(path))}

    @app.get("/sandboxes/{sid}/files/stat")
    async def stat_file(sid: str, path: PathQ, request: Request, ws: Ws) -> dict[str, Any]:
        lv = await mgr(request).ready(ws, sid, "files")
        result: dict[str, Any] = await mgr(request).file_call(lv, "stat", check_path(path))
        return result

    @app.post("/sandboxes/{sid}/files/mkdir")
    async def mkdir(sid: str, path: PathQ, request: Request, ws: Ws) -> dict[str, Any]:
        lv = await mgr(request).ready(ws, sid, "files")
        result: dict[str, Any] = await mgr(request).file_call(lv, "mkdir", check_path(path))
        return result

    return app
