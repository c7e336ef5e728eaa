"""GET /usage: what a workspace's sandboxes used (per second) and cost, in a time range;
GET /metrics: what the host measures of each of them now (``cpuos top``)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi import APIRouter, Query, Request

from ..accounting.usage import Meter, month_start, spending_cap
from ..errors import invalid
from ..store import SandboxRow
from ..lifecycle.manager import Manager
from .auth import all_workspaces
from .deps import ManagerDep, MeterDep, StoreDep, Ws
from ..lifecycle.states import State

router = APIRouter()


def _when(v: str | None, default: float, what: str) -> float:
    """Seconds since the epoch, or an ISO 8601 time (UTC unless it says otherwise)."""
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise invalid(f"{what} must be seconds since the epoch or an ISO 8601 time, "
                      f"got {v[:40]!r}", field=what) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


@router.get("/usage")
async def usage(mgr: ManagerDep, meter: MeterDep, store: StoreDep, ws: Ws,
                since: str | None = Query(None, description="default: the start of this "
                                          "month (UTC); epoch seconds or ISO 8601"),
                until: str | None = Query(None, description="default: now"),
                sandbox: str | None = Query(None, description="only this sandbox"),
                by: Literal["day"] | None = Query(None, description="day: also the totals "
                                                  "of each UTC day (days)")
                ) -> dict[str, Any]:
    """Running seconds (x vCPUs, x GiB of memory) and paused seconds (x snapshot GiB) of
    the caller's sandboxes between since and until, per sandbox and in total, with their
    cost at the daemon's prices; the workspace's spending cap and this month's spend."""
    now = time.time()
    t0 = _when(since, month_start(now), "since")
    t1 = _when(until, now, "until")
    if t1 < t0:
        raise invalid("until is before since", field="until")
    if sandbox is not None:
        mgr.get(ws, sandbox)  # 404 unless the caller's
    out = meter.summary(ws, t0, min(t1, now), sandbox)
    cap = spending_cap(store, ws)
    month = meter.month_cost(ws, now)
    out["spending_cap"] = {"cap": cap, "month_spent": round(month, 8),
                           "reached": cap is not None and month >= cap}
    if by == "day":
        out["days"] = per_day(meter, ws, t0, min(t1, now), sandbox)
    return out


MAX_DAYS = 400


def per_day(meter: Meter, ws: str, t0: float, t1: float, sandbox: str | None
            ) -> list[dict[str, Any]]:
    """The totals of each UTC day that [t0, t1) touches, each day cut to that range."""
    day = datetime.fromtimestamp(t0, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    out: list[dict[str, Any]] = []
    while day.timestamp() < t1 or not out:
        d0, d1 = day.timestamp(), (day + timedelta(days=1)).timestamp()
        if len(out) >= MAX_DAYS:
            raise invalid(f"by=day covers at most {MAX_DAYS} days: narrow since/until",
                          field="by")
        a, b = max(d0, t0), min(d1, t1)
        out.append({"date": day.date().isoformat(), "since": a, "until": b,
                    **meter.summary(ws, a, b, sandbox)["total"]})
        day += timedelta(days=1)
    return out


async def sandbox_metrics(m: Manager, row: SandboxRow) -> dict[str, Any]:
    """What the host measures of a sandbox now: CPU seconds (and the average CPU % since
    it started), memory used and its limit, tasks and their limit, its disk's use and
    limit, bytes on its network link. A paused sandbox has only its snapshot's size."""
    out: dict[str, Any] = {"id": row.id, "state": row.state, "time": time.time(),
                           "vcpus": row.spec.vcpus,
                           "memory_limit_bytes": (row.spec.memory_mib or 0) << 20,
                           "pids_limit": row.spec.pids,
                           "disk_limit_bytes": (row.spec.disk_mib or 0) << 20}
    if row.state == State.PAUSED:
        out["snapshot_bytes"] = row.snapshot_bytes
    elif row.state == State.RUNNING:
        out.update(await asyncio.to_thread(m.backend.stats, row.id))
        # the sandbox's own limit (its host cgroup's is a little higher: a backstop)
        out["memory_limit_bytes"] = (row.spec.memory_mib or 0) << 20
        if "cpu_seconds" in out and row.started_at:
            up = max(1e-3, time.time() - row.started_at)
            out["cpu_percent_avg"] = round(100 * out["cpu_seconds"] / up, 2)
    return out


@router.get("/metrics")
async def all_metrics(request: Request, m: ManagerDep, ws: Ws) -> dict[str, Any]:
    """sandbox_metrics of each of the caller's running and paused sandboxes (cpuos top);
    the admin's ``workspace=*``: every workspace's."""
    every = all_workspaces(request)
    rows = [r for r in m.store.list_sandboxes(None if every else ws, (State.RUNNING, State.PAUSED))
            if r.workspace_id][:1000]
    return {"time": time.time(),
            "sandboxes": [await sandbox_metrics(m, r) for r in rows]}
