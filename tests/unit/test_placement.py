"""Placement (cpuosd.cluster.nodes.place, place_children) over nodes as an API process sees
them: rows in a real SQLite store, read by NodeView (no runsc). Only live, uncordoned nodes
with room; among them a local copy of the snapshot (a resume), a warm pool, then a template
checkpoint (a create) are preferred, ties by memory available; a fork's children take
turns over the nodes that can restore the parent's image, the parent's node first."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cpuosd.cluster.nodes import (NodeInfo, NodeView, facts_of_lease, lease_facts, place,
                                  place_children)
from cpuosd.store import SqliteStore
from support.daemon import wait_until

STORE = "s3://snaps/cluster"
CPU = {"backend": "gvisor", "image_kind": "runsc-1", "arch": "x86_64",
       "runtime": {"runsc_version": "release-1"}, "cpu_features": ["avx", "sse4_2"]}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "cpuos.db")
    yield s
    s.close()


def _register(store: SqliteStore, nid: str, mem: float, **facts: Any) -> None:
    store.register_node(nid, f"{nid}:7780", "inc-" + nid, {
        **CPU, "capacity": {"memory_available_mib": mem}, "templates": ["d1"],
        "snapshot_store": STORE, **facts})


def _view(store: SqliteStore, clock: list[float] | None = None) -> NodeView:
    now = clock or [1000.0]
    v = NodeView(store, lease=3, clock=lambda: now[0])
    v.refresh()
    return v


def _id(n: NodeInfo | None) -> str | None:
    return None if n is None else n.node_id


def test_live_uncordoned_with_room(store: SqliteStore) -> None:
    _register(store, "a", 4000)
    _register(store, "b", 8000)
    _register(store, "c", 64000)
    _register(store, "d", 64000, pools=["python"])
    store.set_node_cordoned("d", True)  # (a pool on a cordoned node: not placed there)
    clock = [1000.0]
    view = _view(store, clock)
    assert _id(place(view.nodes)) == "c"
    # c stops beating: dead past its lease (by the observer's clock); the others beat
    clock[0] += 2
    last = max(n["heartbeat_at"] for n in store.list_nodes())
    # (a beat is seen by its heartbeat_at changing: the wall clock must have moved on)
    wait_until(lambda: time.time() > last, "the wall clock past the last heartbeat", 5)
    for nid in ("a", "b", "d"):
        assert store.node_heartbeat(nid, "inc-" + nid)
    view.refresh()
    clock[0] += 2
    view.refresh()
    assert [n.node_id for n in view.nodes if n.alive] == ["a", "b", "d"]
    assert _id(place(view.nodes, template="python")) == "b"
    assert _id(place(view.nodes, memory_mib=6000)) == "b"
    assert place(view.nodes, memory_mib=9000) is None  # (no live node has room)


def test_create_prefers_a_warm_pool_then_a_template_checkpoint(store: SqliteStore) -> None:
    _register(store, "a", 4000, pools=["python"], template_images=["python"])
    _register(store, "b", 6000, template_images=["python", "node"])
    _register(store, "c", 8000)
    _register(store, "d", 2000, template_images=["python"])
    view = _view(store)
    assert _id(place(view.nodes, template="python")) == "a"  # (a pool ready)
    assert _id(place(view.nodes, template="node")) == "b"  # (its checkpoint)
    assert _id(place(view.nodes, template="rust")) == "c"  # (neither: most memory)
    assert _id(place(view.nodes)) == "c"
    # a preferred node without room is passed over, and the next preference holds
    assert _id(place(view.nodes, memory_mib=5000, template="python")) == "b"
    # ties (the same preference) by memory available
    _register(store, "e", 5000, pools=["python"], template_images=["python"])
    view.refresh()
    assert _id(place(view.nodes, template="python")) == "e"


def test_resume_prefers_a_local_copy_of_the_snapshot(store: SqliteStore) -> None:
    _register(store, "a", 1000, snapshots=["sbx-aaaaaaaaaaaa"])
    _register(store, "b", 9000, pools=["python"])
    view = _view(store)
    assert _id(place(view.nodes, snapshot="sbx-aaaaaaaaaaaa")) == "a"
    assert _id(place(view.nodes, snapshot="sbx-bbbbbbbbbbbb")) == "b"
    store.set_node_cordoned("a", True)
    view.refresh()
    assert _id(place(view.nodes, snapshot="sbx-aaaaaaaaaaaa")) == "b"


def test_fork_children_take_turns_parent_first(store: SqliteStore) -> None:
    _register(store, "a", 3000)  # the parent's
    _register(store, "b", 8000)
    _register(store, "c", 9000)
    view = _view(store)
    parent = view.get("a")
    assert parent is not None
    assert [n.node_id for n in place_children(view.nodes, parent, 1, 512, "d1") or []] == [
        "a"]
    assert [n.node_id for n in place_children(view.nodes, parent, 5, 1024, "d1") or []] == [
        "a", "c", "b", "a", "c"]
    # room counted per child: a fills up, then only the others take turns
    assert [n.node_id for n in place_children(view.nodes, parent, 5, 2000, "d1") or []] == [
        "a", "c", "b", "c", "b"]
    assert place_children(view.nodes, parent, 16, 2000, "d1") is None  # (not all fit)


def test_fork_children_only_where_the_image_restores(store: SqliteStore) -> None:
    _register(store, "a", 3000)
    _register(store, "b", 9000, snapshot_store="s3://another/store")
    _register(store, "c", 9000, templates=["d2"])  # (another build of the template)
    _register(store, "d", 9000, cpu_features=["sse4_2"])  # (lacks avx: gVisor refuses)
    _register(store, "e", 9000, runtime={"runsc_version": "release-2"})
    _register(store, "f", 8000)
    _register(store, "g", 9000)
    store.set_node_cordoned("g", True)
    view = _view(store)
    parent = view.get("a")
    assert parent is not None
    assert [n.node_id for n in place_children(view.nodes, parent, 4, 512, "d1") or []] == [
        "a", "f", "a", "f"]
    # the parent's node cordoned: every child elsewhere
    store.set_node_cordoned("a", True)
    view.refresh()
    parent = view.get("a")
    assert parent is not None
    assert [n.node_id for n in place_children(view.nodes, parent, 2, 512, "d1") or []] == [
        "f", "f"]


def test_lease_facts_carry_what_placement_prefers() -> None:
    """Under Kubernetes a node's facts ride on its Lease: the preferences survive."""
    from cpuosd.cluster.membership import NodeFacts

    facts = {**CPU, "address": "a:1", "capacity": {"memory_available_mib": 100.0},
             "templates": ["d1"], "snapshots": ["sbx-aaaaaaaaaaaa"], "pools": ["python"],
             "template_images": ["python"], "snapshot_store": STORE}
    back = facts_of_lease(NodeFacts.from_annotation(
        lease_facts(facts, "a", "i").to_annotation()))
    for k in ("snapshots", "pools", "template_images", "snapshot_store", "templates"):
        assert back[k] == facts[k], k
