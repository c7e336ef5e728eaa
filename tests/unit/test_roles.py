"""The roles of many hosts as the composition root builds them (cpuosd.wiring, api/app.py,
cluster/api.py): a node's id and token are checked before anything is made, an API
process's app refuses without its database, and a node's app answers only the node token
(/health aside). Nothing is started here: the apps are made, not served (tests/cluster
runs them)."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from cpuosd.api.app import create_app
from cpuosd.cluster.api import create_api_app
from cpuosd.cluster.nodes import TOKEN_HEADER, NodeTokenGuard
from cpuosd.config import Config
from cpuosd.wiring import build_services, node_config

TOKEN = "t" * 24


def cfg(**cluster: Any) -> Config:
    c = Config()
    return c.replace(cluster=dataclasses.replace(c.cluster, **cluster))


def test_node_config_resolves_the_id_and_checks_the_token() -> None:
    got = node_config(cfg(role="node", node_token=TOKEN, node_id="Node-A"))
    assert got.cluster.node_id == "node-a"
    host = socket.gethostname().split(".")[0].lower()
    assert node_config(cfg(role="node", node_token=TOKEN)).cluster.node_id == host
    with pytest.raises(ValueError, match="CPUOS_NODE_TOKEN"):
        node_config(cfg(role="node"))
    with pytest.raises(ValueError, match="CPUOS_NODE_TOKEN"):
        node_config(cfg(role="node", node_token="short"))
    with pytest.raises(ValueError, match="DNS label"):
        node_config(cfg(role="node", node_token=TOKEN, node_id="bad_id!"))


def test_the_apps_of_each_role() -> None:
    def guards(app: Any) -> list[Any]:
        return [m.cls for m in app.user_middleware]

    assert NodeTokenGuard not in guards(create_app(cfg()))
    assert NodeTokenGuard in guards(create_app(cfg(role="node", node_token=TOKEN)))
    with pytest.raises(ValueError, match="CPUOS_NODE_TOKEN"):
        create_app(cfg(role="node"))
    with pytest.raises(ValueError, match="--role=api"):
        create_app(cfg(role="api"))
    with pytest.raises(ValueError, match="CPUOS_DATABASE_URL"):
        create_api_app(cfg(role="api", node_token=TOKEN))
    with pytest.raises(ValueError, match="CPUOS_NODE_TOKEN"):
        create_api_app(cfg(role="api", database_url="postgresql://db/cpuos"))


def test_build_services_refuses_the_api_role_before_touching_anything(tmp_path: Any) -> None:
    import asyncio

    c = cfg(role="api").replace(home=tmp_path / "home")
    with pytest.raises(ValueError, match="build_api_services"):
        asyncio.run(build_services(c))
    assert not (tmp_path / "home").exists()


def test_a_node_answers_the_node_token_only() -> None:
    async def ok(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/health", ok), Route("/sandboxes", ok)])
    with TestClient(NodeTokenGuard(inner, TOKEN)) as c:
        assert c.get("/health").text == "ok"
        r = c.get("/sandboxes")
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        assert c.get("/sandboxes", headers={TOKEN_HEADER: "x" * 24}).status_code == 403
        assert c.get("/sandboxes", headers={TOKEN_HEADER: TOKEN}).text == "ok"


HEAP_PROBE = """
import sys
from cpuosd.cluster.api import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
block = bytes(3 << 20)  # (a bytes object's id is its address)
heap = [ln for ln in open("/proc/self/maps") if ln.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split()[0].split("-"))
print(lo <= id(block) < hi)
"""


@pytest.mark.parametrize("mode", ["tuned", "default"])
def test_the_api_process_takes_stream_sized_blocks_from_its_heap(mode: str) -> None:
    """With tune_malloc (the API process's start), a 3 MiB block comes from the heap (no
    fresh mapping to fault in and unmap per chunk of a stream); glibc's default maps it."""
    r = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ("True" if mode == "tuned" else "False")
