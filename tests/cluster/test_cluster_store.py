"""The state store's contract, run twice: on SQLite and on a real Postgres (started by the
test run, support.testbed). Compare-and-set races between real processes."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cpuosd.lifecycle.states import State
from cpuosd.accounting.usage import Meter
from cpuosd.config import PricingConfig
from cpuosd.events import SandboxEvent
from cpuosd.store import RowSpec, SandboxRow, SqliteStore, Store
from cpuosd.store import sql as store_sql
from cpuosd.store.migrations import MIGRATIONS, render
from support.testbed import open_test_store

TESTS = Path(__file__).resolve().parents[1]  # tests/, where `support` is



def _row(ws: str, sid: str, state: str = "running", vcpus: int = 2, memory_mib: int = 1024,
         **kw: object) -> SandboxRow:
    return SandboxRow(id=sid, workspace_id=ws, template="python", backend="gvisor",
                      state=State(state), reason=None, created_at=time.time(), started_at=None,
                      ended_at=None, deadline=None,
                      spec=RowSpec(vcpus=vcpus, memory_mib=memory_mib, rootfs="/x"),
                      metadata={"k": "v"}, **kw)  # type: ignore[arg-type]


def test_workspaces_and_keys(store: Store) -> None:
    ws = store.create_workspace("team", {"max_sandboxes": 3})
    rec = store.workspace(ws)
    assert rec is not None and rec["name"] == "team" and rec["limits"] == {"max_sandboxes": 3}
    assert rec["settings"] == {} and rec["deleted_at"] is None
    assert store.workspace_by_name("team") == ws
    store.set_workspace_settings(ws, {"spending_cap": 5.0, "x": "50%?"})
    store.set_workspace_limits(ws, {"max_vcpus": 4})
    rec = store.workspace(ws)
    assert rec is not None and rec["settings"]["x"] == "50%?" and rec["limits"] == {"max_vcpus": 4}
    other = store.create_workspace("other")
    assert store.workspaces_with_setting("spending_cap") == [ws]
    assert [w["id"] for w in store.list_workspaces()] == [ws, other]

    k1 = store.add_key(ws, "first")
    kid2, rec2 = store.new_key(ws, "second", "e2b_" + "ab" * 20)
    assert rec2["key"] == "e2b_" + "ab" * 20 and rec2["revoked_at"] is None
    assert store.workspace_for_key(k1) == ws and store.key_lookup(rec2["key"]) == (kid2, ws)
    assert store.workspace_for_key("cpk_nope") is None
    keys = store.list_keys(ws)
    assert [k["label"] for k in keys] == ["first", "second"]
    assert all("key" not in k and "key_hash" not in k for k in keys)
    kid1 = keys[0]["id"]
    assert store.key_live(kid1) and store.key_live(kid2) and not store.key_live("key-nope")
    assert store.revoke_key(ws, kid1, keep_one=True) == "revoked"
    assert not store.key_live(kid1) and store.key_live(kid2)
    assert store.revoke_key(ws, kid1, keep_one=True) == "already"
    assert store.revoke_key(ws, kid2, keep_one=True) == "last"
    assert store.revoke_key(other, kid2, keep_one=False) == "missing"
    assert store.workspace_for_key(k1) is None and store.workspace_for_key(rec2["key"]) == ws
    rec1 = store.key_record(kid1)
    assert rec1 is not None and rec1["revoked_at"] is not None

    assert store.delete_workspace(ws) == [kid2]
    assert not store.key_live(kid2)  # (its workspace is gone: a console session ends)
    assert store.workspace(ws) is None
    deleted = store.workspace(ws, deleted=True)
    assert deleted is not None and deleted["deleted_at"] is not None
    assert store.workspace_for_key(rec2["key"]) is None
    assert [w["id"] for w in store.list_workspaces()] == [other]
    assert len(store.list_workspaces(deleted=True)) == 2
    assert store.workspace_by_name("team") is None


def test_sandboxes(store: Store) -> None:
    ws = store.create_workspace("w")
    store.insert_sandbox(_row(ws, "sbx-a", vcpus=2, memory_mib=1024))
    store.insert_sandbox(_row(ws, "sbx-b", "paused", vcpus=4, memory_mib=512))
    store.insert_sandbox(_row(ws, "sbx-c", "killed", vcpus=8))
    a = store.get_sandbox("sbx-a")
    assert a is not None and a.spec.vcpus == 2 and a.metadata == {"k": "v"}
    assert a.node_id is None and a.epoch == 0 and a.on_timeout == "kill"
    assert store.get_sandbox("nope") is None
    # a key this version does not know (a newer daemon's) is kept through a read and write
    store.update_sandbox("sbx-a", deadline=time.time() - 1,
                         spec=RowSpec.from_json({**a.spec.to_json(), "x": 1}),
                         snapshot_bytes=5 << 30)
    a = store.get_sandbox("sbx-a")
    assert a is not None and a.spec.extra == {"x": 1} and a.snapshot_bytes == 5 << 30
    assert store.expired(time.time()) == [("sbx-a", "kill")]
    assert [r.id for r in store.list_sandboxes(ws)] == ["sbx-a", "sbx-b", "sbx-c"]
    assert [r.id for r in store.list_sandboxes(None, (State.PAUSED, State.RUNNING))] == ["sbx-a",
                                                                                  "sbx-b"]
    assert store.sandbox_totals(ws, (State.RUNNING, State.PAUSED)) == (2, 6, 1536)
    assert store.sandbox_totals(None, (State.CREATING,)) == (0, 0, 0)


def test_transition_is_a_compare_and_set(store: Store) -> None:
    ws = store.create_workspace("w")
    store.insert_sandbox(_row(ws, "sbx-t", "paused"))
    # the wrong state: nothing written
    assert not store.transition("sbx-t", (State.RUNNING,), State.PAUSING, reason="x")
    r = store.get_sandbox("sbx-t")
    assert r is not None and r.state == "paused" and r.reason is None
    # the wrong epoch: nothing written
    assert not store.transition("sbx-t", (State.PAUSED,), State.RESUMING, expect_epoch=3)
    # a new owner: epoch 0 -> 1, node set
    assert store.transition("sbx-t", (State.PAUSED,), State.RESUMING, expect_epoch=0,
                            new_epoch=True, node_id="node-a", reason=None)
    r = store.get_sandbox("sbx-t")
    assert r is not None and (r.state, r.node_id, r.epoch) == ("resuming", "node-a", 1)
    # the loser of that race comes second: refused
    assert not store.transition("sbx-t", (State.PAUSED,), State.RESUMING, expect_epoch=0,
                                new_epoch=True, node_id="node-b")
    assert store.transition("sbx-t", (State.RESUMING,), State.RUNNING, expect_epoch=1,
                            started_at=123.5, metadata={"m": "n"})
    r = store.get_sandbox("sbx-t")
    assert r is not None and (r.state, r.epoch, r.started_at, r.metadata) == (
        "running", 1, 123.5, {"m": "n"})
    # any of several states
    assert store.transition("sbx-t", (State.CREATING, State.RUNNING), State.KILLING)
    with pytest.raises(ValueError):
        store.transition("sbx-t", (), State.KILLED)


def test_a_fenced_node_changes_nothing(store: Store) -> None:
    ws = store.create_workspace("w")
    for sid, state in (("sbx-1", State.RUNNING), ("sbx-2", State.PAUSED),
                       ("sbx-3", State.RUNNING)):
        store.insert_sandbox(_row(ws, sid, state))
        store.transition(sid, (state,), state, new_epoch=True,
                         node_id="node-b" if sid == "sbx-3" else "node-a")
    assert store.fence_node("node-a", (State.RUNNING, State.PAUSING, State.RESUMING), State.ERROR,
                            "lost: node node-a died") == ["sbx-1"]
    r1 = store.get_sandbox("sbx-1")
    assert r1 is not None and (r1.state, r1.epoch, r1.reason) == ("error", 2,
                                                                  "lost: node node-a died")
    assert r1.ended_at is not None
    # node A comes back and writes with the epoch it held: refused
    assert not store.transition("sbx-1", (State.RUNNING,), State.PAUSING, expect_epoch=1)
    assert not store.transition("sbx-1", (State.ERROR,), State.KILLING, expect_epoch=1)
    r2, r3 = store.get_sandbox("sbx-2"), store.get_sandbox("sbx-3")
    assert r2 is not None and r2.state == "paused" and r2.epoch == 1
    assert r3 is not None and r3.state == "running"


def test_execs_and_connections(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = store.create_workspace("w")
    store.insert_sandbox(_row(ws, "sbx-e"))
    store.insert_exec("ex-1", "sbx-e", ["python", "-c", "print(1)"])
    store.finish_exec("ex-1", exit_code=0, timed_out=True, stdout_bytes=2)
    store.insert_exec("ex-2", "sbx-e", ["true"])
    ex = store.list_execs("sbx-e")
    assert [e["id"] for e in ex] == ["ex-2", "ex-1"]
    assert ex[1]["argv"] == ["python", "-c", "print(1)"] and ex[1]["timed_out"] is True
    assert ex[1]["exit_code"] == 0 and ex[0]["timed_out"] is None and ex[1]["ended_at"]

    store.add_connection("sbx-e", {"time": 1.0, "proto": "tcp", "dst": "198.51.100.1",
                                   "port": 443, "verdict": "allowed", "bytes_out": 9 << 32,
                                   "sni": "pypi.org"})
    monkeypatch.setattr(store_sql, "MAX_CONNECTIONS", 50)
    store.add_connections([("sbx-e", {"time": float(i), "proto": "udp", "verdict": "denied",
                                      "rule": "private"}) for i in range(600)])
    newest = store.list_connections("sbx-e", limit=3)
    assert [c["time"] for c in newest] == [599.0, 598.0, 597.0]
    kept = store.list_connections("sbx-e", limit=1000)
    assert len(kept) == 50  # pruned to the newest MAX_CONNECTIONS when a 500 was crossed
    first = store.list_connections("sbx-e", limit=2, after=kept[-1]["n"] - 1)
    assert [c["n"] for c in first] == [kept[-1]["n"], kept[-2]["n"]]
    assert "sandbox_id" not in first[0] and "dst" not in first[0]


def test_usage_intervals_and_meter(store: Store) -> None:
    ws = store.create_workspace("w")
    store.insert_sandbox(_row(ws, "sbx-u", vcpus=2, memory_mib=2048))
    meter = Meter(store, PricingConfig(vcpu_hour=3600.0, gib_hour=0.0, snapshot_gib_hour=3600.0))
    t = time.time() - 100
    meter.on_event(SandboxEvent("running", "sbx-u", ws, "creating", t))
    meter.on_event(SandboxEvent("paused", "sbx-u", ws, "pausing", t + 10,
                                fields={"snapshot_bytes": 1 << 30, "reason": "idle"}))
    meter.on_event(SandboxEvent("resuming", "sbx-u", ws, "paused", t + 30))
    s = meter.summary(ws, t - 5, t + 60)
    tot = s["total"]
    assert tot["running_seconds"] == pytest.approx(10) and tot["vcpu_seconds"] == pytest.approx(20)
    assert tot["idle_paused_seconds"] == pytest.approx(20)
    assert tot["cost"] == pytest.approx(20 + 20)  # 20 vCPU-s + 20 snapshot-GiB-s at 1/s
    assert meter.month_cost(ws, t + 60) == pytest.approx(40)
    # an interval closed "before" it started ends where it started
    store.usage_open(ws, "sbx-u", "running", t + 50, vcpus=1, memory_mib=1)
    store.usage_close("sbx-u", t + 40)
    iv = store.usage_intervals(ws, t + 45, t + 55, "sbx-u")
    assert [(u.start, u.end) for u in iv] == [(t + 50, t + 50)]
    store.usage_open(ws, "sbx-u", "running", t + 60, vcpus=1, memory_mib=1)
    dangling = store.usage_dangling()
    assert [(d[1], d[2]) for d in dangling] == [("running", "running")]
    store.usage_close_interval(dangling[0][0], t + 70)
    assert store.usage_dangling() == []
    recent = store.usage_recent(ws, t + 65, t + 80)
    assert [(u.kind, u.start, u.end) for u in recent] == [("running", t + 60, t + 70)]


def test_migrations_are_applied_once(store_url: str) -> None:
    a = open_test_store(store_url)
    a.close()
    b = open_test_store(store_url)  # (reopening migrates nothing twice)
    ws = b.create_workspace("w")
    b.insert_sandbox(_row(ws, "sbx-m"))
    r = b.get_sandbox("sbx-m")
    assert r is not None and r.epoch == 0
    b.close()


def test_an_old_sqlite_database_gains_node_and_epoch(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    c = sqlite3.connect(db, isolation_level=None)
    for i, m in enumerate(MIGRATIONS[:8], start=1):  # (the schema of an older cpuosd)
        c.executescript(f"BEGIN; {render(m, 'sqlite')}; PRAGMA user_version={i}; COMMIT;")
    c.execute("INSERT INTO workspaces (id, name, created_at) VALUES ('ws-1', 'w', 1)")
    c.execute("INSERT INTO sandboxes (id, workspace_id, template, backend, state, created_at, "
              "spec) VALUES ('sbx-o', 'ws-1', 'python', 'gvisor', 'paused', 1, '{}')")
    c.close()
    s = SqliteStore(db)
    r = s.get_sandbox("sbx-o")
    assert r is not None and (r.node_id, r.epoch, r.state) == (None, 0, "paused")
    assert s.transition("sbx-o", (State.PAUSED,), State.RESUMING, expect_epoch=0, new_epoch=True,
                        node_id="n1")
    s.close()
    v = sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0]
    assert v == len(MIGRATIONS)


# ---- races between processes ------------------------------------------------------------

RACER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from support.testbed import open_test_store
    where, me, go, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    store = open_test_store(where)
    time.sleep(max(0.0, go - time.time()))  # both start at once
    won = []
    for i in range(n):
        sid = f"sbx-r{i}"
        row = store.get_sandbox(sid)
        # resume: paused -> resuming on this node, a new epoch (the one restore)...
        if store.transition(sid, ("paused",), "resuming", expect_epoch=row.epoch,
                            new_epoch=True, node_id=me):
            won.append(sid)
            # ... then running, as long as no one took it meanwhile
            assert store.transition(sid, ("resuming",), "running", expect_epoch=row.epoch + 1)
    store.close()
    print(json.dumps(won))
""")


