"""``GET /metrics`` through the API tier (cpuosd.cluster.console): asked of every live node with
the caller's credentials and the node token, each sandbox's entry taken from the node that
measured it; a refusal passed on as the nodes gave it; a bad key refused by the API process.
A real Forwarder and SQLite store, loopback stand-ins for two nodes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from starlette.requests import Request

from cpuosd.cluster import console
from cpuosd.cluster.api import Forwarder
from cpuosd.config import Config
from cpuosd.store.sqlite import SqliteStore

TOKEN = "t" * 24


async def stand_in(answer: dict[str, Any], seen: list[dict[str, str]], status: int = 200
                   ) -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1")
        seen.append({k.strip().lower(): v.strip() for k, _, v in
                     (line.partition(":") for line in head.split("\r\n")[1:] if line)}
                    | {"line": head.split("\r\n")[0]})
        body = json.dumps(answer).encode()
        w.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (status, len(body)) + body)
        await w.drain()
        w.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_metrics_from_every_node(tmp_path: Path) -> None:
    asyncio.run(_metrics(tmp_path))


async def _metrics(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cpuos.db")
    key = store.add_key(store.create_workspace("default"), "k")
    seen: list[dict[str, str]] = []
    base = {"id": "sbx-1", "state": "running", "vcpus": 1}
    paused = {"id": "sbx-3", "state": "paused", "snapshot_bytes": 5}
    a = await stand_in({"time": 1.0, "sandboxes": [{**base, "cpu_seconds": 2.0}, paused,
                                                    {"id": "sbx-2", "state": "running"}]},
                       seen)
    b = await stand_in({"time": 2.0, "sandboxes": [base, paused,
                                                    {"id": "sbx-2", "state": "running",
                                                     "cpu_seconds": 7.0}]}, seen)
    for name, srv in (("node-a", a), ("node-b", b)):
        store.register_node(name, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", "i", {})
    cfg = Config()
    cfg = cfg.replace(cluster=dataclasses.replace(cfg.cluster, role="api", node_token=TOKEN))
    fwd = Forwarder(cfg, store)
    await fwd.start()

    def req(k: str) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/metrics",
                        "query_string": b"workspace=*", "headers": [
                            (b"authorization", f"Bearer {k}".encode()),
                            (b"x-cpuos-node-token", b"from-the-client")]})

    try:
        r = await console.metrics(fwd, req(key))
        assert r.status_code == 200
        got = json.loads(bytes(r.body))
        assert got["time"] == 2.0
        assert got["sandboxes"] == [{**base, "cpu_seconds": 2.0}, paused,
                                    {"id": "sbx-2", "state": "running", "cpu_seconds": 7.0}]
        assert len(seen) == 2 and all(
            h["x-cpuos-node-token"] == TOKEN and h["authorization"] == f"Bearer {key}"
            and h["line"] in ("GET /metrics?workspace=* HTTP/1.1",
                              "GET /metrics?workspace=%2A HTTP/1.1") for h in seen), seen
        r = await console.metrics(fwd, req("cpk_nope"))
        assert r.status_code == 401 and len(seen) == 2
    finally:
        await fwd.close()
        for srv in (a, b):
            srv.close()
        store.close()

    # every node refuses (e.g. workspace=* of a tenant): the nodes' answer, as one gave it
    seen.clear()
    no = await stand_in({"error": {"code": "permission_denied"}}, seen, 403)
    store = SqliteStore(tmp_path / "cpuos.db")
    store.remove_node("node-a")
    store.remove_node("node-b")
    store.register_node("node-c", f"127.0.0.1:{no.sockets[0].getsockname()[1]}", "i", {})
    fwd = Forwarder(cfg, store)
    await fwd.start()
    try:
        r = await console.metrics(fwd, req(key))
        assert r.status_code == 403 and b"permission_denied" in bytes(r.body)
    finally:
        await fwd.close()
        no.close()
        store.close()
