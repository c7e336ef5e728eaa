"""A node's answer streamed through the API process (cpuosd.cluster.api: _Streamed) under a
real uvicorn listener: the bytes arrive as the node sent them, the node's answer is closed
when it ends, and a client that goes away mid-stream closes the node's answer promptly (so
the node cancels what it runs: an exec is killed), also while the node sends nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn

from cpuosd.cluster.api import create_api_app
from cpuosd.config import Config
from cpuosd.lifecycle.states import State
from cpuosd.store import RowSpec, SandboxRow, SqliteStore
from support.api_tier import api_services

TOKEN = "t" * 32
SID = "sbx-streamed00001"


class Upstream(httpx.AsyncByteStream):
    """The node's answer: ``chunks``, then (``hang``) nothing for ever; ``closed`` when the
    forwarder closes it."""

    def __init__(self, chunks: list[bytes], hang: bool) -> None:
        self.chunks, self.hang = chunks, hang
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.hang:
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()


@contextlib.asynccontextmanager
async def api_server(tmp: Path, answers: list[Upstream]) -> AsyncIterator[tuple[int, str]]:
    store = SqliteStore(tmp / "cpuos.db")
    ws = store.create_workspace("default")
    _, rec = store.new_key(ws, "admin")
    store.register_node("node-a", "node-a:7780", "i", {})
    now = time.time()
    store.insert_sandbox(SandboxRow(
        id=SID, workspace_id=ws, template="python", backend="gvisor", state=State.RUNNING,
        reason=None, created_at=now, started_at=now, ended_at=None, deadline=now + 300,
        spec=RowSpec(), metadata={}, node_id="node-a"))
    cfg = Config.from_env({"CPUOS_HOME": str(tmp), "CPUOS_ROLE": "api",
                           "CPUOS_NODE_TOKEN": TOKEN})

    async def node(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/x-cpuos-frames"},
                              stream=answers.pop(0))

    svc = api_services(cfg, store, node)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_api_app(cfg, svc), log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=1))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1], str(rec["key"])
    finally:
        server.should_exit = True
        await task
        store.close()


def _request(key: str) -> bytes:
    return (f"GET /sandboxes/{SID}/files?path=/work/x HTTP/1.1\r\nHost: api\r\n"
            f"Authorization: Bearer {key}\r\n\r\n").encode()


def test_a_streamed_answer_arrives_whole_and_is_closed(tmp_path: Path) -> None:
    async def main() -> None:
        up = Upstream([b"one", b"two" * 1000, b"three"], hang=False)
        async with api_server(tmp_path, [up]) as (port, key):
            async with httpx.AsyncClient() as c:
                r = await c.get(f"http://127.0.0.1:{port}/sandboxes/{SID}/files",
                                headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/x-cpuos-frames"
            assert r.content == b"one" + b"two" * 1000 + b"three"
            await asyncio.wait_for(up.closed.wait(), 5)

    asyncio.run(main())


def test_a_client_that_goes_away_mid_stream_closes_the_nodes_answer(tmp_path: Path) -> None:
    async def main() -> None:
        # the node sends a first chunk, then nothing (a quiet exec): the client leaving must
        # still close the node's answer, not only at its next chunk
        ups = [Upstream([b"started"], hang=True), Upstream([b"x"], hang=True)]
        async with api_server(tmp_path, list(ups)) as (port, key):
            for up in ups:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(_request(key))
                got = b""
                while b"\r\n\r\n" not in got or not got.rstrip().endswith(
                        (b"started", b"x")):
                    got += await asyncio.wait_for(reader.read(4096), 5)
                assert got.startswith(b"HTTP/1.1 200"), got
                assert not up.closed.is_set()
                writer.close()
                t0 = time.monotonic()
                await asyncio.wait_for(up.closed.wait(), 5)
                assert time.monotonic() - t0 < 2

    asyncio.run(main())
