"""Usage: a per-second meter of what each sandbox holds, and the workspace spending cap.

The meter is a subscriber of the lifecycle's events (never a branch inside it): a
``running`` event opens a *running* interval (the sandbox's vCPUs and memory), ``paused``
closes it and opens a *paused* one (its snapshot's bytes and why it paused: ``idle`` ones
are summed apart as ``idle_paused_seconds``), and ``resuming``, ``killing``,
``killed`` and ``error`` close whatever is open. A create that fails never reaches
``running``, so it costs nothing; a pooled sandbox is billed from the moment it is handed
out (``pooled -> running`` names the workspace). Intervals are rows in SQLite, so a
restarted daemon keeps metering the sandboxes it reattaches; ``reconcile`` closes the
intervals of sandboxes that ended while it was down, at their end time.

Prices (per hour, in the daemon's configuration): ``CPUOS_PRICE_VCPU_HOUR``,
``CPUOS_PRICE_GIB_HOUR`` (memory) while running and ``CPUOS_PRICE_SNAPSHOT_GIB_HOUR``
while paused. Cost = seconds x (vCPUs x vCPU price + GiB x GiB price) for running time,
seconds x snapshot GiB x snapshot price for paused time.

Spending cap: a workspace's ``spending_cap`` setting (currency units per calendar month,
UTC). ``Enforcer`` checks every workspace with a cap each second: at the cap its running
sandboxes are paused (killed where the backend cannot pause), each recorded as a
``limit`` event, and ``check_cap`` refuses create and resume (402 ``spending_cap``).
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from ..config import PricingConfig
from ..errors import ApiError
from ..events import EventBus, SandboxEvent
from ..store import Store
from ..lifecycle.states import State

log = logging.getLogger("cpuosd.usage")

GIB = float(1 << 30)
CLOSES = frozenset({State.PAUSED, State.RESUMING, State.KILLING, State.KILLED, State.ERROR})


def month_start(now: float) -> float:
    t = time.gmtime(now)
    return float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


class Meter:
    """Writes the usage intervals (subscribed to the event bus) and sums them."""

    def __init__(self, store: Store, prices: PricingConfig | None = None) -> None:
        self.store = store
        self.prices = prices or PricingConfig()
        # (workspace, month start) -> (t, cost of the month's intervals that ended by t)
        self._closed: dict[tuple[str, float], tuple[float, float]] = {}

    # ---- recording ----------------------------------------------------------------------
    def on_event(self, ev: SandboxEvent) -> None:
        if ev.kind == State.RUNNING:
            self._close(ev.sandbox, ev.time)
            row = self.store.get_sandbox(ev.sandbox)
            if row is None:
                return
            self.store.usage_open(ev.workspace, ev.sandbox, "running", ev.time,
                                  vcpus=int(row.spec.vcpus or 0),
                                  memory_mib=int(row.spec.memory_mib or 0))
        elif ev.kind in CLOSES:
            self._close(ev.sandbox, ev.time)
            if ev.kind == State.PAUSED:
                size = ev.fields.get("snapshot_bytes")
                if size is None:
                    row = self.store.get_sandbox(ev.sandbox)
                    size = row.snapshot_bytes if row else 0
                reason = ev.fields.get("reason")
                self.store.usage_open(ev.workspace, ev.sandbox, "paused", ev.time,
                                      snapshot_bytes=int(size or 0),
                                      reason=reason if isinstance(reason, str) else None)

    def _close(self, sid: str, at: float) -> None:
        self.store.usage_close(sid, at)

    def reconcile(self) -> None:
        """After a restart: intervals left open by sandboxes that are no longer in the
        state they meter end when their sandbox did (or now)."""
        now = time.time()
        for uid, kind, state, ended_at, paused_at in self.store.usage_dangling():
            if state == kind:
                continue
            at = ended_at or (paused_at if kind == "running" and state == State.PAUSED else None)
            self.store.usage_close_interval(uid, at or now)

    # ---- reading ------------------------------------------------------------------------
    def summary(self, workspace_id: str, since: float, until: float,
                sandbox_id: str | None = None) -> dict[str, Any]:
        """Usage between since and until (open intervals count up to until), in total and
        per sandbox, with its cost at today's prices."""
        per: dict[str, dict[str, float]] = {}
        for u in self.store.usage_intervals(workspace_id, since, until, sandbox_id):
            sid, kind, start, vcpus, mem, snap, reason = (u.sandbox_id, u.kind, u.start,
                                                          u.vcpus, u.memory_mib,
                                                          u.snapshot_bytes, u.reason)
            end = until if u.end is None else u.end
            secs = max(0.0, min(end, until) - max(start, since))
            acc = per.setdefault(sid, _zero())
            if kind == "running":
                acc["running_seconds"] += secs
                acc["vcpu_seconds"] += secs * (vcpus or 0)
                acc["memory_gib_seconds"] += secs * (mem or 0) / 1024
            else:
                acc["paused_seconds"] += secs
                if reason == "idle":
                    acc["idle_paused_seconds"] += secs
                acc["snapshot_gib_seconds"] += secs * (snap or 0) / GIB
        total = _zero()
        for acc in per.values():
            acc["cost"] = self.cost(acc)
            for k, v in acc.items():
                total[k] += v
        return {"workspace": workspace_id, "since": since, "until": until,
                "prices": asdict(self.prices), "currency": "USD",
                "total": _rounded(total),
                "sandboxes": [{"id": sid, **_rounded(acc)} for sid, acc in sorted(per.items())]}

    def cost(self, acc: dict[str, float]) -> float:
        p = self.prices
        return (acc["vcpu_seconds"] * p.vcpu_hour + acc["memory_gib_seconds"] * p.gib_hour
                + acc["snapshot_gib_seconds"] * p.snapshot_gib_hour) / 3600

    def month_cost(self, workspace_id: str, now: float | None = None) -> float:
        """This month's cost so far. The intervals that ended are summed once and kept
        (per workspace and month); each later call reads only the open intervals and those
        that ended since (an index on their end): O(active), whatever the month holds."""
        now = now or time.time()
        since = month_start(now)
        t0, closed = self._closed.get((workspace_id, since), (since, 0.0))
        newly, open_ = 0.0, 0.0
        for u in self.store.usage_recent(workspace_id, t0, now):
            kind, start, vcpus, mem, snap = (u.kind, u.start, u.vcpus, u.memory_mib,
                                             u.snapshot_bytes)
            ended = u.end is not None and u.end <= now
            end = u.end if u.end is not None and ended else now
            secs = max(0.0, min(end, now) - max(start, since))
            acc = _zero()
            if kind == "running":
                acc["vcpu_seconds"] = secs * (vcpus or 0)
                acc["memory_gib_seconds"] = secs * (mem or 0) / 1024
            else:
                acc["snapshot_gib_seconds"] = secs * (snap or 0) / GIB
            if ended:
                newly += self.cost(acc)
            else:
                open_ += self.cost(acc)
        if len(self._closed) > 10_000:
            self._closed.clear()
        self._closed[(workspace_id, since)] = (now, closed + newly)
        return closed + newly + open_


