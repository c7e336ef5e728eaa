"""The restart's reconcile (lifecycle.reconcile.Reconcile) as a collaborator of its own:
given a store, a backend and the Manager's operations as recorders, it makes the rows and
the host agree: a running sandbox that is gone is lost, a paused one without its image
too, a pause cut short after its image was written is paused, a pooled one is discarded;
what runs without a live record is killed; stray sandbox and snapshot directories and
template images of older builds are removed. (Real SQLite and directories; the reattach of
sandboxes still running, which needs their agents, runs for real in tests/e2e.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from cpuosd.backends.base import SandboxSpec
from cpuosd.config import Config
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.reconcile import Reconcile
from cpuosd.lifecycle.states import State
from cpuosd.store import RowSpec, SandboxRow, SqliteStore
from support.fakes import FakeBackend


class Host(FakeBackend):
    """What runs on the host: ``running`` says so, ``kill`` records which."""

    def __init__(self, running: dict[str, str]) -> None:
        super().__init__()
        self.up = running
        self.killed: list[str] = []

    async def running(self) -> dict[str, str]:
        return dict(self.up)

    async def kill(self, sandbox_id: str) -> None:
        self.killed.append(sandbox_id)
        self.up.pop(sandbox_id, None)


def test_rows_and_host_agree_after_a_restart(tmp_path: Path) -> None:
    tdir = tmp_path / "templates"
    (tdir / "rootfs").mkdir(parents=True)
    (tdir / "python.json").write_text(json.dumps(
        {"name": "python", "digest": "1" * 16, "rootfs": str(tdir / "rootfs")}))
    cfg = Config(home=tmp_path / "home", templates_path=tdir)
    for d in (cfg.sandboxes_dir, cfg.snapshots_dir / "templates"):
        d.mkdir(parents=True)
    store = SqliteStore(cfg.db_path)
    ws = store.create_workspace("w")
    now = time.time()
    rows = {"sbx-0000000000ru": State.RUNNING,  # not running on the host: lost
            "sbx-0000000000pa": State.PAUSED,  # its image is there: stays paused
            "sbx-0000000000pg": State.PAUSING,  # image written, not renamed: paused
            "sbx-0000000000sl": State.PAUSED,  # no image: snapshot_lost
            "sbx-0000000000po": State.POOLED,  # the pool is not kept across restarts
            "sbx-0000000000pr": State.PAUSED}  # paused, yet its container still runs
    for sid, state in rows.items():
        store.insert_sandbox(SandboxRow(
            id=sid, workspace_id=ws, template="python", backend="fake", state=state,
            reason=None, created_at=now, started_at=now, ended_at=None,
            deadline=now + 60 if state == State.PAUSING else None,
            spec=RowSpec(vcpus=1, memory_mib=256, timeout=42.0), metadata={}))
    for sid in ("sbx-0000000000pa", "sbx-0000000000pr"):
        (cfg.snapshots_dir / sid).mkdir()
        (cfg.snapshots_dir / sid / "checkpoint.img").write_bytes(b"image")
    tmp_image = cfg.snapshots_dir / ".sbx-0000000000pg.tmp"
    tmp_image.mkdir()
    (tmp_image / "checkpoint.img").write_bytes(b"image")
    for stray in (cfg.sandboxes_dir / "sbx-0000000000ru", cfg.snapshots_dir / "sbx-gone",
                  cfg.snapshots_dir / "templates" / "python-old",
                  cfg.snapshots_dir / "templates" / "python-current"):
        stray.mkdir()
    agent_dir = cfg.home / "agent" / "current"
    older_agent = cfg.home / "agent" / "older"
    for d in (agent_dir, older_agent):
        d.mkdir(parents=True)
    host = Host({"sbx-0000000000pr": "running", "sbx-notarecord": "running"})

    states: list[tuple[str, State, dict[str, Any]]] = []
    finished: list[tuple[str, State, str]] = []

    def set_state(sid: str, to: State, **fields: Any) -> None:
        states.append((sid, to, fields))
        store.update_sandbox(sid, state=to, **fields)

    def finish(sid: str, state: State, reason: str) -> None:
        finished.append((sid, state, reason))
        store.update_sandbox(sid, state=state, reason=reason, ended_at=time.time())

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        raise AssertionError("nothing to reattach, nothing to start")

    async def kill(sid: str, reason: str = "killed", final_state: State = State.KILLED
                   ) -> None:
        raise AssertionError(f"no kill expected ({sid})")

    async def watch_memory(lv: Live) -> None:
        raise AssertionError("nothing reattached")

    def spec(row: SandboxRow) -> SandboxSpec:
        raise AssertionError("nothing reattached")

    watched: list[str] = []
    live: dict[str, Live] = {}
    r = Reconcile(cfg, store, host, None, live, agent_dir, spec=spec, spawn=spawn,
                  kill=kill, set_state=set_state, finish=finish,
                  watch_memory=watch_memory, watch_idle=lambda row: watched.append(row.id),
                  template_image_name=lambda t, digest: f"{t}-current")
    try:
        asyncio.run(r.run())
        assert sorted(finished) == [
            ("sbx-0000000000po", State.KILLED, "pool_discarded"),
            ("sbx-0000000000ru", State.ERROR, "lost"),
            ("sbx-0000000000sl", State.ERROR, "snapshot_lost")]
        assert [(sid, to) for sid, to, _ in states] == [("sbx-0000000000pg", State.PAUSED)]
        fields = states[0][2]
        assert fields["deadline"] is None and fields["snapshot_bytes"] == len(b"image")
        assert 1.0 <= fields["remaining"] <= 60.0
        assert set(host.killed) == {"sbx-0000000000pr", "sbx-notarecord"}
        assert not live and not watched
        snaps = sorted(p.name for p in cfg.snapshots_dir.iterdir())
        assert snaps == ["sbx-0000000000pa", "sbx-0000000000pg", "sbx-0000000000pr",
                         "templates"]
        assert (cfg.snapshots_dir / "sbx-0000000000pg" / "checkpoint.img").exists()
        assert [p.name for p in (cfg.snapshots_dir / "templates").iterdir()] == [
            "python-current"]
        assert list(cfg.sandboxes_dir.iterdir()) == []
        # paused sandboxes may still mount an older agent copy: it stays
        assert older_agent.is_dir() and agent_dir.is_dir()
        got = store.get_sandbox("sbx-0000000000pr")
        assert got is not None and got.state == State.PAUSED
    finally:
        store.close()
