"""The deadline watch (lifecycle.deadlines.Deadlines) as a collaborator of its own: given a
store, a task starter and a pause and a kill, it pauses (on_timeout=pause, keeping the
sandbox's timeout for its resume) or kills each sandbox past its deadline, and a pause
that fails ends in a kill. (Real SQLite; the Manager's operations are recorders.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from cpuosd.errors import ApiError
from cpuosd.lifecycle.deadlines import Deadlines
from cpuosd.lifecycle.states import State
from cpuosd.store import RowSpec, SandboxRow, SqliteStore


def test_expired_sandboxes_are_paused_or_killed(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cpuos.db")
    ws = store.create_workspace("w")
    now = time.time()
    for sid, on_timeout, deadline in (("sbx-00000000000p", "pause", now - 1),
                                      ("sbx-00000000000f", "pause", now - 1),
                                      ("sbx-00000000000k", "kill", now - 1),
                                      ("sbx-00000000000l", "kill", now + 3600)):
        store.insert_sandbox(SandboxRow(
            id=sid, workspace_id=ws, template="python", backend="fake",
            state=State.RUNNING, reason=None, created_at=now, started_at=now, ended_at=None,
            deadline=deadline, spec=RowSpec(vcpus=1, memory_mib=256, timeout=42.0),
            metadata={}, on_timeout=on_timeout))

    async def main() -> None:
        paused: list[tuple[str, str, str]] = []
        killed: list[tuple[str, str]] = []
        done = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            tasks.append(asyncio.get_running_loop().create_task(coro))

        async def pause(workspace_id: str, sid: str, reason: str = "requested"
                        ) -> SandboxRow:
            paused.append((workspace_id, sid, reason))
            if sid == "sbx-00000000000f":
                raise ApiError("conflict", "cannot pause")
            store.transition(sid, (State.RUNNING,), State.PAUSING)
            store.transition(sid, (State.PAUSING,), State.PAUSED, deadline=None)
            row = store.get_sandbox(sid)
            assert row is not None
            return row

        async def kill(sid: str, reason: str = "killed") -> None:
            killed.append((sid, reason))
            store.transition(sid, (State.RUNNING,), State.KILLING)
            if len(killed) == 2:
                done.set()

        d = Deadlines(store, 0.01, None, spawn, pause, kill)
        runner = asyncio.get_running_loop().create_task(d.run())
        try:
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.gather(*tasks)
        finally:
            runner.cancel()
        assert sorted(paused) == [(ws, "sbx-00000000000f", "timeout"),
                                  (ws, "sbx-00000000000p", "timeout")]
        assert sorted(killed) == [("sbx-00000000000f", "timeout"),
                                  ("sbx-00000000000k", "timeout")]
        row = store.get_sandbox("sbx-00000000000p")
        assert row is not None and row.state == State.PAUSED and row.remaining == 42.0
        left = store.get_sandbox("sbx-00000000000l")
        assert left is not None and left.state == State.RUNNING  # not yet due

    try:
        asyncio.run(main())
    finally:
        store.close()
