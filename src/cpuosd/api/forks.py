"""A fork fanned out across nodes (cpuosd.cluster.forks): the node's internal half. Not part
of the public API (not in /openapi.json): a node answers these only with the node token (its
NodeTokenGuard), an API process refuses them from its callers, and on one host
(``--role=all``) or a node without a shared snapshot store they answer 404.

- ``POST /sandboxes/{sid}/fork/publish`` {n, remote}: on the parent's node: checkpoint once,
  the image into the shared store (``fork-<sid>-<hex>``), ``n`` children restored here;
- ``POST /sandboxes/{sid}/fork/restore`` {image, bytes, n}: on a target node: the image
  fetched, ``n`` children restored here;
- ``POST /sandboxes/{sid}/fork/release`` {image}: the image out of the store.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ApiError
from .deps import ManagerDep, Ws
from .sandboxes import sandbox_json

router = APIRouter(include_in_schema=False)

MAX_CHILDREN = 16  # (as ForkRequest's n)


class ForkPublish(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(0, ge=0, le=MAX_CHILDREN)  # children restored on this node
    remote: int = Field(..., ge=1, le=MAX_CHILDREN)  # children restored elsewhere


class ForkRestore(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(..., max_length=128)
    bytes: int = Field(0, ge=0, le=1 << 44)
    n: int = Field(..., ge=1, le=MAX_CHILDREN)


class ForkRelease(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(..., max_length=128)


@router.post("/sandboxes/{sid}/fork/publish", status_code=201)
async def publish(sid: str, body: ForkPublish, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    if mgr.snapstore is None:  # (before a wake: nothing happens on a node without one)
        raise ApiError("not_found", "this node has no shared snapshot store (a fork across "
                       "nodes needs CPUOS_SNAPSHOT_STORE)")
    await mgr.ready(ws, sid, "fork")  # (one paused for idleness: resumed)
    rows, key, size = await mgr.snapshots.fork_publish(ws, sid, body.n, body.remote)
    return {"image": key, "bytes": size, "sandboxes": [sandbox_json(r) for r in rows]}


@router.post("/sandboxes/{sid}/fork/restore", status_code=201)
async def restore(sid: str, body: ForkRestore, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    rows = await mgr.snapshots.fork_restore(ws, sid, body.image, body.n, body.bytes)
    return {"sandboxes": [sandbox_json(r) for r in rows]}


@router.post("/sandboxes/{sid}/fork/release")
async def release(sid: str, body: ForkRelease, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    mgr.get(ws, sid)
    await mgr.snapshots.release_fork(sid, body.image)
    return {"released": body.image}
