"""A backend that cannot checkpoint: pause/fork refuse before touching the sandbox, and
create boots instead of snapshotting (fake backend; API-layer logic only)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cpuosd.backends.base import Capabilities, SandboxSpec
from cpuosd.config import Config
from cpuosd.errors import ApiError
from cpuosd.lifecycle.manager import Live, Manager
from cpuosd.store import Store


class NoSnapshotBackend:
    capabilities = Capabilities(name="fake", checkpoint=False, network=False)
    image_kind = "fake"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start(self, spec: SandboxSpec) -> None:
        self.calls.append("start")

    async def kill(self, sandbox_id: str) -> None:
        self.calls.append("kill")

    async def running(self) -> dict[str, str]:
        return {}

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        self.calls.append("checkpoint")

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        self.calls.append("restore")

    def memory_usage(self, sandbox_id: str) -> int | None:
        return None

    def runtime(self) -> dict[str, str]:
        return {}

    async def close(self) -> None:
        pass


def test_no_checkpoint_capability(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = Config(home=tmp_path)
        store = Store(cfg.db_path)
        backend = NoSnapshotBackend()
        mgr = Manager(cfg, store, backend)
        info: dict[str, Any] = {"rootfs": "/nonexistent", "digest": "d"}
        assert await mgr._template_image("python", info) is None
        ws = store.create_workspace("w")
        row = mgr._new_row(ws, "python", info, 60, {}, {}, 2, 2048)
        store.update_sandbox(row.id, state="running")
        row.state = "running"

        class Chan:
            def __init__(self) -> None:
                self.streams: dict[int, object] = {}

        lv = Live(row, mgr._spec(row), Chan())  # type: ignore[arg-type]
        mgr.live[row.id] = lv
        with pytest.raises(ApiError) as e:
            await mgr.pause(ws, row.id)
        assert e.value.code == "conflict" and "fake" in e.value.message
        assert store.get_sandbox(row.id).state == "running"  # type: ignore[union-attr]
        assert backend.calls == []
        store.close()

    asyncio.run(main())
