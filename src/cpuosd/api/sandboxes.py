"""Sandboxes: create, list, look at, kill; pause, resume, fork; timeouts and the egress
policy; what the host measures of one and the connections it made; and ``exec`` (a
command's output streamed as frames while it runs)."""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from cpuos_agent import protocol as P

from ..accounting.quotas import Limits
from ..config import Config
from ..errors import invalid
from ..network.policy import Policy
from ..network.secrets import stored_names
from ..paths import check_path
from ..store import ACTIVE_STATES, SandboxRow
from .auth import all_workspaces
from .deps import ManagerDep, NetworkDep, StoreDep, Ws
from .models import CreateSandbox, ExecRequest, ForkRequest, SetNetwork, SetTimeout
from .usage import sandbox_metrics
from ..lifecycle.states import SHOWN, State

router = APIRouter()

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
            v = min(int(settings.get(f"default_{name}")
                        or getattr(cfg.sandbox, f"default_{name}")),
                    getattr(limits, f"max_{name}"))
        out[name] = int(v)
    return out


def sandbox_json(row: SandboxRow) -> dict[str, Any]:
    now = time.time()
    return {
        "id": row.id, "workspace": row.workspace_id, "template": row.template,
        "state": row.state, "reason": row.reason,
        "backend": row.backend, "created_at": row.created_at, "started_at": row.started_at,
        "ended_at": row.ended_at, "deadline": row.deadline,
        "timeout_remaining": max(0.0, row.deadline - now)
        if row.deadline and row.state == State.RUNNING else None,
        "vcpus": row.spec.vcpus, "memory_mib": row.spec.memory_mib,
        "pids": row.spec.pids, "disk_mib": row.spec.disk_mib,
        "network": row.spec.network, "metadata": row.metadata,
        "on_timeout": row.on_timeout, "paused_at": row.paused_at,
        "snapshot_bytes": row.snapshot_bytes,
        "idle_timeout": float(row.spec.idle_timeout or 0.0),
        "node_id": row.node_id,
    }


@router.post("/sandboxes", status_code=201)
async def create(body: CreateSandbox, mgr: ManagerDep, store: StoreDep, net: NetworkDep,
                 ws: Ws) -> dict[str, Any]:
    cfg_ = mgr.cfg
    if float(body.timeout) > cfg_.sandbox.max_timeout:
        raise invalid(f"timeout may be at most {cfg_.sandbox.max_timeout:.0f}s",
                      field="timeout")
    if body.network is not None:
        network: dict[str, Any] | None = Policy.parse(body.network).to_json()
    else:  # the workspace's default, else the daemon's
        w = store.workspace(ws) or {}
        network = (w.get("settings") or {}).get("default_network")
    env = dict(body.env)
    if body.secrets:
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
        pol = Policy.stored(network) if network else Policy.parse(cfg_.network.default_policy)
        pol.secrets, pol.ca = view, ca
        network = pol.to_json()
    wsrow = store.workspace(ws)
    size = sandbox_size(body, wsrow, cfg_, mgr.admission.limits(ws))
    idle = body.idle_timeout
    if idle is None:
        idle = ((wsrow or {}).get("settings") or {}).get("default_idle_timeout")
    idle_timeout = float(cfg_.idle.timeout if idle is None else idle)
    try:
        row = await mgr.create(ws, body.template, float(body.timeout), body.metadata, env,
                               size["vcpus"], size["memory_mib"], body.on_timeout,
                               network=network, pids=size["pids"], disk_mib=size["disk_mib"],
                               idle_timeout=idle_timeout)
    except BaseException:
        # refused before a row existed (admission, template): no event will clean up
        if body.secrets and net is not None:
            net.secrets.forget(sorted(stored_names(network)))
        raise
    if not body.wake_on_request:
        row.spec = replace(row.spec, wake_on_request=False)
        store.update_sandbox(row.id, spec=row.spec)
    return sandbox_json(row)


