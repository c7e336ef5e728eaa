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
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request

from ..accounting.quotas import check_limits_body
from ..errors import ApiError, invalid, not_found
from ..lifecycle.manager import Manager
from ..network.policy import Policy
from ..store import LIVE_STATES, Store
from .auth import live_requests
from .deps import ManagerDep, StoreDep, Ws, is_admin, require_admin
from .models import NewKey, NewWorkspace, SetLimits, WorkspaceSettings
from .sandboxes import SIZE_DEFAULTS
from ..lifecycle.states import State

log = logging.getLogger("cpuosd.api")
router = APIRouter(tags=["workspaces"])
# the workspace itself, its maxima and settings (untagged in /openapi.json, as ever)
settings_router = APIRouter()
KILL_PASSES = 3


def _target(request: Request, store: Store, ws: str, wid: str | None) -> str:
    """The workspace whose keys the caller may manage: its own, or (the admin) any live one;
    any other is not found, as another workspace's sandbox is."""
    if wid is None or wid == ws:
        return ws
    if is_admin(request, ws) and store.workspace(wid) is not None:
        return wid
    raise not_found("workspace", wid)


def _key_json(request: Request, k: dict[str, Any]) -> dict[str, Any]:
    return {**k, "current": k["id"] == getattr(request.state, "key_id", None)}


async def _list_keys(request: Request, store: Store, ws: str, wid: str | None
                     ) -> dict[str, Any]:
    target = _target(request, store, ws, wid)
    return {"keys": [_key_json(request, k) for k in store.list_keys(target)]}


async def _create_key(request: Request, store: Store, ws: str, wid: str | None, body: NewKey
                      ) -> dict[str, Any]:
    target = _target(request, store, ws, wid)
    _, rec = store.new_key(target, body.label)
    log.info("API key %s (%s) made for workspace %s", rec["id"], body.label, target)
    return {**rec, "current": False}


async def _revoke_key(request: Request, store: Store, ws: str, wid: str | None, key_id: str
                      ) -> dict[str, Any]:
    target = _target(request, store, ws, wid)
    admin = is_admin(request, ws)
    # the admin may leave another workspace keyless (it can make it a key again); nobody
    # may leave the admin workspace without one (only a restart with admin.key removed
    # would get back in)
    keep_one = not admin or target == ws
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
async def my_keys(request: Request, store: StoreDep, ws: Ws) -> dict[str, Any]:
    """The caller's workspace's keys (ids, labels, dates; ``current``: the one asking)."""
    return await _list_keys(request, store, ws, None)


@router.post("/workspace/keys", status_code=201)
async def my_new_key(body: NewKey, request: Request, store: StoreDep, ws: Ws
                     ) -> dict[str, Any]:
    """A new key of the caller's workspace; ``key`` is shown this once."""
    return await _create_key(request, store, ws, None, body)


@router.delete("/workspace/keys/{key_id}")
async def my_revoke_key(key_id: str, request: Request, store: StoreDep, ws: Ws
                        ) -> dict[str, Any]:
    """Revoke a key of the caller's workspace (itself too, not the last live one)."""
    return await _revoke_key(request, store, ws, None, key_id)


@settings_router.get("/workspace")
async def my_workspace(request: Request, mgr: ManagerDep, store: StoreDep, ws: Ws
                       ) -> dict[str, Any]:
    """The caller's workspace: its maxima and what its sandboxes hold; for the admin
    also the host's capacity and what all sandboxes reserve (``host``)."""
    info = store.workspace(ws) or {"id": ws}
    return {**info, **mgr.admission.usage(ws, host=is_admin(request, ws))}


# ---- any workspace (its own, or the admin any) ------------------------------------------
@router.get("/workspaces/{wid}/keys")
async def keys(wid: str, request: Request, store: StoreDep, ws: Ws) -> dict[str, Any]:
    return await _list_keys(request, store, ws, wid)


@router.post("/workspaces/{wid}/keys", status_code=201)
async def new_key(wid: str, body: NewKey, request: Request, store: StoreDep, ws: Ws
                  ) -> dict[str, Any]:
    return await _create_key(request, store, ws, wid, body)


