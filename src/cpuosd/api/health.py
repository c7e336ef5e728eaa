"""``GET /health``: open to anyone."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from .auth import bearer_key
from .deps import ManagerDep, StoreDep, is_admin

router = APIRouter()
VERSION = "0.1.0"


@router.get("/health")
async def health(request: Request, mgr: ManagerDep, store: StoreDep) -> dict[str, Any]:
    """Open to anyone: ok, version, backend; with the admin's key also the runtime
    (runsc's path and version, platform, network), which is the host's business."""
    backend = mgr.backend
    out = {"ok": True, "version": VERSION, "backend": backend.capabilities.name}
    key = bearer_key(list(request.scope["headers"]))
    wid = store.workspace_for_key(key) if key else None
    if wid is not None and is_admin(request, wid):
        out.update(backend.runtime())
    return out
