"""The HTTP API (FastAPI). OpenAPI at /openapi.json.

Every route but /health needs ``Authorization: Bearer <key>``; a key sees only
its own workspace (another workspace's sandbox is a 404). Errors are
``{"error": {"code", "message", "details"}}`` with the matching status.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import e2b as e2b_surface
from ..backends.microvm.selection import BackendUnavailable
from ..config import Config
from ..agentconn import TransportError
from ..errors import ApiError, api_error, invalid
from ..wiring import Services, build_services, node_config
from ..console.routes import router as console_router
from . import (audit, browser, commands, dirs, eventstream, files, forks, health, interp,
               ports, pty, sandboxes, templates, usage, workspaces)
from .auth import Guard
from .health import VERSION
from .schemas import document

log = logging.getLogger("cpuosd.api")

# in the order they are matched (no two share a path)
ROUTERS = (templates.router, audit.router, commands.router, pty.router, dirs.router,
           browser.router, interp.router, usage.router, workspaces.router, health.router,
           workspaces.settings_router, sandboxes.router, ports.router, files.router,
           forks.router,  # a fork across nodes: a node's internal half (cluster.forks)
           eventstream.router,  # GET /events: the event bus, server-sent
           console_router)  # /ui: the web console (cpuosd.console)


def attach(app: FastAPI, services: Services) -> None:
    """Serve ``services`` from ``app``: its routes reach them through ``deps``; the E2B
    surface (``cpuosd.e2b``) and the preview proxy's E2B routes are tied to them."""
    app.state.services = services
    app.state.e2b.attach(services.manager, services.store, services.preview)
    cc = services.cfg.cluster  # (a node's listener wants its token: envd's host form)
    services.preview.route = e2b_surface.ports.router(
        app.state.e2b, (services.cfg.host, services.cfg.port),
        ((b"X-Cpuos-Node-Token", str(cc.node_token).encode()),) if cc.role == "node" else ())


def create_app(cfg: Config | None = None, services: Services | None = None) -> FastAPI:
    """The HTTP app: its routers, its middleware and its error handlers. Its lifespan
    serves ``services`` (which stay the caller's: started before, closed after), else
    builds the daemon's own from ``cfg`` (``cpuosd.wiring.build_services``) and closes
    them when it ends. ``cfg``'s role is ``all`` or ``node`` (a node's id and token are
    checked here: ValueError; ``api``: cpuosd.cluster.api.create_api_app)."""
    cfg = cfg or Config.from_env()
    if cfg.cluster.role == "node":  # (many hosts: cpuosd.cluster.nodes, docs/DEPLOY.md)
        cfg = node_config(cfg)
    elif cfg.cluster.role != "all":
        raise ValueError(f"role {cfg.cluster.role!r}: create_app serves --role=all or "
                         "--role=node (--role=api: cpuosd.cluster.api)")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = services is None
        try:  # before any state is touched: a refused start changes nothing
            svc = services or await build_services(cfg)
        except BackendUnavailable as e:
            # the reason, on one line; uvicorn would log the traceback after it: drop that
            log.error("cpuosd refuses to start: %s", e)
            logging.getLogger("uvicorn.error").addFilter(
                lambda r: BackendUnavailable.__name__ not in r.getMessage())
            raise
        attach(app, svc)
        try:
            yield
        finally:
            app.state.e2b.close()
            if own:
                await svc.close()

    app = FastAPI(title="cpuos", version=VERSION, lifespan=lifespan)
    app.state.console_session_ttl = cfg.api.console_session_ttl  # (console.sessions)
    app.add_middleware(Guard)  # the key is checked before any body is read
    e2b_surface.install(app, cfg)  # /e2b and E2B's sandbox headers, before the Guard
    if cfg.cluster.role == "node":  # outermost: a node answers API processes only
        from ..cluster.nodes import NodeTokenGuard

        app.add_middleware(NodeTokenGuard, token=str(cfg.cluster.node_token))
    for router in ROUTERS:
        app.include_router(router)
    document(app)  # the answers' schemas in /openapi.json (sdk/js's types)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(TransportError)  # the agent channel's: unavailable or timeout
    async def _transport_error(_: Request, e: TransportError) -> JSONResponse:
        err = api_error(e)
        return JSONResponse(err.body(), status_code=err.status)

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

    return app
