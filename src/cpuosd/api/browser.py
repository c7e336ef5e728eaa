"""The browser of a sandbox made from the ``browser`` template (cpuosd.browser):

- ``GET /sandboxes/{id}/browser``: ``cdp_url``, a WebSocket URL of the browser's DevTools
  endpoint through the preview proxy, with the port's token in it (Playwright's
  ``chromium.connect_over_cdp(url)``, Puppeteer's ``connect({browserWSEndpoint})``);
- ``POST .../browser/goto`` ``{url, timeout}``: navigate, wait for the load event;
- ``GET .../browser/screenshot``: the page as PNG bytes (``image/png``);
- ``GET .../browser/content``: the page's HTML;
- ``POST .../browser/click`` ``{selector}``, ``POST .../browser/fill`` ``{selector, text}``.

The helpers are done here, in the daemon, rather than in each SDK: the daemon already
reaches the sandbox's address (as the preview proxy does), so the SDKs, the CLI and the MCP
server need nothing but HTTP (no WebSocket client, no CDP). A paused sandbox is resumed
first, as a preview request would.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from .. import browser as cdp
from ..errors import ApiError
from ..lifecycle.manager import Manager
from ..network.service import Network
from ..network.preview import Preview
from .deps import ManagerDep, NetworkDep, PreviewDep, Ws
from .models import MAX_BROWSER_TIMEOUT as MAX_TIMEOUT, Click, Fill, Goto

router = APIRouter()


@contextlib.asynccontextmanager
async def _address(mgr: Manager, pv: Preview, net: Network | None, ws: str, sid: str
                   ) -> AsyncIterator[tuple[str, str]]:
    """The sandbox's address (its owner checked; a paused one resumed first), and its
    family for cpuosd.browser (its workspace and template); the sandbox is in use (not
    idle) until the block ends."""
    if net is None:
        raise ApiError("conflict", "the browser needs the sandbox network, which is off here "
                       "(the gVisor backend with CPUOS_NETWORK on)")
    row = mgr.get(ws, sid)  # 404 for another workspace's sandbox
    addr = await pv._running_address(row.id, row.workspace_id, row.state, row.spec)
    if isinstance(addr, tuple):
        raise ApiError("unavailable" if addr[0] == 503 else "conflict", addr[1])
    with mgr.using(sid):
        yield addr, f"{row.workspace_id}/{row.template}"


@router.get("/sandboxes/{sid}/browser")
async def browser_info(sid: str, mgr: ManagerDep, pv: PreviewDep, net: NetworkDep, ws: Ws
                       ) -> dict[str, Any]:
    """The DevTools WebSocket URL through the preview proxy (token in its query: keep it
    secret) and the browser's version."""
    async with _address(mgr, pv, net, ws, sid) as (addr, _):
        guid, version = await cdp.browser_guid(addr, sid)
    p = await pv.expose(ws, sid, cdp.CDP_PORT, None)
    base = p["url"].replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    url = f"{base}devtools/browser/{guid}"
    if not p["public"]:
        url += f"?cpuos_token={p['token']}"
    return {"cdp_url": url, "port": cdp.CDP_PORT, "version": version}


@router.post("/sandboxes/{sid}/browser/goto")
async def browser_goto(sid: str, body: Goto, mgr: ManagerDep, pv: PreviewDep, net: NetworkDep,
                       ws: Ws) -> dict[str, Any]:
    """Load ``url`` in the page and wait for its load event: {url, status, title}."""
    async with _address(mgr, pv, net, ws, sid) as (addr, family):
        return await cdp.goto(addr, sid, body.url, body.timeout, family,
                              mgr.browser_targets)


@router.get("/sandboxes/{sid}/browser/screenshot")
async def browser_screenshot(sid: str, mgr: ManagerDep, pv: PreviewDep, net: NetworkDep,
                             ws: Ws,
                             full_page: bool = False,
                             timeout: float = Query(30.0, gt=0, le=MAX_TIMEOUT)) -> Response:
    async with _address(mgr, pv, net, ws, sid) as (addr, family):
        png = await cdp.screenshot(addr, sid, timeout, full_page, family,
                                   mgr.browser_targets)
        return Response(png, media_type="image/png")


@router.get("/sandboxes/{sid}/browser/content")
async def browser_content(sid: str, mgr: ManagerDep, pv: PreviewDep, net: NetworkDep,
                          ws: Ws,
                          timeout: float = Query(30.0, gt=0, le=MAX_TIMEOUT)
                          ) -> dict[str, Any]:
    async with _address(mgr, pv, net, ws, sid) as (addr, family):
        return {"html": await cdp.content(addr, sid, timeout, family,
                                           mgr.browser_targets)}


@router.post("/sandboxes/{sid}/browser/click")
async def browser_click(sid: str, body: Click, mgr: ManagerDep, pv: PreviewDep,
                        net: NetworkDep, ws: Ws) -> dict[str, Any]:
    async with _address(mgr, pv, net, ws, sid) as (addr, family):
        await cdp.click(addr, sid, body.selector, body.timeout, family,
                        mgr.browser_targets)
        return {"clicked": body.selector}


@router.post("/sandboxes/{sid}/browser/fill")
async def browser_fill(sid: str, body: Fill, mgr: ManagerDep, pv: PreviewDep,
                       net: NetworkDep, ws: Ws) -> dict[str, Any]:
    async with _address(mgr, pv, net, ws, sid) as (addr, family):
        await cdp.fill(addr, sid, body.selector, body.text, body.timeout, family,
                       mgr.browser_targets)
        return {"filled": body.selector}
