"""``GET /events`` through the API tier (cpuosd.cluster.events), over a real SQLite store and a
real Forwarder, with loopback servers standing in for the nodes' ``/node/events`` streams
(tests/cluster/test_cluster_console.py runs the real nodes): one reader gets its workspace's
events of every node, not another's; a node's stream that breaks does not end the reader's
(the node read again, an ``overflow`` naming it), a node that joins later is read; the
reader's queue is bounded (``overflow`` with the count); a revoked key ends the stream; the
node token is sent, a bad key or a stranger's sandbox refused."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from cpuosd.api.eventstream import QUEUE
from cpuosd.cluster import events as cev
from cpuosd.cluster.api import Forwarder
from cpuosd.config import Config
from cpuosd.lifecycle.states import State
from cpuosd.store import RowSpec, SandboxRow
from cpuosd.store.sqlite import SqliteStore

TOKEN = "t" * 24


class StandIn:
    """A node's /node/events: hello, then what ``push`` gives (None: the connection ends)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.tokens: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        self.tokens += [line.split(":", 1)[1].strip() for line in head.split("\r\n")
                        if line.startswith("x-cpuos-node-token:")]
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                b"\r\n" + f"event: hello\ndata: {json.dumps({'node': self.name})}\n\n".encode())
        await w.drain()
        with contextlib.suppress(ConnectionError):
            while (chunk := await self.queue.get()) is not None:
                w.write(chunk)
                await w.drain()
        w.close()

    def push(self, kind: str, sandbox: str, workspace: str) -> None:
        data = {"kind": kind, "sandbox": sandbox, "workspace": workspace, "previous": None,
                "time": time.time(), "transition": True, "fields": {"node": self.name}}
        self.queue.put_nowait(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@contextlib.asynccontextmanager
async def tier(tmp_path: Path) -> AsyncIterator[tuple[Forwarder, cev.FanIn, dict[str, Any]]]:
    store = SqliteStore(tmp_path / "cpuos.db")
    w1, w2 = store.create_workspace("default"), store.create_workspace("other")
    k1, k2 = store.add_key(w1, "one"), store.add_key(w2, "two")
    nodes = {n: StandIn(f"node-{n}") for n in ("a", "b", "c")}
    for n in ("a", "b"):
        store.register_node(f"node-{n}", await nodes[n].start(), "inc", {})
    for sid, wid in (("sbx-111111111111", w1), ("sbx-222222222222", w2)):
        store.insert_sandbox(SandboxRow(
            id=sid, workspace_id=wid, template="python", backend="gvisor", state=State.RUNNING,
            reason=None, created_at=time.time(), started_at=None, ended_at=None,
            deadline=None, spec=RowSpec(), metadata={}, node_id="node-a"))
    cfg = Config()
    cfg = cfg.replace(cluster=dataclasses.replace(cfg.cluster, role="api", node_token=TOKEN))
    fwd = Forwarder(cfg, store)
    await fwd.start()
    fan = cev.FanIn(fwd)
    try:
        yield fwd, fan, {"store": store, "w1": w1, "w2": w2, "k1": k1, "k2": k2,
                         "nodes": nodes}
    finally:
        await fan.close()
        await fwd.close()
        for s in nodes.values():
            await s.close()
        store.close()


async def until_open(fan: cev.FanIn, node: str) -> None:
    """Until the fan-in holds ``node``'s stream open (at most 10 s)."""
    for _ in range(100):
        if node in fan.open:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{node}'s event stream not open")


def request(key: str, query: str = "") -> Request:
    return Request({"type": "http", "method": "GET", "path": "/events",
                    "query_string": query.encode(), "headers": [
                        (b"authorization", f"Bearer {key}".encode())]})


async def next_event(body: Any, timeout: float = 10) -> tuple[str, Any]:
    """The next event of an SSE body (comments skipped)."""
    while True:
        chunk = (await asyncio.wait_for(body.__anext__(), timeout)).decode()
        if chunk.startswith(":"):
            continue
        kind = next(line[6:].strip() for line in chunk.split("\n") if line.startswith("event:"))
        data = next(line[5:] for line in chunk.split("\n") if line.startswith("data:"))
        return kind, json.loads(data)


def test_one_stream_of_every_nodes_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.setattr(cev, "RETRY", 0.1)
    monkeypatch.setattr(cev, "RECHECK", 0.3)
    asyncio.run(_every_node(tmp_path))


async def _every_node(tmp_path: Path) -> None:
    async with tier(tmp_path) as (fwd, fan, t):
        nodes, w1, w2 = t["nodes"], t["w1"], t["w2"]
        resp = await cev.events(fwd, fan, request(t["k1"]))
        assert resp.status_code == 200 and resp.media_type == "text/event-stream"
        body = resp.body_iterator  # type: ignore[attr-defined]
        kind, hello = await next_event(body)
        assert kind == "hello" and hello["nodes"] == ["node-a", "node-b"]
        assert hello["workspace"] == w1
        assert nodes["a"].tokens == [TOKEN] and nodes["b"].tokens == [TOKEN]
        # the reader's workspace only, from each node
        nodes["a"].push("running", "sbx-1", w1)
        nodes["b"].push("running", "sbx-2", w2)  # (another workspace's)
        nodes["b"].push("killed", "sbx-3", w1)
        got = [await next_event(body), await next_event(body)]
        assert sorted((k, d["sandbox"], d["fields"]["node"]) for k, d in got) == [
            ("killed", "sbx-3", "node-b"), ("running", "sbx-1", "node-a")]
        # node-b's stream breaks: the reader's does not; node-b is read again and the
        # reader told events of it may be lost
        nodes["b"].queue.put_nowait(None)
        kind, gap = await next_event(body)
        assert kind == "overflow" and gap == {"dropped": None, "nodes": ["node-b"]}
        await until_open(fan, "node-b")  # (its stream open again)
        nodes["a"].push("paused", "sbx-1", w1)
        nodes["b"].push("running", "sbx-4", w1)
        got = [await next_event(body), await next_event(body)]
        assert sorted(d["sandbox"] for _, d in got) == ["sbx-1", "sbx-4"]
        # a node that joins later is read too
        t["store"].register_node("node-c", await nodes["c"].start(), "inc", {})
        await until_open(fan, "node-c")
        nodes["c"].push("creating", "sbx-5", w1)
        kind, ev = await next_event(body)
        assert (kind, ev["sandbox"], ev["fields"]["node"]) == ("creating", "sbx-5", "node-c")
        # bounded: what a reader that does not read has no room for is dropped, and counted
        reader = next(iter(fan.readers))
        for _ in range(QUEUE + 5):
            reader.put(b"event: x\ndata: {}\n\n")
        kind, over = await next_event(body)
        assert kind == "overflow" and over == {"dropped": 5}
        for _ in range(QUEUE):
            await body.__anext__()
        # the key revoked: the stream ends (within RECHECK)
        kid = t["store"].key_lookup(t["k1"])[0]
        assert t["store"].revoke_key(w1, kid, keep_one=False) == "revoked"
        with pytest.raises(StopAsyncIteration):
            while True:
                await asyncio.wait_for(body.__anext__(), 10)
        assert not fan.readers


def test_who_may_read(tmp_path: Path) -> None:
    asyncio.run(_who_may_read(tmp_path))


async def _who_may_read(tmp_path: Path) -> None:
    async with tier(tmp_path) as (fwd, fan, t):
        r = await cev.events(fwd, fan, request("cpk_nope"))
        assert r.status_code == 401
        # a sandbox of another workspace: 404, as on one host; an unknown kind: 422
        r = await cev.events(fwd, fan, request(t["k1"], "sandbox=sbx-222222222222"))
        assert r.status_code == 404
        r = await cev.events(fwd, fan, request(t["k1"], "kind=nope"))
        assert r.status_code == 422
        # every workspace: the admin ("default") only
        r = await cev.events(fwd, fan, request(t["k2"], "workspace=*"))
        assert r.status_code == 403
        r = await cev.events(fwd, fan, request(t["k1"], "workspace=*&kind=running"))
        assert r.status_code == 200
        body = r.body_iterator  # type: ignore[attr-defined]
        assert (await next_event(body))[1]["workspace"] == "*"
        t["nodes"]["a"].push("killed", "sbx-1", t["w1"])  # (not a kind it asked for)
        t["nodes"]["b"].push("running", "sbx-2", t["w2"])
        kind, ev = await next_event(body)
        assert (kind, ev["workspace"]) == ("running", t["w2"])
        await body.aclose()
        assert not fan.readers