def test_two_processes_resume_one_sandbox_exactly_one_wins(store: Store, store_url: str,
                                                             tmp_path: Path) -> None:
    ws = store.create_workspace("w")
    n = 40
    for i in range(n):
        store.insert_sandbox(_row(ws, f"sbx-r{i}", "paused"))
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    go = time.time() + 3.0  # (after both have started and opened the store)
    procs = [subprocess.Popen([sys.executable, str(script), store_url, f"node-{k}", str(go),
                               str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(TESTS)})  # for `support`
             for k in ("a", "b")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(set(json.loads(out)))
    a, b = outs
    assert a.isdisjoint(b) and a | b == {f"sbx-r{i}" for i in range(n)}
    for i in range(n):
        r = store.get_sandbox(f"sbx-r{i}")
        assert r is not None and r.state == "running" and r.epoch == 1
        assert r.node_id == ("node-a" if r.id in a else "node-b")


def test_sealed_secrets(store: Store) -> None:
    """The secrets table (cpuosd.network.secrets.SealedBackend): rows are what the sealer
    gave (never plaintext), replaced, listed by the key that did not seal them, deleted."""
    from cpuosd.network.secrets import SealedBackend, Sealer, key_id

    k1, k2 = b"\x01" * 32, b"\x02" * 32
    b = SealedBackend(store, Sealer([k1]))
    b.write("cpuos-secret-" + "a" * 24, {"value": "sk-plain-text-value"})
    b.write("ca-" + "b" * 24, {"key": "PEM", "cert": "CERT"})
    raw = store.get_secret("cpuos-secret-" + "a" * 24)
    assert raw is not None and raw[0] == key_id(k1) and "sk-plain" not in raw[1]
    assert b.read("cpuos-secret-" + "a" * 24) == {"value": "sk-plain-text-value"}
    assert b.names() == ["ca-" + "b" * 24, "cpuos-secret-" + "a" * 24]
    # rotation: a new first key; the node's start seals every row again under it
    b2 = SealedBackend(store, Sealer([k2, k1]))
    assert store.secret_names(not_key=key_id(k2)) == b.names()
    assert b2.rewrap() == 2 and store.secret_names(not_key=key_id(k2)) == []
    assert b2.read("ca-" + "b" * 24) == {"key": "PEM", "cert": "CERT"}
    assert b.read("ca-" + "b" * 24) is None  # (the old key alone opens nothing now)
    b2.delete("ca-" + "b" * 24)
    store.delete_secrets(["cpuos-secret-" + "a" * 24, "nope"])
    assert b2.names() == [] and store.get_secret("ca-" + "b" * 24) is None


def test_take_lease(store: Store) -> None:
    """A named lease (the snapshot store's sweep): one holder until it expires; the holder
    renews it."""
    assert store.take_lease("chore", "api-1", 30)
    assert not store.take_lease("chore", "api-2", 30)
    assert store.take_lease("chore", "api-1", 30)  # (renewed)
    assert store.take_lease("other", "api-2", 30)  # (another name: its own)
    assert store.take_lease("chore", "api-1", -1)  # (renewed as already expired)
    assert store.take_lease("chore", "api-2", 30)  # (taken over)
    assert not store.take_lease("chore", "api-1", 30)


def test_console_sessions(store: Store) -> None:
    """The console's sessions (cpuosd.console.sessions) by their token's hash: found with
    their key's liveness in one query, bounded (the oldest make way), dropped one by one or
    by key."""
    import time

    wid = store.create_workspace("w")
    k = store.key_lookup(store.add_key(wid, "k"))
    assert k is not None
    now = time.time()
    store.session_create("h1", k[0], wid, now, now + 60, 3)
    r = store.session_get("h1")
    assert r is not None and r["key_id"] == k[0] and r["workspace_id"] == wid and r["live"]
    assert abs(r["expires_at"] - (now + 60)) < 1e-3 and store.session_get("h2") is None
    for i in range(2, 5):
        store.session_create(f"h{i}", k[0], wid, now + i, now + 60, 3)
    assert store.session_count() == 3 and store.session_get("h1") is None
    store.session_create("old", "key-x", wid, now + 10, now + 5, 3)  # (already expired)
    store.session_create("h9", "key-x", wid, now + 11, now + 60, 3)
    assert store.session_get("old") is None  # (expired ones went first)
    r9 = store.session_get("h9")
    assert r9 is not None and not r9["live"]  # (no such key)
    assert store.revoke_key(wid, k[0], keep_one=False) == "revoked"
    r4 = store.session_get("h4")
    assert r4 is not None and not r4["live"]
    assert store.session_drop("h9") and not store.session_drop("h9")
    assert store.session_drop_key(k[0]) >= 1 and store.session_get("h4") is None
