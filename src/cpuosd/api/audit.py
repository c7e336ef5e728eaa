"""The audit trail over HTTP (cpuosd.accounting.audit): a sandbox's rows, filtered and paged
(``GET /sandboxes/{id}/audit``), as JSON lines (``.../audit/export``), and the chain's check
(``GET /audit/verify``). A sandbox of another workspace is a 404, as everywhere."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from ..accounting.audit import DB_NAME, KINDS, AuditLog, Limits, load_key
from ..config import Config
from ..errors import invalid
from ..events import EventBus
from ..store import Store
from .deps import AuditDep, ManagerDep, StoreDep, Ws, is_admin
from ..lifecycle.states import SHOWN, State

router = APIRouter()
MAX_WAIT = 30.0

KindQ = Annotated[list[str] | None, Query(description=f"only these kinds ({', '.join(KINDS)})")]
TimeQ = Annotated[str | None, Query(description="seconds since the epoch or ISO 8601")]


def start_audit(cfg: Config, events: EventBus, store: Store) -> AuditLog:
    """The daemon's audit log, subscribed to its event bus."""

    def workspace(sid: str) -> str | None:
        row = store.get_sandbox(sid)
        return row.workspace_id if row is not None and row.state != State.POOLED else None

    # the chain's key: every node of many must hold the same one (a Secret's file)
    key_path = cfg.audit_key_path
    chain = None
    if store.dialect == "postgres" and cfg.cluster.database_url:
        # many hosts: one chain in the shared database (cpuosd.store.audit_chain)
        from ..store.audit_chain import PgAuditChain

        chain = PgAuditChain(cfg.cluster.database_url, load_key(key_path))
    audit = AuditLog(cfg.home / DB_NAME, key_path, cfg.home / "audit.head",
                     cfg.audit.retention, workspace, Limits.of(cfg.audit), chain=chain)
    if cfg.audit.enabled:
        events.subscribe(audit.on_event, settle=audit.flush)
    return audit


def _time(v: str | None, name: str) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        pass
    try:
        d = datetime.fromisoformat(v)
    except ValueError:
        raise invalid(f"{name} must be seconds since the epoch or an ISO 8601 time",
                      field=name) from None
    return d.timestamp()


def _kinds(kind: list[str] | None) -> tuple[str, ...]:
    out = []
    for k in kind or ():
        for part in k.split(","):
            if part not in KINDS:
                raise invalid(f"unknown kind {part[:40]!r} (known: {', '.join(KINDS)})",
                              field="kind")
            out.append(part)
    return tuple(out)


@router.get("/sandboxes/{sid}/audit")
async def sandbox_audit(sid: str, mgr: ManagerDep, audit: AuditDep, ws: Ws, kind: KindQ = None,
                        since: TimeQ = None, until: TimeQ = None,
                        after: int = Query(0, ge=0, description="only rows after this seq"),
                        limit: int = Query(1000, ge=1, le=10000),
                        wait: float = Query(0, ge=0, le=MAX_WAIT, description=(
                            "with no rows yet, wait up to this many seconds for one "
                            "(a follower's long poll)"))) -> dict[str, Any]:
    """The sandbox's audit rows, oldest first: seq, time, kind, detail, prev_hash, hash.
    Page with ``after`` (the last seq seen; ``next_after`` in the answer)."""
    mgr.get(ws, sid)
    kinds = _kinds(kind)
    t_since, t_until = _time(since, "since"), _time(until, "until")
    deadline = time.monotonic() + wait
    while True:
        await asyncio.to_thread(audit.catch_up)  # what happened up to now is on record
        rows = await asyncio.to_thread(audit.query, sid, kinds, t_since, t_until, after, limit)
        if rows or time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return {"rows": rows, "next_after": rows[-1]["seq"] if rows else after}


@router.get("/sandboxes/{sid}/audit/export",
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": "one audit row (JSON) per line"}})
async def export_audit(sid: str, mgr: ManagerDep, audit: AuditDep, ws: Ws, kind: KindQ = None,
                       since: TimeQ = None, until: TimeQ = None,
                       after: int = Query(0, ge=0)) -> StreamingResponse:
    """Every row of the sandbox as JSON lines (streamed: no limit)."""
    mgr.get(ws, sid)
    kinds = _kinds(kind)
    t_since, t_until = _time(since, "since"), _time(until, "until")
    await asyncio.to_thread(audit.catch_up)

    async def lines() -> AsyncIterator[bytes]:
        last = after
        while True:
            rows = await asyncio.to_thread(audit.query, sid, kinds, t_since, t_until, last,
                                           5000)
            if not rows:
                return
            yield "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
            last = rows[-1]["seq"]

    return StreamingResponse(lines(), media_type="application/x-ndjson",
                             headers={"Cache-Control": "no-store"})


@router.get("/audit/verify")
async def verify(request: Request, audit: AuditDep, store: StoreDep, ws: Ws) -> dict[str, Any]:
    """Check the whole chain: every row's hash (an HMAC under the daemon's key) and its link
    to the row before, the start against the retention anchor, the end against the head the
    writer last recorded. The admin gets the whole answer (rows, head, every problem);
    another workspace only whether the chain holds for its own sandboxes' rows."""
    lock: asyncio.Lock | None = getattr(request.app.state, "audit_verify_lock", None)
    if lock is None:
        lock = request.app.state.audit_verify_lock = asyncio.Lock()
    async with lock:  # one walk of the chain at a time, however many ask
        await asyncio.to_thread(audit.catch_up)
        out = await asyncio.to_thread(audit.verify)
    if is_admin(request, ws):
        return out
    # another workspace learns nothing of the chain but what concerns it: no row count, no
    # head, no problem in another workspace's rows; the chain's own breaks (rows missing,
    # the anchor or the newest row altered: whose rows they were cannot be told) are shown
    mine = {r.id for r in store.list_sandboxes(ws, SHOWN)}
    shown = [p for p in out["problems"] if p.get("sandbox") in mine or p.get("sandbox") is None]
    return {"ok": not shown, "scope": "workspace", "problems": shown,
            "problem_count": len(shown)}
