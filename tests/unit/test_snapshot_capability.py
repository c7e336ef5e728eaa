"""A backend that cannot checkpoint: pause/fork refuse before touching the sandbox, and
create boots instead of snapshotting (fake backend; API-layer logic only)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cpuosd.lifecycle.states import State
from cpuosd.config import Config
from cpuosd.errors import ApiError
from cpuosd.lifecycle.manager import Live, Manager
from cpuosd.store import SqliteStore
from support.fakes import FakeBackend


def test_no_checkpoint_capability(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = Config(home=tmp_path)
        store = SqliteStore(cfg.db_path)
        backend = FakeBackend(checkpoint=False)
        mgr = Manager(cfg, store, backend)
        info: dict[str, Any] = {"rootfs": "/nonexistent", "digest": "d"}
        assert await mgr.images.ensure("python", info) is None
        ws = store.create_workspace("w")
        row = mgr._new_row(ws, "python", info, 60, {}, {}, 2, 2048)
        store.update_sandbox(row.id, state="running")
        row.state = State.RUNNING

        class Chan:
            def __init__(self) -> None:
                self.streams: dict[int, object] = {}

        lv = Live(row, mgr._spec(row), Chan())  # type: ignore[arg-type]
        mgr.live[row.id] = lv
        with pytest.raises(ApiError) as e:
            await mgr.snapshots.pause(ws, row.id)
        assert e.value.code == "conflict" and "fake" in e.value.message
        assert store.get_sandbox(row.id).state == "running"  # type: ignore[union-attr]
        assert backend.calls == []
        store.close()

    asyncio.run(main())