@router.delete("/workspaces/{wid}/keys/{key_id}")
async def revoke_key(wid: str, key_id: str, request: Request, store: StoreDep, ws: Ws
                     ) -> dict[str, Any]:
    return await _revoke_key(request, store, ws, wid, key_id)


# ---- the admin's: workspaces, their maxima and settings ---------------------------------
@settings_router.post("/workspaces", status_code=201)
async def new_workspace(body: NewWorkspace, request: Request, mgr: ManagerDep,
                        store: StoreDep, ws: Ws) -> dict[str, Any]:
    require_admin(request, ws)
    if store.workspace_by_name(body.name):
        raise ApiError("conflict", f"workspace {body.name!r} exists")
    wid = store.create_workspace(body.name, check_limits_body(body.limits))
    return {"id": wid, "name": body.name, "key": store.add_key(wid, "default"),
            "limits": asdict(mgr.admission.limits(wid))}


@settings_router.put("/workspaces/{wid}/limits")
async def set_limits(wid: str, body: SetLimits, request: Request, mgr: ManagerDep,
                     store: StoreDep, ws: Ws) -> dict[str, Any]:
    """Set a workspace's maxima (admin); names not given take the defaults."""
    require_admin(request, ws)
    if store.workspace(wid) is None:
        raise not_found("workspace", wid)
    store.set_workspace_limits(wid, check_limits_body(body.limits))
    return {"id": wid, "limits": asdict(mgr.admission.limits(wid))}


@settings_router.put("/workspaces/{wid}/settings")
async def set_settings(wid: str, body: WorkspaceSettings, request: Request, store: StoreDep,
                       ws: Ws) -> dict[str, Any]:
    """A workspace's settings (admin): ``default_network``, the egress policy of its
    sandboxes that name none (off | on | allowlist | {"allow": [...]}; null: the
    daemon's CPUOS_DEFAULT_NETWORK); ``spending_cap`` (USD a month; null: none);
    ``default_idle_timeout`` (its sandboxes' idle timeout when they name none; 0: never;
    null: the daemon's CPUOS_IDLE_TIMEOUT); the size defaults ``default_vcpus`` ..."""
    require_admin(request, ws)
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


@router.get("/workspaces")
async def list_workspaces(request: Request, store: StoreDep, ws: Ws,
                          deleted: bool = Query(False, description="deleted ones too")
                          ) -> dict[str, Any]:
    """Every workspace (admin): its record, its live keys and alive sandboxes."""
    require_admin(request, ws)
    out = []
    for w in store.list_workspaces(deleted=deleted):
        live_keys = [k for k in store.list_keys(w["id"]) if k["revoked_at"] is None]
        alive = store.list_sandboxes(w["id"], tuple(s for s in LIVE_STATES if s != State.POOLED))
        out.append({**w, "keys": len(live_keys), "sandboxes": len(alive)})
    return {"workspaces": out}


@router.delete("/workspaces/{wid}")
async def delete_workspace(wid: str, request: Request, mgr: ManagerDep, store: StoreDep,
                           ws: Ws) -> dict[str, Any]:
    """Delete a workspace (admin): its keys are revoked and their requests in flight ended,
    its sandboxes killed (paused ones' snapshots removed); its records are kept. Finishes
    even if the client goes away."""
    require_admin(request, ws)
    w = store.workspace(wid)
    if w is None:
        raise not_found("workspace", wid)
    if wid == ws:
        raise ApiError("conflict", "the admin workspace ('default') cannot be deleted")
    revoked = store.delete_workspace(wid)
    ended = live_requests(request).cancel(revoked)
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
        rows = [r for r in store.list_sandboxes(wid, LIVE_STATES) if r.state != State.POOLED]
        if not rows:
            break
        await asyncio.gather(*(mgr.kill(r.id, reason="workspace_deleted") for r in rows),
                             return_exceptions=True)
        killed += [r.id for r in rows if r.id not in killed]
    return killed
