"""The API tier's preview relay (cpuosd.cluster.preview) and the forwarder's E2B routing
(cpuosd.cluster.api), over a real SQLite store and a real Forwarder, with two loopback
servers standing in for two nodes' preview listeners (tests/cluster runs the real nodes):
each request, also on one kept-alive connection, goes to the node its Host or path names;
the request arrives as the client sent it (Host, token, cookies; a client's node-token
header dropped; X-Forwarded-For extended); unknown sandbox 404, a node not alive 503, a
sandbox paused into the store to a placeable node; an E2B request goes by its header or
path, its create by placement."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from cpuosd.lifecycle.states import State
from cpuosd.cluster.api import Forwarder
from cpuosd.cluster.preview import PreviewRelay
from cpuosd.config import Config
from cpuosd.store import RowSpec, SandboxRow
from cpuosd.store.sqlite import SqliteStore

TOKEN = "t" * 24
SIDS = {"a": "sbx-aaaaaaaaaaaa", "b": "sbx-bbbbbbbbbbbb", "store": "sbx-ssssssssssss",
        "gone": "sbx-gggggggggggg"}


async def _node(name: str) -> asyncio.Server:
    """A stand-in for a node's preview listener: answers what it got, as JSON."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                hdrs = [line.split(":", 1) for line in lines[1:] if ":" in line]
                body = json.dumps({"node": name, "line": lines[0],
                                   "headers": [[k.strip().lower(), v.strip()]
                                               for k, v in hdrs]}).encode()
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@contextlib.asynccontextmanager
async def relay(tmp_path: Path) -> AsyncIterator[tuple[PreviewRelay, Forwarder]]:
    store = SqliteStore(tmp_path / "cpuos.db")
    nodes = {n: await _node(f"node-{n}") for n in ("a", "b")}
    ws = store.create_workspace("w")
    for n, srv in nodes.items():
        port = srv.sockets[0].getsockname()[1]
        store.register_node(f"node-{n}", f"127.0.0.1:{port + 1}", "inc", {
            "preview_address": f"127.0.0.1:{port}",
            "capacity": {"memory_available_mib": 1000 if n == "b" else 10}})
    for key, node in (("a", "node-a"), ("b", "node-b"), ("store", None), ("gone", "node-z")):
        store.insert_sandbox(SandboxRow(
            id=SIDS[key], workspace_id=ws, template="python", backend="gvisor",
            state=State.PAUSED if node is None else State.RUNNING, reason=None,
            created_at=time.time(), started_at=None, ended_at=None, deadline=None,
            spec=RowSpec(),
            metadata={}, node_id=node))
    cfg = Config()
    cfg = cfg.replace(cluster=dataclasses.replace(cfg.cluster, role="api", node_token=TOKEN))
    fwd = Forwarder(cfg, store)
    await fwd.start()
    pv = PreviewRelay(fwd, 0, "127.0.0.1", cfg.preview)
    await pv.start()
    try:
        yield pv, fwd
    finally:
        await pv.close()
        await fwd.close()
        for srv in nodes.values():
            srv.close()
            await srv.wait_closed()
        store.close()


def test_each_request_goes_to_its_sandboxs_node(tmp_path: Path) -> None:
    asyncio.run(_each_request(tmp_path))


async def _each_request(tmp_path: Path) -> None:
    async with relay(tmp_path) as (pv, _):
        base = f"http://127.0.0.1:{pv.port}"

        def host(sid: str, port: int = 3000) -> dict[str, str]:
            return {"Host": f"{port}-{sid}.localhost:{pv.port}"}

        async with httpx.AsyncClient(timeout=30) as c:  # (one kept-alive connection)
            for sid, node in ((SIDS["a"], "node-a"), (SIDS["b"], "node-b"),
                              (SIDS["a"], "node-a")):
                r = await c.get(base + "/x?cpuos_token=tok", headers={
                    **host(sid), "Cookie": "cpuos_token_3000=c", "X-Cpuos-Node-Token": "no",
                    "X-Forwarded-For": "1.2.3.4"})
                got = r.json()
                assert r.status_code == 200 and got["node"] == node
                hdrs = dict(got["headers"])
                # as sent (the node applies the token rules), but never a node token from a client
                assert got["line"] == "GET /x?cpuos_token=tok HTTP/1.1"
                assert hdrs["host"] == host(sid)["Host"] and hdrs["cookie"] == "cpuos_token_3000=c"
                assert "x-cpuos-node-token" not in hdrs
                assert hdrs["x-forwarded-for"] == "1.2.3.4, 127.0.0.1"
            # the path form
            r = await c.get(f"{base}/sandboxes/{SIDS['b']}/ports/8080/y")
            assert r.json()["node"] == "node-b" and r.json()["line"].startswith(
                f"GET /sandboxes/{SIDS['b']}/ports/8080/y ")
            # paused into the store (on no node): the node placement picks (the most memory)
            r = await c.get(base + "/", headers=host(SIDS["store"]))
            assert r.json()["node"] == "node-b"
        for headers, path, status, code in (
                (host("sbx-000000000000"), "/", 404, "not_found"),  # unknown sandbox
                ({}, "/", 404, "not_found"),  # no preview named
                (host(SIDS["gone"]), "/", 503, "unavailable")):  # its node is not alive
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.get(base + path, headers=headers)
            assert r.status_code == status and r.json()["error"]["code"] == code, r.text


def test_e2b_requests_are_routed_by_sandbox(tmp_path: Path) -> None:
    asyncio.run(_e2b(tmp_path))


async def _e2b(tmp_path: Path) -> None:
    async with relay(tmp_path) as (_, fwd):
        key = fwd.store.add_key(fwd.store.create_workspace("e"), "k")
        api_key = [(b"x-api-key", key.encode())]
        by_header = [(b"e2b-sandbox-id", SIDS["b"].encode())]
        ok, found = fwd._route(by_header, "/e2b/files")
        assert ok and found == (SIDS["b"], "node-b")  # (the node checks the access token)
        assert fwd._target("POST", "/e2b/files", found).node_id == "node-b"
        ok, found = fwd._route(api_key, f"/e2b/sandboxes/{SIDS['a']}/pause")
        assert ok and found == (SIDS["a"], "node-a")
        ok, found = fwd._route(api_key, f"/e2b/v2/sandboxes/{SIDS['a']}/connect")
        assert ok and found == (SIDS["a"], "node-a")
        bad = [(b"x-api-key", b"e2b_" + b"0" * 40)]
        assert fwd._route(bad, "/e2b/sandboxes") == (False, None)
        # a create goes where placement says
        assert fwd._target("POST", "/e2b/sandboxes", None).node_id == "node-b"
        assert fwd._target("POST", "/e2b/v2/sandboxes", None).node_id == "node-b"


def test_a_lease_carries_the_preview_address() -> None:
    """CPUOS_MEMBERSHIP=kubernetes: a node's preview address survives its Lease's facts."""
    from cpuosd.cluster.membership import NodeFacts
    from cpuosd.cluster.nodes import facts_of_lease, lease_facts

    f = lease_facts({"address": "10.0.0.1:7780", "preview_address": "10.0.0.1:7781"},
                    "node-a", "inc")
    back = facts_of_lease(NodeFacts.from_annotation(f.to_annotation()))
    assert back["address"] == "10.0.0.1:7780" and back["preview_address"] == "10.0.0.1:7781"