@router.post("/sandboxes/{sid}/network")
async def set_network(sid: str, body: SetNetwork, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    """A new egress policy; a running sandbox's new connections follow it at once."""
    policy = Policy.parse(body.network).to_json()
    return sandbox_json(await mgr.set_network(ws, sid, policy))


@router.get("/sandboxes/{sid}/metrics")
async def metrics(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    """What the host measures of a running sandbox now: CPU seconds (and the average
    CPU % since it started), memory used and its limit, tasks and their limit, bytes
    on its network link. A paused sandbox has only its snapshot's size."""
    return await sandbox_metrics(mgr, mgr.get(ws, sid))


@router.get("/sandboxes/{sid}/connections")
async def connections(sid: str, mgr: ManagerDep, store: StoreDep, net: NetworkDep, ws: Ws,
                      limit: int = Query(100, ge=1, le=1000),
                      after: int = Query(0, ge=0, description="only records after this n")
                      ) -> dict[str, Any]:
    """Every outbound attempt of the sandbox, newest first: time, proto, dst, port, name,
    verdict (allowed | denied | error), rule, bytes each way."""
    mgr.get(ws, sid)
    if net is not None and net.records is not None:
        await net.records.flush()  # what happened up to now is on record
    return {"connections": store.list_connections(sid, limit, after)}


@router.post("/sandboxes/{sid}/pause")
async def pause(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    """Checkpoint memory, processes and files to disk and stop the sandbox."""
    return sandbox_json(await mgr.snapshots.pause(ws, sid))


@router.post("/sandboxes/{sid}/resume")
async def resume(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    return sandbox_json(await mgr.snapshots.resume(ws, sid))


@router.post("/sandboxes/{sid}/fork", status_code=201)
async def fork(sid: str, body: ForkRequest, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    await mgr.ready(ws, sid, "fork")  # (one paused for idleness: resumed)
    rows = await mgr.snapshots.fork(ws, sid, body.n)
    return {"sandboxes": [sandbox_json(r) for r in rows]}


@router.get("/sandboxes")
async def list_(request: Request, store: StoreDep, ws: Ws, all: bool = False
                ) -> dict[str, Any]:
    """The caller's sandboxes (``all``: ended ones too); the admin's ``workspace=*``:
    every workspace's."""
    states: tuple[State, ...] = SHOWN if all else ACTIVE_STATES
    every = all_workspaces(request)
    rows = [r for r in store.list_sandboxes(None if every else ws, states)
            if r.workspace_id]  # (not a template's boot: the daemon's own)
    return {"sandboxes": [sandbox_json(r) for r in rows]}


@router.get("/sandboxes/{sid}")
async def info(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    return sandbox_json(mgr.get(ws, sid))


@router.delete("/sandboxes/{sid}")
async def kill(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    mgr.get(ws, sid)
    await mgr.kill(sid, reason="killed")
    return sandbox_json(mgr.get(ws, sid))


@router.post("/sandboxes/{sid}/timeout")
async def set_timeout(sid: str, body: SetTimeout, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    if body.timeout is None and body.idle_timeout is None:
        raise invalid("give timeout, idle_timeout or both", field="timeout")
    if (body.timeout is not None
            and float(body.timeout) > mgr.cfg.sandbox.max_timeout):
        raise invalid("timeout too long", field="timeout")
    if body.idle_timeout is not None:
        mgr.set_idle_timeout(ws, sid, float(body.idle_timeout))
    if body.timeout is None:
        return sandbox_json(mgr.get(ws, sid))
    return sandbox_json(mgr.set_timeout(ws, sid, float(body.timeout)))


@router.get("/sandboxes/{sid}/execs")
async def execs(sid: str, mgr: ManagerDep, store: StoreDep, ws: Ws) -> dict[str, Any]:
    mgr.get(ws, sid)
    return {"execs": store.list_execs(sid)}


@router.post("/sandboxes/{sid}/exec",
             responses={200: {"content": {P.CONTENT_TYPE: {}},
                              "description": "a stream of frames (see cpuos_agent.protocol): "
                              "started, out (fd 1|2, raw bytes), then exit or error"}})
async def exec_(sid: str, body: ExecRequest, mgr: ManagerDep, ws: Ws) -> StreamingResponse:
    lv = await mgr.ready(ws, sid)
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
    frames = await mgr.session.exec_start(lv, argv, body.env, cwd, timeout, stdin,
                                  stdin_stream=body.stdin_stream)
    return StreamingResponse(frames, media_type=P.CONTENT_TYPE,
                             headers={"Cache-Control": "no-store"})

