"""The API process's half of a fork across nodes (cpuosd.cluster.forks), against nodes that
answer as httpx.MockTransport says (their half runs real runsc in
tests/cluster/test_two_nodes.py::test_fork_fans_out_across_nodes): the calls in order with
the caller's key and the node token; a target that fails: the children made are killed
and the image released, the node's JSON error answered; a parent with secrets fans out to
nodes holding the same secrets key only; the nodes' internal routes are not the public's."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from cpuosd.lifecycle.states import State
from cpuosd.config import Config
from cpuosd.store import RowSpec, SandboxRow, SqliteStore
from support.api_tier import api_client

TOKEN = "t" * 32
PARENT = "sbx-parent000001"
CPU = {"backend": "gvisor", "image_kind": "runsc-1", "arch": "x86_64",
       "runtime": {"runsc_version": "release-1"}, "cpu_features": ["avx"]}
Handler = Callable[[httpx.Request], httpx.Response]


class Env:
    def __init__(self, tmp: Path, secrets_keys: tuple[str | None, str | None] = (None, None)
                 ) -> None:
        self.store = SqliteStore(tmp / "cpuos.db")
        ws = self.store.create_workspace("default")
        self.key = self.store.add_key(ws, "admin")
        for nid, sk in zip(("node-a", "node-b"), secrets_keys, strict=True):
            self.store.register_node(nid, f"{nid}:7780", "i", {
                **CPU, "capacity": {"memory_available_mib": 8000}, "templates": ["d1"],
                "snapshot_store": "s3://b/p", **({"secrets_key": sk} if sk else {})})
        self.ws = ws
        self.calls: list[httpx.Request] = []
        self.cfg = Config.from_env({"CPUOS_HOME": str(tmp), "CPUOS_ROLE": "api",
                                    "CPUOS_NODE_TOKEN": TOKEN})

    def parent(self, network: dict[str, Any] | None = None) -> None:
        now = time.time()
        self.store.insert_sandbox(SandboxRow(
            id=PARENT, workspace_id=self.ws, template="python", backend="gvisor",
            state=State.RUNNING, reason=None, created_at=now, started_at=now, ended_at=None,
            deadline=now + 300, spec=RowSpec(memory_mib=512, template_digest="d1",
                                      network=network or {"mode": "on"}),
            metadata={}, node_id="node-a"))

    def client(self, handler: Handler) -> Iterator[TestClient]:
        with api_client(self.cfg, self.store, self.key, handler, self.calls) as c:
            yield c

    def seen(self) -> list[tuple[str, str]]:
        return [(r.method, f"{r.url.host}{r.url.path}") for r in self.calls]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.store.close()


def _child(sid: str) -> dict[str, Any]:
    return {"id": sid, "state": "running"}


def nodes(restore: httpx.Response) -> Handler:
    def handler(r: httpx.Request) -> httpx.Response:
        assert r.headers["x-cpuos-node-token"] == TOKEN
        assert r.headers["authorization"].startswith("Bearer ")
        path = r.url.path
        if path.endswith("/fork/publish"):
            assert r.url.host == "node-a" and json.loads(r.content) == {"n": 1, "remote": 1}
            return httpx.Response(201, json={"image": f"fork-{PARENT}-0badf00d", "bytes": 10,
                                             "sandboxes": [_child("sbx-child-a")]})
        if path.endswith("/fork/restore"):
            assert r.url.host == "node-b"
            assert json.loads(r.content) == {"image": f"fork-{PARENT}-0badf00d", "bytes": 10,
                                             "n": 1}
            return restore
        if path.endswith("/fork/release"):
            return httpx.Response(200, json={"released": json.loads(r.content)["image"]})
        if r.method == "DELETE":
            return httpx.Response(200, json={"ok": True})
        if path.endswith("/fork"):  # (forwarded as it came: streamed back)
            return httpx.Response(200, stream=httpx.ByteStream(b'{"sandboxes": []}'))
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path}})
    return handler


def test_children_on_both_nodes(env: Env) -> None:
    env.parent()
    for c in env.client(nodes(httpx.Response(201, json={"sandboxes": [
            _child("sbx-child-b")]}))):
        r = c.post(f"/sandboxes/{PARENT}/fork", json={"n": 2})
        assert r.status_code == 201, r.text
        assert [s["id"] for s in r.json()["sandboxes"]] == ["sbx-child-a", "sbx-child-b"]
    assert env.seen() == [("POST", f"node-a/sandboxes/{PARENT}/fork/publish"),
                          ("POST", f"node-b/sandboxes/{PARENT}/fork/restore"),
                          ("POST", f"node-a/sandboxes/{PARENT}/fork/release")]


def test_a_target_that_fails_leaves_nothing(env: Env) -> None:
    env.parent()
    err = {"error": {"code": "unavailable", "message": "fetching fork image failed"}}
    for c in env.client(nodes(httpx.Response(503, json=err))):
        r = c.post(f"/sandboxes/{PARENT}/fork", json={"n": 2})
        assert r.status_code == 503 and r.json() == err
    assert env.seen() == [("POST", f"node-a/sandboxes/{PARENT}/fork/publish"),
                          ("POST", f"node-b/sandboxes/{PARENT}/fork/restore"),
                          ("DELETE", "node-a/sandboxes/sbx-child-a"),
                          ("POST", f"node-a/sandboxes/{PARENT}/fork/release")]


def test_a_target_that_does_not_answer(env: Env) -> None:
    env.parent()

    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.path.endswith("/fork/restore"):
            raise httpx.ConnectError("refused")
        return nodes(httpx.Response(500))(r)

    for c in env.client(handler):
        r = c.post(f"/sandboxes/{PARENT}/fork", json={"n": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert "node-b" in r.json()["error"]["message"]
    assert ("DELETE", "node-a/sandboxes/sbx-child-a") in env.seen()


SECRET_POLICY = {"mode": "on", "ca": "ca-" + "c" * 24, "secrets": {
    "K": {"placeholder": "cpuos-secret-" + "a" * 24, "hosts": ["x.test"]}}}


@pytest.mark.parametrize("keys", [("k1", "k1"), ("k1", "k2"), ("k1", None), (None, None)])
def test_a_parent_with_secrets_goes_where_the_secrets_key_is(tmp_path: Path,
                                                              keys: tuple[str, str]) -> None:
    """Its values and CA are sealed in the shared database: children go to a node holding
    the same secrets key (by the id in its facts), else they stay on the parent's node."""
    env = Env(tmp_path, keys)
    try:
        env.parent(SECRET_POLICY)
        for c in env.client(nodes(httpx.Response(201, json={"sandboxes": [
                _child("sbx-child-b")]}))):
            r = c.post(f"/sandboxes/{PARENT}/fork", json={"n": 2})
            assert r.status_code in (200, 201), r.text
        if keys[0] is not None and keys[0] == keys[1]:
            assert env.seen()[1] == ("POST", f"node-b/sandboxes/{PARENT}/fork/restore")
        else:
            assert env.seen() == [("POST", f"node-a/sandboxes/{PARENT}/fork")]
    finally:
        env.store.close()


