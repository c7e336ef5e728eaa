"""Workspaces and their API keys: list, create and revoke keys; list and delete workspaces.

- A key manages the keys of its own workspace (``/workspace/keys``, or
  ``/workspaces/{its id}/keys``): list them (never a key itself: only its id, label and
  dates; a key is shown once, when it is made), make one, revoke one. It may revoke itself
  and its siblings, but not the workspace's last live key (409: make another first), which
  would leave the workspace with no way in but the admin. Another workspace is a 404.
- The admin (the ``default`` workspace's keys) does this for any workspace, may revoke a
  workspace's last key, and lists (``GET /workspaces``) and deletes (``DELETE
  /workspaces/{id}``) workspaces. Its own last key cannot be revoked, nor its workspace
  deleted.

A revoked key is refused (401) from the next request on, and what it has in flight (exec
streams, followers, terminals) is ended at once (``auth.LiveRequests``). Deleting a
workspace revokes its keys, kills its sandboxes (paused ones too: their snapshots are
removed) and refuses any create, resume or fork for it; its records (sandboxes, usage,
audit rows) are kept.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ApiError, not_found
from ..lifecycle.manager import Manager
from ..store import LIVE_STATES, Store
from .auth import Ws, is_admin, live_requests, require_admin

log = logging.getLogger("cpuosd.api")
router = APIRouter(tags=["workspaces"])
KILL_PASSES = 3


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9 ._-]+$",
                       description="a name for the key (who or what holds it)")


def _store(request: Request) -> Store:
    s: Store = request.app.state.store
    return s


def _target(request: Request, ws: str, wid: str | None) -> str:
    """The workspace whose keys the caller may manage: its own, or (the admin) any live one;
    any other is not found, as another workspace's sandbox is."""
    if wid is None or wid == ws:
        return ws
    if is_admin(request, ws) and _store(request).workspace(wid) is not None:
        return wid
    raise not_found("workspace", wid)


def _key_json(request: Request, k: dict[str, Any]) -> dict[str, Any]:
    return {**k, "current": k["id"] == getattr(request.state, "key_id", None)}


async def _list_keys(request: Request, ws: str, wid: str | None) -> dict[str, Any]:
    target = _target(request, ws, wid)
    return {"keys": [_key_json(request, k) for k in _store(request).list_keys(target)]}


async def _create_key(request: Request, ws: str, wid: str | None, body: NewKey
                      ) -> dict[str, Any]:
    target = _target(request, ws, wid)
    _, rec = _store(request).new_key(target, body.label)
    log.info("API key %s (%s) made for workspace %s", rec["id"], body.label, target)
    return {**rec, "current": False}


async def _revoke_key(request: Request, ws: str, wid: str | None, key_id: str
                      ) -> dict[str, Any]:
    target = _target(request, ws, wid)
    admin = is_admin(request, ws)
    # the admin may leave another workspace keyless (it can make it a key again); nobody
    # may leave the admin workspace without one (only a restart with admin.key removed
    # would get back in)
    keep_one = not admin or target == ws
    store = _store(request)
    what = store.revoke_key(target, key_id, keep_one=keep_one)
    if what == "missing":
        raise not_found("API key", key_id)
    if what == "last":
        raise ApiError("conflict", f"{key_id} is the workspace's last live key: make another "
                       "first (POST /workspace/keys), then revoke this one",
                       {"key": key_id})
    ended = 0
    if what == "revoked":
        ended = live_requests(request).cancel([key_id], keep=request.state.live_scope)
        log.info("API key %s of workspace %s revoked (%d request(s) in flight ended)",
                 key_id, target, ended)
    rec = store.key_record(key_id)
    assert rec is not None
    return {**_key_json(request, rec), "requests_ended": ended}


# ---- the caller's workspace -------------------------------------------------------------
@router.get("/workspace/keys")
async def my_keys(request: Request, ws: Ws) -> dict[str, Any]:
    """The caller's workspace's keys (ids, labels, dates; ``current``: the one asking)."""
    return await _list_keys(request, ws, None)


