"""The web console on an API process (docs/DEPLOY.md): its own routes (the page, the
sign-in: cpuosd.console.routes) served here, and ``GET /metrics`` (every running or paused
sandbox's figures: the console's sparklines, ``cpuos top``) gathered from every node, as
only the node holding a sandbox can measure it. The rest the console calls is forwarded as
the SDKs' requests are (cpuosd.cluster.api), ``GET /events`` fanned in by
cpuosd.cluster.events."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..config import Config
from ..errors import ApiError
from .nodes import TOKEN_HEADER

if TYPE_CHECKING:
    from .api import Forwarder


def console_app(cfg: Config) -> Any:
    """The console's routes as an app of their own; the API process's lifespan attaches
    its services (the store: sessions, keys, workspaces) as ``state.services``."""
    from fastapi import FastAPI

    from ..console.routes import router

    ui = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    ui.state.console_session_ttl = cfg.api.console_session_ttl
    ui.include_router(router)

    @ui.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    return ui


async def metrics(fwd: Forwarder, request: Request) -> Response:
    """``GET /metrics`` asked of every live node (each checks the caller as one host does);
    each sandbox's entry from the node that measured the most of it (the one holding it;
    a paused sandbox's is the same everywhere)."""
    from .api import DROP

    headers = request.scope["headers"]
    try:
        ok, _ = await asyncio.to_thread(fwd._route, headers, "/metrics",
                                        request.scope.get("query_string", b""), "GET")
    except ApiError as e:
        return JSONResponse(e.body(), status_code=e.status)
    if not ok:
        no = ApiError("unauthorized", "missing or invalid API key")
        return JSONResponse(no.body(), status_code=no.status)
    send = [(k, v) for k, v in headers if k.decode().lower() not in DROP]
    send.append((TOKEN_HEADER.encode(), fwd.token.encode()))
    nodes = [n for n in fwd.view.nodes if n.alive]

    async def ask(address: str) -> httpx.Response | None:
        try:
            return await fwd.http.get(f"http://{address}/metrics", headers=send,
                                      params=request.url.query or None,
                                      timeout=httpx.Timeout(30.0))
        except httpx.HTTPError:
            return None

    answers = [r for r in await asyncio.gather(*(ask(n.address) for n in nodes))
               if r is not None]
    good = [r for r in answers if r.status_code == 200]
    if not good:
        if answers:  # (refused: as any node refuses it)
            r = answers[0]
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        gone = ApiError("unavailable", "no node answered")
        return JSONResponse(gone.body(), status_code=gone.status)
    best: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    t = 0.0
    for r in good:
        body = r.json()
        t = max(t, float(body.get("time") or 0))
        for s in body.get("sandboxes") or ():
            sid = s.get("id")
            if sid not in best:
                order.append(sid)
                best[sid] = s
            elif len(s) > len(best[sid]):
                best[sid] = s
    return JSONResponse({"time": t, "sandboxes": [best[sid] for sid in order]})
