"""Admission serialized per workspace across nodes sharing one store
(``Admission.admitting`` over ``Store.serialized``), the first start's bootstrap serialized
the same way, on a real Postgres (and the store's serialized block on SQLite too): two
nodes creating at once for one workspace never pass its maxima; nodes starting together on
an empty database make one ``default`` workspace."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cpuosd.accounting.quotas import Admission
from cpuosd.agentconn import AgentChannel
from cpuosd.config import ClusterConfig, Config
from cpuosd.errors import ApiError
from cpuosd.lifecycle.common import Live
from cpuosd.lifecycle.manager import Manager
from cpuosd.lifecycle.states import ACTIVE, State
from cpuosd.store import RowSpec, SandboxRow, Store
from cpuosd.snapstore.directory import DirectorySnapshotStore
from cpuosd.store.postgres import PostgresStore
from cpuosd.wiring import bootstrap
from support.daemon import wait_until
from support.fakes import FakeBackend, FakeHost

KEY = "cpk_" + "cd" * 32


def _row(ws: str, sid: str, vcpus: int = 1) -> SandboxRow:
    return SandboxRow(id=sid, workspace_id=ws, template="python", backend="gvisor",
                      state=State.CREATING, reason=None, created_at=time.time(),
                      started_at=None, ended_at=None, deadline=None,
                      spec=RowSpec(vcpus=vcpus, memory_mib=256, rootfs="/x"), metadata={})


def _threads(*targets: Callable[[], None]) -> None:
    """Run each target in a thread of its own; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(t: Callable[[], None]) -> None:
        try:
            t()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
        assert not t.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


# ---- the store's serialized block (both dialects) ---------------------------------------

def test_a_serialized_block_is_one_transaction(store: Store) -> None:
    ws = store.create_workspace("w")
    with store.serialized("admission:" + ws):
        store.insert_sandbox(_row(ws, "sbx-kept"))
        store.update_sandbox("sbx-kept", reason="in the block")
        assert store.delete_workspace("ws-none") == []  # (a write transaction inside)
        with pytest.raises(RuntimeError, match="inside another"):
            with store.serialized("other"):
                pass
    kept = store.get_sandbox("sbx-kept")
    assert kept is not None and kept.reason == "in the block"
    with pytest.raises(ApiError):  # a failure in the block: nothing of it is written
        with store.serialized("admission:" + ws):
            store.insert_sandbox(_row(ws, "sbx-gone"))
            raise ApiError("limit_exceeded", "refused")
    assert store.get_sandbox("sbx-gone") is None
    # and the store works as before after it
    store.insert_sandbox(_row(ws, "sbx-after"))
    assert store.sandbox_totals(ws, ACTIVE)[0] == 2


# ---- Postgres: two nodes ----------------------------------------------------------------

@pytest.fixture
def two_stores(pg_url: str) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    a, b = PostgresStore(pg_url, max_size=4), PostgresStore(pg_url, max_size=4)
    yield a, b
    a.close()
    b.close()


def _waiting_advisory_locks(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT "
                        "granted AND database = (SELECT oid FROM pg_database WHERE datname = "
                        "current_database())").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.cluster
def test_a_second_nodes_admission_waits_and_counts_the_first(
        two_stores: tuple[PostgresStore, PostgresStore], pg_url: str) -> None:
    """Node A has counted (one place left) and not yet written its row: node B's admission
    for the same workspace waits for A's commit, then counts A's row and is refused. Another
    workspace's admission does not wait. (Without the lock B counts the same free place and
    both rows are written.)"""
    a, b = two_stores
    ws = a.create_workspace("w", {"max_sandboxes": 1})
    other = a.create_workspace("o", {"max_sandboxes": 1})
    adm_a, adm_b = Admission(a, FakeHost()), Admission(b, FakeHost())
    counted, go = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def node_a() -> None:
        with adm_a.admitting(ws, 1, 256, reserve_host=False):
            counted.set()
            assert go.wait(60)
            a.insert_sandbox(_row(ws, "sbx-a"))

    def node_b() -> None:
        try:
            with adm_b.admitting(ws, 1, 256, reserve_host=False):
                b.insert_sandbox(_row(ws, "sbx-b"))
        except ApiError as e:
            got["b"] = e

    ta = threading.Thread(target=node_a)
    ta.start()
    try:
        assert counted.wait(60)
        tb = threading.Thread(target=node_b)
        tb.start()
        wait_until(lambda: _waiting_advisory_locks(pg_url) == 1,
                   "node B's admission to wait for node A's lock", timeout=30)
        assert not got and b.get_sandbox("sbx-b") is None
        # another workspace is not held up by A
        with adm_b.admitting(other, 1, 256, reserve_host=False):
            b.insert_sandbox(_row(other, "sbx-other"))
    finally:
        go.set()
        ta.join(60)
    tb.join(60)
    assert isinstance(got.get("b"), ApiError) and got["b"].code == "limit_exceeded"
    assert got["b"].details["limit"] == "max_sandboxes"
    assert [r.id for r in a.list_sandboxes(ws)] == ["sbx-a"]


