"""The auto-pause and the wake (lifecycle.wake.AutoPause) as a collaborator of its own:
given an IdleWatch, the live sandboxes, a store, an event bus and the Manager's operations
as recorders, the daemon's tick pauses a sandbox idle for its timeout (reason ``idle``,
after an ``idle`` event) and not one with anything open to it; a running event arms the
watch; any number of calls waking a sandbox paused for idleness share one resume. (Real
SQLite; the pause and the resume themselves run for real in tests/e2e/test_idle.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from cpuosd.errors import not_found
from cpuosd.events import EventBus, SandboxEvent
from cpuosd.lifecycle import wake as wake_mod
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.idle import IdleWatch
from cpuosd.lifecycle.states import State
from cpuosd.lifecycle.wake import AutoPause
from cpuosd.store import RowSpec, SandboxRow, SqliteStore


def _row(sid: str, ws: str, state: State, reason: str | None = None) -> SandboxRow:
    now = time.time()
    return SandboxRow(id=sid, workspace_id=ws, template="python", backend="fake",
                      state=state, reason=reason, created_at=now, started_at=now,
                      ended_at=None, deadline=None,
                      spec=RowSpec(vcpus=1, memory_mib=256, idle_timeout=10.0), metadata={})


def _live(row: SandboxRow) -> Live:
    """A live sandbox whose agent is connected with nothing open (the channel's two
    fields this reads)."""
    return Live(row, cast(Any, None), cast(Any, SimpleNamespace(connected=True, streams={})))


def test_idle_sandboxes_are_paused_by_the_tick_and_woken_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wake_mod, "TICK", 0.01)
    store = SqliteStore(tmp_path / "cpuos.db")
    ws = store.create_workspace("w")

    async def main() -> None:
        clock = [0.0]
        busy = {"sbx-0000000000bu"}  # a preview connection open to it
        watch = IdleWatch(lambda sid: None, lambda sid: sid in busy, clock=lambda: clock[0])
        live: dict[str, Live] = {}
        events = EventBus()
        seen: list[SandboxEvent] = []
        events.subscribe(seen.append)
        tasks: list[asyncio.Task[Any]] = []
        locks: dict[str, asyncio.Lock] = {}
        paused: list[tuple[str, str]] = []
        resumed: list[str] = []
        ticks = [0]
        resume_gate = asyncio.Event()

        def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
            t = asyncio.get_running_loop().create_task(coro)
            tasks.append(t)
            return t

        def get(workspace_id: str, sid: str) -> SandboxRow:
            row = store.get_sandbox(sid)
            if row is None or row.workspace_id != workspace_id:
                raise not_found("sandbox", sid)
            return row

        async def pause_locked(lv: Live, reason: str) -> None:
            paused.append((lv.row.id, reason))
            live.pop(lv.row.id)
            store.update_sandbox(lv.row.id, state=State.PAUSED, reason=reason)
            events.emit(SandboxEvent(State.PAUSED, lv.row.id, ws, State.RUNNING))

        async def resume_locked(row: SandboxRow) -> None:
            resumed.append(row.id)
            await resume_gate.wait()
            store.update_sandbox(row.id, state=State.RUNNING, reason=None)

        def tick() -> None:
            ticks[0] += 1

        ap = AutoPause(watch, live, store, events, 2, in_use=lambda sid: sid in busy,
                       tick=tick, spawn=spawn, lock=lambda sid: locks.setdefault(
                           sid, asyncio.Lock()), get=get, pause_locked=pause_locked,
                       resume_locked=resume_locked)
        events.subscribe(ap.on_event)
        for sid in ("sbx-0000000000id", "sbx-0000000000bu"):
            row = _row(sid, ws, State.RUNNING)
            store.insert_sandbox(row)
            live[sid] = _live(row)
            events.emit(SandboxEvent(State.RUNNING, sid, ws, State.CREATING))
        assert set(watch.watches) == {"sbx-0000000000id", "sbx-0000000000bu"}

        runner = asyncio.get_running_loop().create_task(ap.run())
        try:
            clock[0] = 100.0  # past both idle timeouts
            for _ in range(3000):
                if paused:
                    break
                await asyncio.sleep(0.01)
            assert paused == [("sbx-0000000000id", "idle")]
            await asyncio.gather(*tasks)
            assert ticks[0] >= 1 and not ap.pausing
            idle = [e for e in seen if e.kind == "idle"]
            assert [e.sandbox for e in idle] == ["sbx-0000000000id"]
            assert idle[0].fields["idle_timeout"] == 10.0
            assert set(watch.watches) == {"sbx-0000000000bu"}  # disarmed once paused

            row = get(ws, "sbx-0000000000id")
            assert ap.wakes(row) and not ap.wakes(get(ws, "sbx-0000000000bu"))
            requested = _row("sbx-0000000000rq", ws, State.PAUSED, "requested")
            assert not ap.wakes(requested) and ap.wakes(requested, any_pause=True)

            # two calls at once: one resume, both find it running
            calls = [asyncio.get_running_loop().create_task(ap.wake(ws, "sbx-0000000000id"))
                     for _ in range(2)]
            for _ in range(3000):
                if resumed:
                    break
                await asyncio.sleep(0.01)
            assert "sbx-0000000000id" in ap.waking
            resume_gate.set()
            await asyncio.gather(*calls)
            assert resumed == ["sbx-0000000000id"] and not ap.waking
            assert get(ws, "sbx-0000000000id").state == State.RUNNING
        finally:
            runner.cancel()
            for t in tasks:
                t.cancel()

    try:
        asyncio.run(main())
    finally:
        store.close()
