"""Ports of a sandbox exposed through the preview proxy (``cpuosd.network.preview``): a URL
for a server listening inside, token-protected or public."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..errors import ApiError
from ..network.service import Network
from ..network.preview import Preview
from .deps import NetworkDep, PreviewDep, Ws
from .models import ExposePort

router = APIRouter()


def previews(pv: Preview, net: Network | None) -> Preview:
    if net is None:
        raise ApiError("conflict", "previews need the sandbox network, which is off here "
                       "(the gVisor backend with CPUOS_NETWORK on)")
    return pv


@router.post("/sandboxes/{sid}/ports", status_code=201)
async def expose(sid: str, body: ExposePort, pv: PreviewDep, net: NetworkDep, ws: Ws
                 ) -> dict[str, Any]:
    """A preview URL for a server on ``port`` inside the sandbox: its token-protected
    URLs (path and host forms), or open to anyone with ``public``."""
    return await previews(pv, net).expose(ws, sid, body.port, body.public)


@router.get("/sandboxes/{sid}/ports")
async def ports(sid: str, pv: PreviewDep, net: NetworkDep, ws: Ws) -> dict[str, Any]:
    return {"ports": previews(pv, net).list(ws, sid)}


@router.delete("/sandboxes/{sid}/ports/{port}")
async def unexpose(sid: str, port: int, pv: PreviewDep, net: NetworkDep, ws: Ws
                   ) -> dict[str, Any]:
    await previews(pv, net).unexpose(ws, sid, port)
    return {"unexposed": port}