def test_local_forks_are_forwarded(env: Env) -> None:
    """n=1 (the parent's node has room), or a parent with secrets and no node but its own
    holding the secrets key: the node's own fork."""
    env.parent(SECRET_POLICY)
    for c in env.client(nodes(httpx.Response(500))):
        for n in (1, 2):
            r = c.post(f"/sandboxes/{PARENT}/fork", json={"n": n})
            assert r.status_code == 200, r.text
        # the nodes' internal routes: not through an API process
        for op in ("publish", "restore", "release"):
            r = c.post(f"/sandboxes/{PARENT}/fork/{op}", json={})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert env.seen() == [("POST", f"node-a/sandboxes/{PARENT}/fork")] * 2


def test_a_target_that_answers_nonsense(env: Env) -> None:
    env.parent()
    for c in env.client(nodes(httpx.Response(201, json={"sandboxes": "all of them"}))):
        r = c.post(f"/sandboxes/{PARENT}/fork", json={"n": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    assert ("DELETE", "node-a/sandboxes/sbx-child-a") in env.seen()
    assert env.seen()[-1] == ("POST", f"node-a/sandboxes/{PARENT}/fork/release")


def test_nodes_without_a_shared_store_fork_locally(env: Env) -> None:
    """A node's own snapshot directory (no CPUOS_SNAPSHOT_STORE): the node's fork."""
    for nid in ("node-a", "node-b"):
        env.store.register_node(nid, f"{nid}:7780", "i2", {
            **CPU, "capacity": {"memory_available_mib": 8000}, "templates": ["d1"]})
    env.parent()
    for c in env.client(nodes(httpx.Response(500))):
        assert c.post(f"/sandboxes/{PARENT}/fork", json={"n": 4}).status_code == 200
    assert env.seen() == [("POST", f"node-a/sandboxes/{PARENT}/fork")]