@router.post("/workspace/keys", status_code=201)
async def my_new_key(body: NewKey, request: Request, ws: Ws) -> dict[str, Any]:
    """A new key of the caller's workspace; ``key`` is shown this once."""
    return await _create_key(request, ws, None, body)


@router.delete("/workspace/keys/{key_id}")
async def my_revoke_key(key_id: str, request: Request, ws: Ws) -> dict[str, Any]:
    """Revoke a key of the caller's workspace (itself too, not the last live one)."""
    return await _revoke_key(request, ws, None, key_id)


# ---- any workspace (its own, or the admin any) ------------------------------------------
@router.get("/workspaces/{wid}/keys")
async def keys(wid: str, request: Request, ws: Ws) -> dict[str, Any]:
    return await _list_keys(request, ws, wid)


@router.post("/workspaces/{wid}/keys", status_code=201)
async def new_key(wid: str, body: NewKey, request: Request, ws: Ws) -> dict[str, Any]:
    return await _create_key(request, ws, wid, body)


@router.delete("/workspaces/{wid}/keys/{key_id}")
async def revoke_key(wid: str, key_id: str, request: Request, ws: Ws) -> dict[str, Any]:
    return await _revoke_key(request, ws, wid, key_id)


@router.get("/workspaces")
async def list_workspaces(request: Request, ws: Ws,
                          deleted: bool = Query(False, description="deleted ones too")
                          ) -> dict[str, Any]:
    """Every workspace (admin): its record, its live keys and alive sandboxes."""
    require_admin(request, ws)
    store = _store(request)
    out = []
    for w in store.list_workspaces(deleted=deleted):
        live_keys = [k for k in store.list_keys(w["id"]) if k["revoked_at"] is None]
        alive = store.list_sandboxes(w["id"], tuple(s for s in LIVE_STATES if s != "pooled"))
        out.append({**w, "keys": len(live_keys), "sandboxes": len(alive)})
    return {"workspaces": out}


@router.delete("/workspaces/{wid}")
async def delete_workspace(wid: str, request: Request, ws: Ws) -> dict[str, Any]:
    """Delete a workspace (admin): its keys are revoked and their requests in flight ended,
    its sandboxes killed (paused ones' snapshots removed); its records are kept. Finishes
    even if the client goes away."""
    require_admin(request, ws)
    store = _store(request)
    w = store.workspace(wid)
    if w is None:
        raise not_found("workspace", wid)
    if wid == ws:
        raise ApiError("conflict", "the admin workspace ('default') cannot be deleted")
    revoked = store.delete_workspace(wid)
    ended = live_requests(request).cancel(revoked)
    mgr: Manager = request.app.state.mgr
    killed = await asyncio.shield(asyncio.ensure_future(_kill_all(mgr, store, wid)))
    log.info("workspace %s (%s) deleted: %d key(s) revoked, %d request(s) ended, %d "
             "sandbox(es) killed", wid, w["name"], len(revoked), ended, len(killed))
    gone = store.workspace(wid, deleted=True) or {}
    return {"id": wid, "name": w["name"], "deleted_at": gone.get("deleted_at"),
            "keys_revoked": len(revoked), "requests_ended": ended,
            "sandboxes_killed": killed}


async def _kill_all(mgr: Manager, store: Store, wid: str) -> list[str]:
    """Kill every sandbox of the workspace that has something on the host. No new one can
    be admitted once it is marked deleted (admission is atomic with a create's row), so a
    pass or two finds all; a kill returns in every state within its bound."""
    killed: list[str] = []
    for _ in range(KILL_PASSES):
        rows = [r for r in store.list_sandboxes(wid, LIVE_STATES) if r.state != "pooled"]
        if not rows:
            break
        await asyncio.gather(*(mgr.kill(r.id, reason="workspace_deleted") for r in rows),
                             return_exceptions=True)
        killed += [r.id for r in rows if r.id not in killed]
    return killed
