"""The snapshot store's sweep run by an API process (cpuosd.cluster.sweep) over a real
directory store: what an unfinished put left and a fork image nobody released go once
older than CPUOS_SNAPSHOT_SWEEP_AFTER; a whole snapshot, and leftovers younger than the
bound, stay; one process sweeps at a time (the store's lease)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from cpuosd.cluster.sweep import Sweeper
from cpuosd.config import Config
from cpuosd.snapstore import DirectorySnapshotStore
from cpuosd.snapstore.base import MANIFEST
from cpuosd.store import SqliteStore
from cpuosd.wiring import build_api_services


def _image(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "checkpoint.img").write_bytes(b"x" * 100)
    return d


def _age(p: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(p, (t, t))


def _leftovers(root: Path) -> tuple[Path, Path, Path, str]:
    """An old unfinished put, a new one, an old fork image (its manifest says so)."""
    old_put = _image(root / ".incoming-sbx-aaaaaaaaaaaa-1234")
    _age(old_put, 7200)
    new_put = _image(root / ".incoming-sbx-bbbbbbbbbbbb-5678")
    fork = "fork-sbx-cccccccccccc-0badf00d"
    store = DirectorySnapshotStore(root, shared=True)
    asyncio.run(store.put(fork, _image(root.parent / "src-fork")))
    m = json.loads((root / fork / MANIFEST).read_text())
    m["created_at"] = time.time() - 7200
    (root / fork / MANIFEST).write_text(json.dumps(m))
    return old_put, new_put, root / fork, fork


def test_the_sweep_removes_old_leftovers_only(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    snaps = DirectorySnapshotStore(root, shared=True)
    asyncio.run(snaps.put("sbx-dddddddddddd", _image(tmp_path / "src-paused")))
    (root / "sbx-dddddddddddd").touch()
    _age(root / "sbx-dddddddddddd", 7200)  # (a paused sandbox's image: never swept)
    young_fork = "fork-sbx-eeeeeeeeeeee-12345678"
    asyncio.run(snaps.put(young_fork, _image(tmp_path / "src-young")))
    old_put, new_put, fork_dir, fork = _leftovers(root)
    store = SqliteStore(tmp_path / "cpuos.db")
    try:
        a = Sweeper(store, snaps, 3600, lambda: None)
        b = Sweeper(store, snaps, 3600, lambda: None)
        gone = a.sweep_once()
        assert gone is not None and sorted(gone) == sorted([old_put.name, fork])
        assert b.sweep_once() is None  # (a holds the lease)
        assert not old_put.exists() and not fork_dir.exists()
        assert new_put.exists() and (root / young_fork).is_dir()
        assert asyncio.run(snaps.exists("sbx-dddddddddddd"))
        # under Kubernetes the leader sweeps, whoever holds the lease
        assert Sweeper(store, snaps, 3600, lambda: False).sweep_once() is None
        assert Sweeper(store, snaps, 3600, lambda: True).sweep_once() == []
    finally:
        store.close()


def test_an_api_process_sweeps_the_store(tmp_path: Path) -> None:
    """build_api_services with a shared directory store and a 1 s bound: the leftovers
    older than it go, by itself."""
    root = tmp_path / "shared"
    root.mkdir()
    old_put, new_put, fork_dir, _ = _leftovers(root)
    _age(new_put, 5)  # (older than this test's bound too)
    (tmp_path / "api").mkdir()
    cfg = Config.from_env({"CPUOS_HOME": str(tmp_path / "api"), "CPUOS_ROLE": "api",
                           "CPUOS_NODE_TOKEN": "t" * 32,
                           "CPUOS_SNAPSHOT_STORE": f"file://{root}",
                           "CPUOS_SNAPSHOT_SWEEP_AFTER": "1"})
    store = SqliteStore(tmp_path / "cpuos.db")

    async def main() -> None:
        svc = await build_api_services(cfg, store=store)
        try:
            deadline = time.monotonic() + 30
            while old_put.exists() or new_put.exists() or fork_dir.exists():
                assert time.monotonic() < deadline, sorted(p.name for p in root.iterdir())
                await asyncio.sleep(0.05)
        finally:
            await svc.close()

    try:
        asyncio.run(main())
    finally:
        store.close()
