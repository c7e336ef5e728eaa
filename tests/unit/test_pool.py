"""The warm pool's logic (cpuosd.lifecycle.template_images) with restores that only take
time: a burst of creates drains it and is served by refills under way (never more than
CPUOS_POOL_PARALLEL at once) rather than restores of their own; the pool grows with recent
demand up to CPUOS_POOL_MAX, shrinks back once demand stops, fills only where the host has
room for a user's sandbox too, and a create whose refill fails makes its own. (The restores
themselves run for real in tests/e2e and bench/cases/pool.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cpuosd.agentconn import AgentChannel
from cpuosd.config import Config, PoolConfig
from cpuosd.errors import ApiError
from cpuosd.lifecycle import template_images as pool_mod
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.manager import Manager
from cpuosd.lifecycle.states import State
from cpuosd.store import SandboxRow, SqliteStore, Store
from support.daemon import until
from support.fakes import FakeBackend, FakeHost


class PoolManager(Manager):
    """Restores take RESTORE seconds and connect nothing; the rest is the real Manager."""

    RESTORE = 0.05

    def __init__(self, cfg: Config, store: Store, host: FakeHost) -> None:
        super().__init__(cfg, store, FakeBackend(), measure=host)
        # the template's image, made: restores (below) take it as it is
        image = cfg.snapshots_dir / "templates" / self.images.name("python", "0" * 16)
        image.mkdir(parents=True)
        (image / "checkpoint.img").write_bytes(b"")
        self.booting = self.most_booting = 0
        self.own_boots = 0  # restores of a create's own (not the pool's)
        self.fail_next_pooled = False

    async def _boot(self, row: SandboxRow, image: Path | None, *,
                    template_boot: bool = False, resume: bool = False) -> Live:
        self.booting += 1
        self.most_booting = max(self.most_booting, self.booting)
        try:
            await asyncio.sleep(self.RESTORE)
            if row.state == "pooled" and self.fail_next_pooled:
                self.fail_next_pooled = False
                raise ApiError("internal", "restore failed (injected)")
        finally:
            self.booting -= 1
        if row.state != "pooled":
            self.own_boots += 1
        spec = self._spec(row)
        lv = Live(row, spec, AgentChannel(spec.sock_path))
        self.live[row.id] = lv
        return lv


def run(tmp_path: Path, test: Callable[[PoolManager, str, FakeHost], Awaitable[None]],
        **pool_kw: int) -> None:
    async def main() -> None:
        tdir = tmp_path / "templates"
        (tdir / "rootfs").mkdir(parents=True)
        (tdir / "python.json").write_text(json.dumps(
            {"name": "python", "digest": "0" * 16, "rootfs": str(tdir / "rootfs")}))
        cfg = Config(home=tmp_path / "home", templates_path=tdir,
                     pool=PoolConfig(templates=("python",), **pool_kw))  # type: ignore[arg-type]
        store = SqliteStore(cfg.db_path)
        store.create_workspace("default")
        ws = store.create_workspace("w", {"max_sandboxes": 1000})
        host = FakeHost()
        mgr = PoolManager(cfg, store, host)
        try:
            await test(mgr, ws, host)
        finally:
            for t in list(mgr._tasks):
                t.cancel()
            store.close()

    asyncio.run(main())


async def create(mgr: Manager, ws: str) -> SandboxRow:
    return await mgr.create(ws, "python", 60, {}, {}, 2, 2048)


def test_a_burst_is_served_by_refills_within_bounds(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "DEMAND_WINDOW", 1.0)

    async def test(mgr: PoolManager, ws: str, host: FakeHost) -> None:
        pool = mgr.pool.ready.setdefault("python", [])
        mgr.pool.want("python")
        await until(lambda: len(pool) == 1, "the pool filled to CPUOS_POOL_SIZE")
        most = 0
        for _ in range(12):  # back to back: each from the pool or a refill under way
            row = await create(mgr, ws)
            assert row.state == "running"
            most = max(most, len(pool))
        assert mgr.own_boots == 0
        assert mgr.most_booting <= 2  # CPUOS_POOL_PARALLEL
        # recent demand: the pool grows to CPUOS_POOL_MAX, not past it
        await until(lambda: len(pool) == 4, "the pool grown to its bound")
        await asyncio.sleep(0.2)
        assert len(pool) == 4 and mgr.pool.inflight["python"] == 0 and most <= 4
        # demand stops: the pool gives back what it held beyond CPUOS_POOL_SIZE
        await asyncio.sleep(1.1)

        def shrunk() -> bool:
            mgr.pool.tick()
            return len(pool) == 1

        await until(shrunk, "the pool shrunk back")
        await until(lambda: sum(r.state == "pooled" for r in mgr.store.list_sandboxes())
                    == 1, "the discarded pooled sandboxes killed")

    run(tmp_path, test, size=1, max=4, parallel=2)


def test_the_pool_yields_to_users_and_a_failed_refill_is_not_waited_for(
        tmp_path: Path) -> None:
    async def test(mgr: PoolManager, ws: str, host: FakeHost) -> None:
        pool = mgr.pool.ready.setdefault("python", [])
        # a host with room for one more sandbox only: the pool does not take it
        host.set(memory_available_mib=mgr.admission.memory_reserve + 60)
        mgr.pool.want("python")
        await asyncio.sleep(0.2)
        assert pool == [] and not mgr.pool.inflight.get("python")
        await create(mgr, ws)  # a user's create is admitted, and restores its own
        assert mgr.own_boots == 1
        # room again: the pool fills; a create waiting for a refill that fails makes its own
        host.set(memory_available_mib=20000)
        mgr.pool.retry.clear()
        mgr.fail_next_pooled = True
        mgr.pool.want("python")
        assert mgr.pool.can_wait("python")
        row = await create(mgr, ws)
        assert row.state == "running" and mgr.own_boots == 2
        # the failed refill backs off instead of retrying at once
        assert not mgr.pool.inflight.get("python")

    run(tmp_path, test, size=1, max=4, parallel=2)


def test_waiters_count_against_the_workspace_maximum(tmp_path: Path) -> None:
    async def test(mgr: PoolManager, ws: str, host: FakeHost) -> None:
        mgr.store.set_workspace_limits(ws, {"max_sandboxes": 2})
        mgr.pool.want("python")  # one refill under way, none ready
        first = asyncio.ensure_future(create(mgr, ws))
        second = asyncio.ensure_future(create(mgr, ws))
        third = asyncio.ensure_future(create(mgr, ws))
        done = await asyncio.gather(first, second, third, return_exceptions=True)
        errors = [d for d in done if isinstance(d, ApiError)]
        assert len(errors) == 1 and errors[0].details["limit"] == "max_sandboxes"

    run(tmp_path, test, size=1, max=4, parallel=2)


def test_a_stopping_daemon_starts_no_refill_and_ends_every_pooled_sandbox(
        tmp_path: Path) -> None:
    """A refill started during the stop would restore a sandbox after the step that ends
    the pooled ones (run 44 left one running, its row pooled); a pooled sandbox live but
    not in the pool's list (a refill whose teardown outran its bound) is ended too."""
    async def test(mgr: PoolManager, ws: str, host: FakeHost) -> None:
        pool = mgr.pool.ready.setdefault("python", [])
        mgr.pool.want("python")
        await until(lambda: len(pool) == 1, "the pool filled")
        stray = pool.pop()  # live, its row pooled, no longer in the list
        mgr.pool.want("python")
        await until(lambda: len(pool) == 1, "the pool refilled")
        await mgr.shutdown()
        mgr.pool.want("python")  # (a create's take, a refill's end, the tick)
        assert not mgr.pool.inflight.get("python")
        assert mgr.store.list_sandboxes(None, (State.POOLED,)) == []
        ended = mgr.store.get_sandbox(stray.row.id)
        assert ended is not None and ended.state == State.KILLED

    run(tmp_path, test, size=1, max=4, parallel=2)
