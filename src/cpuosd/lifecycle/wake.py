"""Auto-pause and wake, the Manager's side of lifecycle.idle: the daemon-wide tick that
pauses sandboxes found idle (reason ``idle``, after an ``idle`` event), and ``wake``: one
resume of such a sandbox for any number of calls that need it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..agentconn import TransportError
from ..errors import ApiError
from ..events import NOT_TRANSITIONS, EventBus, SandboxEvent
from ..store import SandboxRow, Store
from .common import Live
from .idle import TICK, IdleWatch
from .states import State

log = logging.getLogger("cpuosd.lifecycle")


def idle_timeout_of(row: SandboxRow) -> float:
    v = row.spec.idle_timeout
    return float(v) if isinstance(v, (int, float)) else 0.0


class AutoPause:
    """The Manager's side of idleness (``Manager.autopause``): the tick, the auto-pause,
    and waking a sandbox for a call. Given what it uses: the Manager's ``IdleWatch``
    (``watch``) and ``live`` sandboxes, the store and the event bus, how many auto-pauses
    may run at once (``parallel``), and the Manager's operations: ``in_use`` (anything open
    to a sandbox), ``tick`` (what else the daemon's tick does), ``spawn`` (a task the
    Manager owns, returned), ``lock`` (a sandbox's lock), ``get`` (a workspace's row, else
    404), ``pause_locked`` and ``resume_locked`` (the pause and the resume, claiming a
    sandbox paused into the shared store, of a sandbox whose lock is held)."""

    def __init__(self, watch: IdleWatch, live: dict[str, Live], store: Store,
                 events: EventBus, parallel: int, *, in_use: Callable[[str], bool],
                 tick: Callable[[], None],
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
                 lock: Callable[[str], asyncio.Lock], get: Callable[[str, str], SandboxRow],
                 pause_locked: Callable[[Live, str], Awaitable[None]],
                 resume_locked: Callable[[SandboxRow], Awaitable[None]]) -> None:
        self.watch, self.live, self.store, self.events = watch, live, store, events
        self._in_use, self._tick, self._spawn, self._lock = in_use, tick, spawn, lock
        self._get, self._pause_locked, self._resume_locked = get, pause_locked, resume_locked
        # the auto-pauses and wakes under way (a kill cancels them; a shutdown waits for
        # the pauses)
        self.pausing: dict[str, asyncio.Task[Any]] = {}
        self.waking: dict[str, asyncio.Task[Any]] = {}
        self._pauses = asyncio.Semaphore(parallel)

    def on_event(self, ev: SandboxEvent) -> None:
        """Subscribed to the lifecycle's events: a sandbox is watched while it runs."""
        if ev.kind == State.RUNNING:
            lv = self.live.get(ev.sandbox)
            if lv is not None:
                self.watch.arm(ev.sandbox, idle_timeout_of(lv.row))
        elif ev.kind not in NOT_TRANSITIONS:
            self.watch.disarm(ev.sandbox)

    async def run(self) -> None:
        """The daemon's one tick (each TICK s): the idle sandboxes due, and ``tick`` (a
        sample of the sandboxes' CPU for admission, the warm pool's size)."""
        while True:
            await asyncio.sleep(TICK)
            try:
                self._tick()
                due = self.watch.due()
            except Exception:
                log.exception("idle check failed")
                continue
            for sid, rate in due:
                if sid not in self.pausing:
                    self._spawn(self._pause(sid, rate))

    async def _pause(self, sid: str, rate: float) -> None:
        """Pause sid for idleness, if it still is idle once its lock is ours. A DELETE
        cancels this (``kill``); what it made is then removed."""
        task = asyncio.current_task()
        assert task is not None
        self.pausing[sid] = task
        paused = False
        try:
            # a few at a time: many sandboxes going idle together must not stall the host
            async with self._pauses, self._lock(sid):
                lv = self.live.get(sid)
                idle = self.watch.idle_for(sid)
                timeout = self.watch.timeout(sid)
                if (lv is None or lv.row.state != State.RUNNING or idle is None or timeout is None
                        or idle < timeout or self._in_use(sid) or not lv.chan.connected):
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
            if self.pausing.get(sid) is task:
                del self.pausing[sid]
            if not paused:
                lv = self.live.get(sid)
                if lv is not None and lv.row.state == State.RUNNING:
                    self.watch.rewatch(sid)

    def wakes(self, row: SandboxRow, any_pause: bool = False) -> bool:
        """Would a call find row's sandbox running after waking it: paused for idleness
        (``any_pause``: paused for any reason), or on its way there or back."""
        if row.state == State.PAUSED:
            return any_pause or row.reason == "idle"
        if row.state == State.PAUSING:
            return any_pause or row.id in self.pausing
        return row.state == State.RESUMING

    async def wake(self, workspace_id: str, sid: str, any_pause: bool = False) -> None:
        """Resume sid if it is paused for idleness (``any_pause``: for any reason), once
        for any number of callers: the resume is a task of its own, so a caller that goes
        away does not cut it short (it ends running, or paused as it was); a DELETE
        cancels it."""
        for _ in range(2):
            t = self.waking.get(sid)
            if t is None:
                t = self._spawn(self._wake(workspace_id, sid, any_pause))
                self.waking[sid] = t
                # (its error goes to the callers waiting; none may be left to take it)
                t.add_done_callback(lambda done: done.cancelled() or done.exception())
                t.add_done_callback(lambda done: self.waking.pop(sid, None)
                                    if self.waking.get(sid) is done else None)
            try:
                await asyncio.shield(t)
            except asyncio.CancelledError:
                if t.cancelled():
                    row = self.store.get_sandbox(sid)
                    raise ApiError("conflict", f"sandbox {sid} stopped while it was being "
                                   f"resumed ({row.state if row else 'gone'})",
                                   {"state": row.state if row else None}) from None
                raise
            row = self._get(workspace_id, sid)
            if not (row.state == State.PAUSED and any_pause):
                return  # (else another caller's wake left it paused: ours goes on)

    async def _wake(self, workspace_id: str, sid: str, any_pause: bool) -> None:
        async with self._lock(sid):
            row = self._get(workspace_id, sid)
            if row.state == State.PAUSED and (any_pause or row.reason == "idle"):
                log.info("sandbox %s: woken by a call (%s)", sid, row.reason)
                await self._resume_locked(row)