def _zero() -> dict[str, float]:
    return {"running_seconds": 0.0, "vcpu_seconds": 0.0, "memory_gib_seconds": 0.0,
            "paused_seconds": 0.0, "idle_paused_seconds": 0.0, "snapshot_gib_seconds": 0.0,
            "cost": 0.0}


def _rounded(acc: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 8 if k == "cost" else 6) for k, v in acc.items()}


def spending_cap(store: Store, workspace_id: str) -> float | None:
    ws = store.workspace(workspace_id)
    cap = ((ws or {}).get("settings") or {}).get("spending_cap")
    return float(cap) if cap is not None else None


class Enforcer:
    """Holds workspaces to their spending caps: refuses what would start spending past the
    cap, and stops their running sandboxes when the meter reaches it."""

    def __init__(self, store: Store, meter: Meter, events: EventBus,
                 stop: Callable[[str, str], Awaitable[str]], interval: float = 1.0) -> None:
        self.store, self.meter, self.events = store, meter, events
        self.stop = stop  # (workspace, sandbox) -> "paused" | "killed"
        self.interval = interval
        self._stopping: dict[str, asyncio.Task[None]] = {}

    def check_cap(self, workspace_id: str, what: str) -> None:
        """402 if the workspace has spent its cap this month."""
        cap = spending_cap(self.store, workspace_id)
        if cap is None:
            return
        spent = self.meter.month_cost(workspace_id)
        if spent >= cap:
            raise ApiError("spending_cap", f"{what} refused: this workspace has spent "
                           f"{spent:.4f} of its spending cap of {cap:.4f} USD this month",
                           {"limit": "spending_cap", "cap": cap, "spent": round(spent, 6)})

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.enforce()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("spending cap check failed")

    async def enforce(self) -> None:
        for wid in self.store.workspaces_with_setting("spending_cap"):
            cap = spending_cap(self.store, wid)
            if cap is None:
                continue
            spent = self.meter.month_cost(wid)
            if spent < cap:
                continue
            for row in self.store.list_sandboxes(wid, (State.RUNNING,)):
                if row.id not in self._stopping:
                    self._stopping[row.id] = asyncio.ensure_future(
                        self._stop(wid, row.id, cap, spent))

    async def close(self) -> None:
        tasks = list(self._stopping.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    async def _stop(self, wid: str, sid: str, cap: float, spent: float) -> None:
        try:
            action = await self.stop(wid, sid)
        except Exception as e:  # (it may have ended meanwhile)
            action = f"failed: {e}"
        finally:
            self._stopping.pop(sid, None)
        log.info("sandbox %s: spending cap of workspace %s reached (%.4f of %.4f): %s",
                 sid, wid, spent, cap, action)
        self.events.emit(SandboxEvent("limit", sid, wid, None, fields={
            "limit": "spending_cap", "cap": cap, "spent": round(spent, 6),
            "action": action}))
