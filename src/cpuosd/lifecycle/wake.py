"""Auto-pause and wake, the Manager's side of lifecycle.idle: the daemon-wide tick that
pauses sandboxes found idle (reason ``idle``, after an ``idle`` event), and ``wake``: one
resume of such a sandbox for any number of calls that need it."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..agentconn import TransportError
from ..errors import ApiError
from ..events import NOT_TRANSITIONS, SandboxEvent
from ..store import SandboxRow
from .idle import TICK
from .states import State

if TYPE_CHECKING:
    from .manager import Manager

log = logging.getLogger("cpuosd.lifecycle")


class Idle:
    """The Manager's side: the tick, the auto-pause, and waking a sandbox for a call."""

    def _idle_timeout_of(self: Manager, row: SandboxRow) -> float:
        v = row.spec.idle_timeout
        return float(v) if isinstance(v, (int, float)) else 0.0

    def _idle_in_use(self: Manager, sid: str) -> bool:
        lv = self.live.get(sid)
        return bool(self.connections.get(sid)) or (lv is not None and bool(lv.chan.streams))

    def _idle_cpu(self: Manager, sid: str) -> float | None:
        return self.backend.cpu_seconds(sid)

    def _idle_on_event(self: Manager, ev: SandboxEvent) -> None:
        """Subscribed to the lifecycle's events: a sandbox is watched while it runs."""
        if ev.kind == State.RUNNING:
            lv = self.live.get(ev.sandbox)
            if lv is not None:
                self.idle.arm(ev.sandbox, self._idle_timeout_of(lv.row))
        elif ev.kind not in NOT_TRANSITIONS:
            self.idle.disarm(ev.sandbox)

    async def _idle_loop(self: Manager) -> None:
        """The daemon's one tick (each TICK s): the idle sandboxes due, and a sample of the
        sandboxes' CPU for admission (two cgroup reads)."""
        while True:
            await asyncio.sleep(TICK)
            try:
                self.host_meter.sample_cpu()
                self._pool_tick()
                due = self.idle.due()
            except Exception:
                log.exception("idle check failed")
                continue
            for sid, rate in due:
                if sid not in self._idle_pausing:
                    self._spawn(self._idle_pause(sid, rate))

    async def _idle_pause(self: Manager, sid: str, rate: float) -> None:
        """Pause sid for idleness, if it still is idle once its lock is ours. A DELETE
        cancels this (``kill``); what it made is then removed."""
        task = asyncio.current_task()
        assert task is not None
        self._idle_pausing[sid] = task
        paused = False
        try:
            # a few at a time: many sandboxes going idle together must not stall the host
            async with self._idle_pauses, self._lock(sid):
                lv = self.live.get(sid)
                idle = self.idle.idle_for(sid)
                timeout = self.idle.timeout(sid)
                if (lv is None or lv.row.state != State.RUNNING or idle is None or timeout is None
                        or idle < timeout or self._idle_in_use(sid) or not lv.chan.connected):
                    return  # touched, in use or changed meanwhile: watched again below
                self.events.emit(SandboxEvent(
                    "idle", sid, lv.row.workspace_id, None,
                    fields={"idle_seconds": round(idle, 3), "idle_timeout": timeout,
                            "cpu_cores": round(rate, 4)}))
                log.info("sandbox %s idle for %.0fs (timeout %.0fs): pausing", sid, idle,
                         timeout)
                try:
                    await self._pause_locked(lv, "idle")
                    paused = True
                except (ApiError, TransportError) as e:
                    log.warning("idle pause of %s failed: %s", sid, e.message)
        finally:
            if self._idle_pausing.get(sid) is task:
                del self._idle_pausing[sid]
            if not paused:
                lv = self.live.get(sid)
                if lv is not None and lv.row.state == State.RUNNING:
                    self.idle.rewatch(sid)

    def wakes(self: Manager, row: SandboxRow, any_pause: bool = False) -> bool:
        """Would a call find row's sandbox running after waking it: paused for idleness
        (``any_pause``: paused for any reason), or on its way there or back."""
        if row.state == State.PAUSED:
            return any_pause or row.reason == "idle"
        if row.state == State.PAUSING:
            return any_pause or row.id in self._idle_pausing
        return row.state == State.RESUMING

    async def wake(self: Manager, workspace_id: str, sid: str, any_pause: bool = False
                   ) -> None:
        """Resume sid if it is paused for idleness (``any_pause``: for any reason), once
        for any number of callers: the resume is a task of its own, so a caller that goes
        away does not cut it short (it ends running, or paused as it was); a DELETE
        cancels it."""
        for _ in range(2):
            t = self._waking.get(sid)
            if t is None:
                t = asyncio.get_running_loop().create_task(
                    self._wake(workspace_id, sid, any_pause))
                self._waking[sid] = t
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
                # (its error goes to the callers waiting; none may be left to take it)
                t.add_done_callback(lambda done: done.cancelled() or done.exception())
                t.add_done_callback(lambda done: self._waking.pop(sid, None)
                                    if self._waking.get(sid) is done else None)
            try:
                await asyncio.shield(t)
            except asyncio.CancelledError:
                if t.cancelled():
                    row = self.store.get_sandbox(sid)
                    raise ApiError("conflict", f"sandbox {sid} stopped while it was being "
                                   f"resumed ({row.state if row else 'gone'})",
                                   {"state": row.state if row else None}) from None
                raise
            row = self.get(workspace_id, sid)
            if not (row.state == State.PAUSED and any_pause):
                return  # (else another caller's wake left it paused: ours goes on)

    async def _wake(self: Manager, workspace_id: str, sid: str, any_pause: bool) -> None:
        async with self._lock(sid):
            row = self.get(workspace_id, sid)
            if row.state == State.PAUSED and (any_pause or row.reason == "idle"):
                log.info("sandbox %s: woken by a call (%s)", sid, row.reason)
                if row.node_id != self.node_id:  # (many hosts: as resume decides)
                    if self.snapstore is None or row.node_id is not None:
                        raise ApiError("conflict", f"sandbox {sid} is paused on node "
                                       f"{row.node_id}, not on this one ({self.node_id})")
                    row = await self._claim(row)  # paused into the shared store: ours now
                await self._resume_locked(row)