@pytest.mark.cluster
def test_the_lock_wait_is_bounded(two_stores: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = two_stores
    ws = a.create_workspace("w")
    b.serial_lock_timeout_ms = 200
    with a.serialized("admission:" + ws):
        with pytest.raises(ApiError) as e:
            with b.serialized("admission:" + ws):
                pass
    assert e.value.code == "unavailable" and e.value.status == 503
    assert f"admission:{ws}" in e.value.message and "try again" in e.value.message
    with b.serialized("admission:" + ws):  # (free again: taken at once)
        pass


@pytest.mark.cluster
def test_other_threads_do_not_join_a_serialized_block(
        two_stores: tuple[PostgresStore, PostgresStore]) -> None:
    """The block's transaction is its thread's: a call of the same store from another
    thread meanwhile uses a connection of its own (and sees nothing uncommitted)."""
    a, _ = two_stores
    ws = a.create_workspace("w")
    seen: list[Any] = []
    with a.serialized("admission:" + ws):
        a.insert_sandbox(_row(ws, "sbx-1"))
        _threads(lambda: seen.append(a.get_sandbox("sbx-1")))
        assert a.get_sandbox("sbx-1") is not None
    assert seen == [None] and a.get_sandbox("sbx-1") is not None


class FastManager(Manager):
    """The real Manager (admission, rows, states); a boot is a Live with nothing behind it."""

    async def _boot_or_fallback(self, row: SandboxRow, image: Path | None,
                                info: dict[str, Any]) -> Live:
        await asyncio.sleep(0)
        spec = self._spec(row)
        lv = Live(row, spec, AgentChannel(spec.sock_path))
        self.live[row.id] = lv
        return lv


def _templates(tmp_path: Path) -> Path:
    tdir = tmp_path / "templates"
    (tdir / "rootfs").mkdir(parents=True, exist_ok=True)
    (tdir / "python.json").write_text(json.dumps(
        {"name": "python", "digest": "0" * 16, "rootfs": str(tdir / "rootfs")}))
    return tdir


@pytest.mark.cluster
def test_two_nodes_creating_at_once_never_pass_a_workspaces_maxima(
        pg_url: str, tmp_path: Path) -> None:
    """Two Managers (two nodes: each its own process's store and event loop, in threads
    here) create for the same workspaces at the same moments, more than the maxima allow:
    each workspace ends with exactly its maximum of sandboxes (or vCPUs), the rest refused
    429."""
    setup = PostgresStore(pg_url, max_size=1)
    rounds = 8
    by_count = [setup.create_workspace(f"n{i}", {"max_sandboxes": 3}) for i in range(rounds)]
    by_vcpus = [setup.create_workspace(f"v{i}", {"max_total_vcpus": 4}) for i in range(rounds)]
    setup.close()
    tdir = _templates(tmp_path)
    barrier = threading.Barrier(2)
    refused: dict[str, list[str]] = {"a": [], "b": []}

    def node(name: str) -> None:
        async def main() -> None:
            store = PostgresStore(pg_url, max_size=4)
            cfg = Config(home=tmp_path / name, templates_path=tdir)
            mgr = FastManager(cfg, store, FakeBackend(), measure=FakeHost())
            try:
                for ws, vcpus in [(w, 1) for w in by_count] + [(w, 2) for w in by_vcpus]:
                    barrier.wait(60)  # (both nodes start on the workspace together)
                    got = await asyncio.gather(*(mgr.create(ws, "python", 60, {}, {}, vcpus,
                                                            256) for _ in range(3)),
                                               return_exceptions=True)
                    for g in got:
                        if isinstance(g, BaseException):
                            assert isinstance(g, ApiError) and g.code == "limit_exceeded", g
                            refused[name].append(str(g.details.get("limit")))
            finally:
                for t in list(mgr._tasks):
                    t.cancel()
                store.close()

        asyncio.run(main())

    _threads(lambda: node("a"), lambda: node("b"))
    check = PostgresStore(pg_url, max_size=1)
    try:
        for ws in by_count:
            assert check.sandbox_totals(ws, ACTIVE)[0] == 3, ws
        for ws in by_vcpus:
            n, vcpus, _ = check.sandbox_totals(ws, ACTIVE)
            assert (n, vcpus) == (2, 4), ws
    finally:
        check.close()
    assert sorted(refused["a"] + refused["b"]) == sorted(
        ["max_sandboxes"] * 3 * rounds + ["max_total_vcpus"] * 4 * rounds)


@pytest.mark.cluster
def test_a_claim_from_the_snapshot_store_is_admitted_before_it_is_made(
        pg_url: str, tmp_path: Path) -> None:
    """A sandbox paused into the snapshot store, resumed on node B: admitted (the
    workspace's running vCPUs) in one step with the claim, before the row changes: refused,
    the row is as it was; with room for exactly it, admitted (it is not counted twice, as
    when the claim came first)."""
    store = PostgresStore(pg_url, max_size=4)
    ws = store.create_workspace("w", {"max_total_vcpus": 2})
    running = _row(ws, "sbx-running", vcpus=2)
    running.state, running.node_id = State.RUNNING, "node-a"
    store.insert_sandbox(running)
    paused = _row(ws, "sbx-paused", vcpus=1)
    paused.state, paused.epoch = State.PAUSED, 3
    store.insert_sandbox(paused)
    cfg = Config(home=tmp_path / "node-b", templates_path=_templates(tmp_path),
                 cluster=ClusterConfig(role="node", node_id="node-b"))
    mgr = FastManager(cfg, store, FakeBackend(), measure=FakeHost(),
                      snapstore=DirectorySnapshotStore(tmp_path / "snapshots", shared=True))
    try:
        with pytest.raises(ApiError) as e:
            asyncio.run(mgr.snapshots.resume(ws, "sbx-paused"))
        assert e.value.code == "limit_exceeded" and e.value.details["limit"] == "max_total_vcpus"
        row = store.get_sandbox("sbx-paused")
        assert row is not None and (row.state, row.node_id, row.epoch) == ("paused", None, 3)
        store.set_workspace_limits(ws, {"max_total_vcpus": 3})
        with pytest.raises(Exception) as e2:  # (admitted and claimed; its image is not there)
            asyncio.run(mgr.snapshots.resume(ws, "sbx-paused"))
        assert not (isinstance(e2.value, ApiError) and e2.value.code == "limit_exceeded"), e2
        row = store.get_sandbox("sbx-paused")
        assert row is not None and (row.state, row.node_id) == ("paused", None)
        assert row.epoch == 5  # (claimed by node B, then given back)
    finally:
        store.close()


# ---- the bootstrap ------------------------------------------------------------------------

def _bootstrap_at_once(pg_url: str, homes: list[Path], env: dict[str, str]) -> None:
    barrier = threading.Barrier(len(homes))

    def start(home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        cfg = Config.from_env({"CPUOS_HOME": str(home), **env})
        store = PostgresStore(pg_url, max_size=2)
        try:
            barrier.wait(60)
            bootstrap(cfg, store)
        finally:
            store.close()

    _threads(*[lambda h=h: start(h) for h in homes])


def _defaults(pg_url: str) -> list[str]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        return [r[0] for r in c.execute("SELECT id FROM workspaces WHERE name = 'default'")]


@pytest.mark.cluster
def test_nodes_bootstrapping_together_make_one_admin_workspace(pg_url: str,
                                                               tmp_path: Path) -> None:
    """Six nodes start at once on an empty database without CPUOS_ADMIN_KEY: one ``default``
    workspace; each node's admin.key is a live key of it (an admin key); started again,
    none adds a key."""
    PostgresStore(pg_url, max_size=1).close()  # (the schema, as the first start makes it)
    homes = [tmp_path / f"node-{i}" for i in range(6)]
    _bootstrap_at_once(pg_url, homes, {})
    defaults = _defaults(pg_url)
    assert len(defaults) == 1
    store = PostgresStore(pg_url, max_size=1)
    try:
        for home in homes:
            key = (home / "admin.key").read_text().strip()
            assert store.key_lookup(key) is not None
            assert store.key_lookup(key)[1] == defaults[0]  # type: ignore[index]
        assert len(store.list_keys(defaults[0])) == 6
        _bootstrap_at_once(pg_url, homes, {})  # restarted together: nothing new
        assert _defaults(pg_url) == defaults and len(store.list_keys(defaults[0])) == 6
    finally:
        store.close()


@pytest.mark.cluster
def test_nodes_bootstrapping_together_with_the_given_key(pg_url: str, tmp_path: Path) -> None:
    PostgresStore(pg_url, max_size=1).close()
    homes = [tmp_path / f"node-{i}" for i in range(6)]
    _bootstrap_at_once(pg_url, homes, {"CPUOS_ADMIN_KEY": KEY})
    defaults = _defaults(pg_url)
    assert len(defaults) == 1
    store = PostgresStore(pg_url, max_size=1)
    try:
        assert store.key_lookup(KEY) is not None
        assert store.key_lookup(KEY)[1] == defaults[0]  # type: ignore[index]
        assert [k["label"] for k in store.list_keys(defaults[0])] == ["admin"]
        assert not any((h / "admin.key").exists() for h in homes)
    finally:
        store.close()
