"""Exec and files (lifecycle.exec_files.Session) as a collaborator of its own: given a
store, an event bus, an ExecStdin, a read bound and a task starter, over an agent channel
that answers from a script: an exec's frames are rebuilt from checked fields (an output of
another fd is dropped), its record and its audit event carry the exit and byte counts; a
file declared larger than the read's bound is refused before a byte (413) and the agent
told to stop. (Real SQLite; the agent itself in tests/component.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import pytest

from cpuos_agent import protocol as P
from cpuos_agent.protocol import Kind
from cpuosd.agentconn import Stream
from cpuosd.errors import ApiError
from cpuosd.events import EventBus, SandboxEvent
from cpuosd.lifecycle.commands import ExecStdin
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.exec_files import Session
from cpuosd.lifecycle.states import State
from cpuosd.store import RowSpec, SandboxRow, SqliteStore


class ScriptedChannel:
    """An agent channel whose agent answers each stream opened with the next script;
    what is sent to it is kept (the real Stream runs over it)."""

    generation = 0

    def __init__(self, *scripts: list[tuple[dict[str, Any], bytes]]) -> None:
        self.scripts = list(scripts)
        self.streams: dict[int, Stream] = {}
        self.sent: list[tuple[dict[str, Any], bytes]] = []
        self.opened = 0

    def open(self) -> Stream:
        self.opened += 1
        st = Stream(cast(Any, self), self.opened)
        self.streams[st.id] = st
        for h, payload in self.scripts.pop(0):
            st.queue.put_nowait((cast(Any, h), payload))
        return st

    async def send(self, header: dict[str, Any], payload: bytes = b"",
                   generation: int | None = None) -> None:
        self.sent.append((dict(header), payload))


def test_exec_frames_records_and_a_read_over_its_bound(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cpuos.db")
    ws = store.create_workspace("w")
    now = time.time()
    row = SandboxRow(id="sbx-000000000001", workspace_id=ws, template="python",
                     backend="fake", state=State.RUNNING, reason=None, created_at=now,
                     started_at=now, ended_at=None, deadline=now + 60,
                     spec=RowSpec(vcpus=1, memory_mib=256, workdir="/work"), metadata={})
    store.insert_sandbox(row)
    chan = ScriptedChannel(
        [({"t": Kind.STARTED, "pid": 7}, b""), ({"t": Kind.OUT, "fd": 1}, b"hi\n"),
         ({"t": Kind.OUT, "fd": 7}, b"not an fd of ours"),
         ({"t": Kind.EXIT, "exit_code": 3, "oom": False, "secret": "x"}, b"")],
        [({"t": Kind.OK, "size": 1 << 20, "exact": True}, b"")])
    lv = Live(row, cast(Any, None), cast(Any, chan))
    events = EventBus()
    seen: list[SandboxEvent] = []
    events.subscribe(seen.append)
    tasks: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        tasks.append(t)
        return t

    session = Session(store, events, ExecStdin(), 4096, spawn)

    async def main() -> None:
        frames = await session.exec_start(lv, "echo hi", {"A": "1"}, None, 30.0, None)
        body = b"".join([chunk async for chunk in frames])
        got = P.FrameDecoder().feed(body)
        assert [h["t"] for h, _ in got] == ["started", "out", "exit"]
        assert got[1] == ({"t": "out", "fd": 1}, b"hi\n")
        exit_ = got[2][0]
        assert exit_["exit_code"] == 3 and "secret" not in exit_ and exit_["oom"] is False
        sent = chan.sent[0][0]
        assert sent["shell"] == "echo hi" and sent["cwd"] == "/work"
        assert sent["env"]["A"] == "1" and sent["env"]["HOSTNAME"] == row.id

        assert session.read_limit(None) == 4096 and session.read_limit(10) == 10
        with pytest.raises(ApiError) as e:  # declared 1 MiB, over the bound: no body
            await session.read_file(lv, "/work/big")
        assert e.value.code == "too_large"
        await asyncio.gather(*tasks)
        kills = [h for h, _ in chan.sent if h["t"] == Kind.KILL]
        assert kills == [{"t": Kind.KILL, "id": 2, "reason": "cancelled"}]
        assert not chan.streams  # both closed

    try:
        asyncio.run(main())
        (ex,) = store.list_execs(row.id)
        assert ex["exit_code"] == 3 and ex["stdout_bytes"] == 3 and ex["stderr_bytes"] == 0
        (cmd,) = [ev for ev in seen if ev.kind == "command"]
        assert cmd.fields["exit_code"] == 3 and cmd.fields["env"] == ["A"]
        assert cmd.fields["shell"] == "echo hi" and cmd.fields["stdout_bytes"] == 3
    finally:
        store.close()
