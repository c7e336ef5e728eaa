"""Nodes in the store (cpuosd.cluster.nodes), on SQLite and a real Postgres: registration,
heartbeat by incarnation, cordon; liveness judged by the observer's own clock; placement;
sandboxes scoped to their node (what a node reconciles and reaps)."""

from __future__ import annotations

import time

from cpuosd.lifecycle.states import State
from cpuosd.cluster.nodes import NodeInfo, NodeView, place
from cpuosd.store import RowSpec, SandboxRow, Store


def test_register_heartbeat_cordon(store: Store) -> None:
    store.register_node("node-a", "10.0.0.1:7780", "inc1", {"capacity": {"vcpus": 2}})
    store.register_node("node-b", "10.0.0.2:7780", "inc2", {})
    assert [n["id"] for n in store.list_nodes()] == ["node-a", "node-b"]
    a = store.list_nodes()[0]
    assert a["facts"] == {"capacity": {"vcpus": 2}} and a["cordoned"] is False
    assert store.node_heartbeat("node-a", "inc1", {"capacity": {"vcpus": 4}})
    assert store.list_nodes()[0]["facts"]["capacity"]["vcpus"] == 4
    # a restarted node (new incarnation) takes the row over; the old one's beats fail
    assert store.set_node_cordoned("node-a", True)
    store.register_node("node-a", "10.0.0.1:7780", "inc3", {})
    assert not store.node_heartbeat("node-a", "inc1")
    assert store.node_heartbeat("node-a", "inc3")
    assert store.list_nodes()[0]["cordoned"] is True  # (kept across the restart)
    store.remove_node("node-b")
    assert [n["id"] for n in store.list_nodes()] == ["node-a"]
    assert not store.set_node_cordoned("node-b", True)


def test_liveness_by_the_observers_clock(store: Store) -> None:
    now = [1000.0]
    view = NodeView(store, lease=3, clock=lambda: now[0])
    store.register_node("node-a", "a:1", "i", {})
    assert [n.alive for n in view.refresh()] == [True]
    now[0] += 2
    assert store.node_heartbeat("node-a", "i")
    assert view.refresh()[0].alive
    now[0] += 3.5  # no new beat seen for longer than the lease: dead
    assert not view.refresh()[0].alive
    time.sleep(0.01)  # (a beat writes a new heartbeat_at: seen as a change)
    assert store.node_heartbeat("node-a", "i")
    assert view.refresh()[0].alive


def test_sandboxes_scoped_to_their_node(store: Store) -> None:
    ws = store.create_workspace("w")
    for sid, node in (("sbx-a", "node-a"), ("sbx-b", "node-b"), ("sbx-1", None)):
        store.insert_sandbox(SandboxRow(
            id=sid, workspace_id=ws, template="python", backend="gvisor", state=State.RUNNING,
            reason=None, created_at=time.time(), started_at=None, ended_at=None,
            deadline=time.time() - 1, spec=RowSpec(), metadata={}, node_id=node))
    assert [r.id for r in store.list_sandboxes(node_id="node-a")] == ["sbx-a"]
    assert len(store.list_sandboxes()) == 3
    assert [s for s, _ in store.expired(time.time(), node_id="node-b")] == ["sbx-b"]
    assert len(store.expired(time.time())) == 3


def _node(nid: str, mem: float, alive: bool = True, cordoned: bool = False,
          templates: tuple[str, ...] = ()) -> NodeInfo:
    return NodeInfo(nid, nid + ":1", "i", {"capacity": {"memory_available_mib": mem},
                                           "templates": list(templates)}, alive, cordoned)


def test_placement() -> None:
    nodes = [_node("a", 4000), _node("b", 8000), _node("c", 16000, alive=False),
             _node("d", 32000, cordoned=True)]
    assert place(nodes).node_id == "b"  # type: ignore[union-attr]
    assert place(nodes, memory_mib=6000).node_id == "b"  # type: ignore[union-attr]
    assert place(nodes, memory_mib=9000) is None
    nodes[0] = _node("a", 4000, templates=("abc",))
    assert place(nodes, template_digest="abc").node_id == "a"  # type: ignore[union-attr]
    assert place([]) is None


def test_fence_dead(store: Store) -> None:
    from cpuosd.cluster.nodes import fence_dead

    now = [1000.0]
    view = NodeView(store, lease=3, clock=lambda: now[0])
    ws = store.create_workspace("w")
    store.register_node("node-a", "a:1", "i", {})
    # secrets: the running one's own placeholder, and a CA it shares with the paused one (a
    # fork's parent and child share them)
    ca, own, kept = "ca-" + "c" * 24, "cpuos-secret-" + "1" * 24, "cpuos-secret-" + "2" * 24
    for sid, state, ph in (("sbx-run", "running", own), ("sbx-paused", "paused", kept)):
        net = {"mode": "on", "ca": ca, "secrets": {"K": {"placeholder": ph, "hosts": ["x"]}}}
        store.insert_sandbox(SandboxRow(
            id=sid, workspace_id=ws, template="python", backend="gvisor", state=State(state),
            reason=None, created_at=time.time(), started_at=None, ended_at=None,
            deadline=None, spec=RowSpec(network=net), metadata={}, node_id="node-a"))
    for name in (ca, own, kept):
        store.put_secret(name, "k", "sealed")
    view.refresh()
    assert fence_dead(store, view, after=10) == {}
    now[0] += 3 + 9  # dead for 9 s: not yet
    view.refresh()
    assert fence_dead(store, view, after=10) == {}
    now[0] += 2
    view.refresh()
    assert fence_dead(store, view, after=10) == {"node-a": ["sbx-run"]}
    run = store.get_sandbox("sbx-run")
    assert run is not None and (run.state, run.reason, run.epoch) == ("error", "node_lost", 1)
    paused = store.get_sandbox("sbx-paused")
    assert paused is not None and paused.state == "paused"
    # Postgres (many hosts: sealed secrets): the fenced one's secrets go, the shared CA stays
    assert store.secret_names() == sorted([ca, kept] + ([own] if store.dialect == "sqlite"
                                                         else []))
    assert fence_dead(store, view, after=10) == {}  # (done once)
    assert fence_dead(store, view, after=0) == {}  # (0: never)
