"""The API process's route cache (cpuosd.cluster.api.Forwarder): a request under
/sandboxes/<id> goes straight to the node it last found holding the sandbox, marked, with no
trip to the store; that node answers 421 unless it holds the sandbox live
(cpuosd.cluster.nodes.NodeTokenGuard), and the request then goes where the sandbox's row
says, with the same body. Nodes answer as httpx.MockTransport says here; the real two-node
paths run in tests/cluster."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from cpuosd.lifecycle.states import State
from cpuosd.cluster.nodes import NodeTokenGuard
from cpuosd.config import Config
from cpuosd.store import RowSpec, SandboxRow, SqliteStore
from support.api_tier import api_client

TOKEN = "t" * 32
SID = "sbx-routed000001"
Handler = Callable[[httpx.Request], httpx.Response]


class Env:
    def __init__(self, tmp: Path) -> None:
        self.store = SqliteStore(tmp / "cpuos.db")
        ws = self.store.create_workspace("default")
        self.key_id, rec = self.store.new_key(ws, "admin")
        self.ws, self.key = ws, str(rec["key"])
        for nid in ("node-a", "node-b"):
            self.store.register_node(nid, f"{nid}:7780", "i", {
                "capacity": {"memory_available_mib": 8000}})
        now = time.time()
        self.store.insert_sandbox(SandboxRow(
            id=SID, workspace_id=ws, template="python", backend="gvisor", state=State.RUNNING,
            reason=None, created_at=now, started_at=now, ended_at=None, deadline=now + 300,
            spec=RowSpec(memory_mib=512), metadata={}, node_id="node-a"))
        self.cfg = Config.from_env({"CPUOS_HOME": str(tmp), "CPUOS_ROLE": "api",
                                    "CPUOS_NODE_TOKEN": TOKEN})
        self.calls: list[httpx.Request] = []
        self.lookups = 0
        real = self.store.get_sandbox

        def counted(sid: str) -> SandboxRow | None:
            self.lookups += 1
            return real(sid)

        self.store.get_sandbox = counted  # type: ignore[method-assign]

    @contextlib.contextmanager
    def client(self, handler: Handler) -> Iterator[TestClient]:
        with api_client(self.cfg, self.store, self.key, handler, self.calls) as c:
            yield c

    def seen(self) -> list[tuple[str, str | None, bytes]]:
        out = [(r.url.host, r.headers.get("x-cpuos-route"), r.content) for r in self.calls]
        self.calls.clear()
        return out


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.store.close()


def holding(env: Env) -> Handler:
    """Nodes that answer an exec when they hold the sandbox (the row's node), and 421 to a
    marked request otherwise, as NodeTokenGuard does."""
    def handler(r: httpx.Request) -> httpx.Response:
        assert r.headers["x-cpuos-node-token"] == TOKEN
        row = env.store.get_sandbox(SID)
        env.lookups -= 1  # (the node's own read, not the API process's)
        here = row is not None and row.node_id == r.url.host
        if r.headers.get("x-cpuos-route") == "cached" and not here:
            return httpx.Response(421, headers={"x-cpuos-route": "elsewhere"},
                                  json={"error": {"code": "conflict", "message": "not here"}})
        assert here, "an unmarked request went to a node not holding the sandbox"
        body = json.dumps({"node": r.url.host, "cmd": json.loads(r.content)}).encode()
        return httpx.Response(200, stream=httpx.ByteStream(body))  # (streamed back)
    return handler


def test_the_second_request_skips_the_store_and_a_move_is_followed(env: Env) -> None:
    with env.client(holding(env)) as c:
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "one"})
        assert r.status_code == 200 and r.json()["node"] == "node-a"
        assert env.seen() == [("node-a", None, b'{"cmd":"one"}')] and env.lookups == 1
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "two"})
        assert r.json() == {"node": "node-a", "cmd": {"cmd": "two"}}
        assert env.seen() == [("node-a", "cached", b'{"cmd":"two"}')]
        assert env.lookups == 1  # (the key and the node from the caches)

        # paused on node A, resumed on node B (by another API process): A refuses the
        # guess, the same request goes where the row says
        assert env.store.transition(SID, (State.RUNNING,), State.RUNNING, new_epoch=True,
                                    node_id="node-b")
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "three"})
        assert r.status_code == 200 and r.json() == {"node": "node-b",
                                                      "cmd": {"cmd": "three"}}
        assert env.seen() == [("node-a", "cached", b'{"cmd":"three"}'),
                              ("node-b", None, b'{"cmd":"three"}')]
        assert env.lookups == 2
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "four"})
        assert r.json()["node"] == "node-b"
        assert env.seen() == [("node-b", "cached", b'{"cmd":"four"}')] and env.lookups == 2


def test_a_failed_send_is_never_sent_again(env: Env) -> None:
    state = {"fail": False}
    ok = holding(env)

    def handler(r: httpx.Request) -> httpx.Response:
        if state["fail"]:
            raise httpx.ReadError("the node went away mid-answer", request=r)
        return ok(r)

    with env.client(handler) as c:
        assert c.post(f"/sandboxes/{SID}/exec", json={"cmd": "one"}).status_code == 200
        env.seen()
        state["fail"] = True  # (it may have run: sending it again would run it twice)
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "two"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert env.seen() == [("node-a", "cached", b'{"cmd":"two"}')]


def test_a_callers_route_header_is_not_forwarded(env: Env) -> None:
    with env.client(holding(env)) as c:
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "one"},
                   headers={"X-Cpuos-Route": "cached"})
        assert r.status_code == 200
        assert env.seen() == [("node-a", None, b'{"cmd":"one"}')]


def test_a_revoked_key_is_not_routed_by_the_cache_once_its_check_expires(env: Env,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import cpuosd.cluster.api as api

    monkeypatch.setattr(api, "KEY_CACHE", 0.0)  # (every request checks the key)
    with env.client(holding(env)) as c:
        assert c.post(f"/sandboxes/{SID}/exec", json={"cmd": "one"}).status_code == 200
        env.store.revoke_key(env.ws, env.key_id, keep_one=False)
        r = c.post(f"/sandboxes/{SID}/exec", json={"cmd": "two"})
        assert r.status_code == 401
        assert [h for h, *_ in env.seen()] == ["node-a"]


def _node_app(live: set[str]) -> Starlette:
    async def exec_(request: Request) -> JSONResponse:
        return JSONResponse({"ran": request.path_params["sid"]})

    app = Starlette(routes=[Route("/sandboxes/{sid}/exec", exec_, methods=["POST"])])
    app.state.services = SimpleNamespace(manager=SimpleNamespace(live=dict.fromkeys(live)))
    app.add_middleware(NodeTokenGuard, token=TOKEN)  # (as create_app does on a node)
    return app


def test_a_node_refuses_a_guess_for_a_sandbox_it_does_not_hold() -> None:
    with TestClient(_node_app({"sbx-here"})) as c:
        h: dict[str, Any] = {"X-Cpuos-Node-Token": TOKEN, "X-Cpuos-Route": "cached"}
        r = c.post("/sandboxes/sbx-here/exec", headers=h)
        assert r.status_code == 200 and r.json() == {"ran": "sbx-here"}
        r = c.post("/sandboxes/sbx-gone/exec", headers=h)
        assert r.status_code == 421 and r.headers["x-cpuos-route"] == "elsewhere"
        assert r.json()["error"]["code"] == "conflict"
        # unmarked: the node answers as it always did (its own checks)
        r = c.post("/sandboxes/sbx-gone/exec", headers={"X-Cpuos-Node-Token": TOKEN})
        assert r.status_code == 200
        # marked but without the token: the token is checked first
        r = c.post("/sandboxes/sbx-here/exec", headers={"X-Cpuos-Route": "cached"})
        assert r.status_code == 403
