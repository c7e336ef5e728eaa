"""Pause and resume (lifecycle.snapshots.Snapshots) as a collaborator of their own: given
a store, a backend that writes an image, admission and the Manager's operations as
recorders, a pause quiesces the agent, checkpoints into the sandbox's snapshot directory
(its agent's key and the facts a restoring host must match beside it) and leaves the row
paused with the time it had left; a resume admits it, restores from that image, marks it
running for that time and removes the image; a sandbox paused on another node is not
resumed here. (Real SQLite; real checkpoints: tests/e2e/test_pause*.py, test_snapshots.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, cast

import pytest

from cpuosd.accounting.quotas import Admission
from cpuosd.config import Config
from cpuosd.errors import ApiError, not_found
from cpuosd.events import EventBus
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.snapshots import Snapshots
from cpuosd.lifecycle.states import State
from cpuosd.store import RowSpec, SandboxRow, SqliteStore
from support.fakes import FakeBackend, FakeHost


class Checkpointing(FakeBackend):
    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        await super().checkpoint(sandbox_id, image_dir)
        image_dir.mkdir(parents=True)
        (image_dir / "checkpoint.img").write_bytes(b"image")


class QuietAgent:
    """The channel of a socket agent that hangs up when told to quiesce."""

    def __init__(self) -> None:
        self.streams: dict[int, object] = {}
        self.hello = {"transport": "socket"}
        self.said: list[str] = []

    def stop_listening(self) -> None:
        self.said.append("stop_listening")

    async def call(self, msg: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        self.said.append(msg["t"])
        return {"t": "ok"}

    async def wait_disconnected(self, timeout: float) -> None:
        self.said.append("disconnected")


def test_pause_then_resume(tmp_path: Path) -> None:
    cfg = Config(home=tmp_path / "home")
    store = SqliteStore(cfg.db_path)
    ws = store.create_workspace("w")
    now = time.time()
    row = SandboxRow(id="sbx-000000000001", workspace_id=ws, template="python",
                     backend="fake", state=State.RUNNING, reason=None, created_at=now,
                     started_at=now, ended_at=None, deadline=now + 100,
                     spec=RowSpec(vcpus=1, memory_mib=256, timeout=300.0, agent_key="k" * 64),
                     metadata={})
    store.insert_sandbox(row)
    other = SandboxRow(id="sbx-000000000002", workspace_id=ws, template="python",
                       backend="fake", state=State.PAUSED, reason="requested", created_at=now,
                       started_at=now, ended_at=None, deadline=None,
                       spec=RowSpec(vcpus=1, memory_mib=256), metadata={}, node_id="node-b")
    store.insert_sandbox(other)
    chan = QuietAgent()
    live = {row.id: Live(row, cast(Any, None), cast(Any, chan))}
    backend = Checkpointing()
    did: list[str] = []
    locks: dict[str, asyncio.Lock] = {}

    def get(workspace_id: str, sid: str) -> SandboxRow:
        got = store.get_sandbox(sid)
        if got is None or got.workspace_id != workspace_id:
            raise not_found("sandbox", sid)
        return got

    def running(workspace_id: str, sid: str, op: str) -> Live:
        assert get(workspace_id, sid).state == State.RUNNING
        return live[sid]

    def set_state(sid: str, to: State, **fields: Any) -> None:
        did.append(f"{to}")
        store.update_sandbox(sid, state=to, **fields)

    def finish(sid: str, state: State, reason: str) -> None:
        raise AssertionError(f"{sid} ended: {reason}")

    def mark_running(r: SandboxRow, timeout: float) -> None:
        did.append(f"running for {timeout:.0f}")
        store.update_sandbox(r.id, state=State.RUNNING, deadline=time.time() + timeout)

    async def boot(row: SandboxRow, image: Path | None, *, template_boot: bool = False,
                   resume: bool = False) -> Live:
        assert image is not None and resume
        assert (image / "checkpoint.img").read_bytes() == b"image"
        did.append("restored")
        return Live(row, cast(Any, None), cast(Any, QuietAgent()))

    def new_row(*a: Any, **kw: Any) -> SandboxRow:
        raise AssertionError("no fork here")

    async def teardown(sid: str) -> None:
        raise AssertionError("a good checkpoint is torn down later")

    def teardown_later(sid: str) -> None:
        did.append("teardown_later")
        live.pop(sid)

    def save_agent_key(lv: Live, image_dir: Path) -> None:
        (image_dir / "agent.key").write_text(str(lv.row.spec.agent_key))

    async def kill(sid: str, reason: str = "killed", final_state: State = State.KILLED
                   ) -> None:
        raise AssertionError(f"no kill expected ({sid})")

    snaps = Snapshots(cfg, store, backend, EventBus(), Admission(store, FakeHost()), None,
                      None, set(), lock=lambda sid: locks.setdefault(sid, asyncio.Lock()),
                      get=get, running=running, set_state=set_state, finish=finish,
                      mark_running=mark_running, boot=boot, new_row=new_row,
                      teardown=teardown, teardown_later=teardown_later,
                      save_agent_key=save_agent_key, kill=kill)

    async def main() -> None:
        paused = await snaps.pause(ws, row.id)
        assert paused.state == State.PAUSED and paused.reason == "requested"
        assert paused.deadline is None and paused.remaining is not None
        assert 90 <= paused.remaining <= 100 and paused.snapshot_bytes
        assert did == [State.PAUSING, "teardown_later", State.PAUSED]
        assert chan.said == ["stop_listening", "quiesce", "disconnected"]
        image = cfg.snapshots_dir / row.id
        assert (image / "agent.key").read_text() == "k" * 64
        meta = json.loads(next(p for p in image.iterdir()
                               if p.name not in ("checkpoint.img", "agent.key")).read_text())
        assert meta["sandbox"] == row.id and meta["backend"] == "fake"

        did.clear()
        resumed = await snaps.resume(ws, row.id)
        assert resumed.state == State.RUNNING and resumed.remaining is None
        assert did == [State.RESUMING, "restored", f"running for {paused.remaining:.0f}"]
        assert not image.exists()

        with pytest.raises(ApiError) as e:  # paused on node-b, and no shared store here
            await snaps.resume(ws, other.id)
        assert e.value.code == "conflict" and "node-b" in e.value.message

    try:
        asyncio.run(main())
    finally:
        store.close()
