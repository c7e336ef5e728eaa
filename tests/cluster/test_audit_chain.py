"""The audit chain shared by many nodes (cpuosd.store.audit_chain) on a real Postgres: two
processes append at once and the rows verify as one chain; an edit, a deleted row and
deleted newest rows are found, also by ``cpuosd audit verify`` with CPUOS_DATABASE_URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cpuosd.accounting.audit import AuditLog
from cpuosd.store.audit_chain import PgAuditChain
from cpuosd.store.postgres import PostgresStore

pytestmark = pytest.mark.cluster

KEY = bytes(range(32))

WRITER = textwrap.dedent("""
    import json, sys, time
    from cpuosd.store.audit_chain import PgAuditChain
    url, node, go, batches = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    chain = PgAuditChain(url, bytes(range(32)))
    time.sleep(max(0.0, go - time.time()))
    head = None
    for b in range(batches):
        head = chain.append([(time.time(), "ws-1", f"sbx-{node}", "command",
                              {"node": node, "batch": b, "i": i}) for i in range(20)])
    chain.close()
    print(json.dumps(head))
""")


@pytest.fixture
def chain(pg_url: str) -> Iterator[PgAuditChain]:
    PostgresStore(pg_url).close()  # (its migrations make the audit tables)
    c = PgAuditChain(pg_url, KEY)
    yield c
    c.close()



def _restore_and_truncate(pg_url: str, edited: int, detail: dict[str, int], keep_below: int
                          ) -> None:
    """Row ``edited`` given back its ``detail``, the rows from ``keep_below`` on deleted and
    the chain's head row rolled back to the newest left (what an intruder who knows the
    chain's shape would do: the chain alone then holds)."""
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE audit SET detail = %s WHERE seq = %s",
                  (json.dumps(detail, sort_keys=True, separators=(",", ":")), edited))
        c.execute("DELETE FROM audit WHERE seq >= %s", (keep_below,))
        r = c.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        assert r is not None
        c.execute("UPDATE audit_head SET seq = %s, hash = %s", r)

def test_two_nodes_append_to_one_chain(chain: PgAuditChain, pg_url: str,
                                       tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    go = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, str(script), pg_url, node, str(go), "15"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for node in ("a", "b")]
    heads = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
        heads.append(tuple(json.loads(out)))
    v = chain.verify(heads=[(int(s), str(h)) for s, h in heads])
    assert v["ok"], v["problems"]
    assert v["rows"] == 2 * 15 * 20 and v["head"]["seq"] == 600
    rows = chain.query(limit=1000)
    assert [r["seq"] for r in rows] == list(range(1, 601))
    # both nodes' batches are in the chain, each batch's rows together and in order
    assert {r["detail"]["node"] for r in rows} == {"a", "b"}
    for k in range(0, 600, 20):
        batch = rows[k:k + 20]
        assert len({(r["detail"]["node"], r["detail"]["batch"]) for r in batch}) == 1
        assert [r["detail"]["i"] for r in batch] == list(range(20))
    assert len(chain.query(sandbox="sbx-a", kinds=("command",), limit=1000)) == 300


def test_edits_and_deletions_are_found(chain: PgAuditChain, pg_url: str) -> None:
    for b in range(3):
        head = chain.append([(time.time(), "ws-1", "sbx-1", "lifecycle", {"b": b, "i": i})
                             for i in range(5)])
    assert head[0] == 15 and chain.verify(heads=[head])["ok"]
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE audit SET detail = '{\"b\": 9}' WHERE seq = 4")
        c.execute("DELETE FROM audit WHERE seq = 9")
    v = chain.verify(heads=[head])
    assert not v["ok"]
    problems = {(p["seq"], p["problem"].split(" (")[0]) for p in v["problems"]}
    assert (4, "its content does not match its hash") in problems
    assert any(seq == 9 and "missing" in what for seq, what in problems)
    # the newest rows deleted and the head row rolled back with them: a node's head finds it
    _restore_and_truncate(pg_url, 4, {"b": 0, "i": 3}, 9)
    assert chain.verify()["ok"]  # (the chain alone cannot tell)
    v = chain.verify(heads=[head])
    assert not v["ok"] and v["problems"][-1]["seq"] == 15


def test_retention_keeps_the_chain_verifiable(chain: PgAuditChain) -> None:
    old = time.time() - 1000
    chain.append([(old, "ws-1", "sbx-1", "command", {"i": i}) for i in range(10)])
    head = chain.append([(time.time(), "ws-1", "sbx-1", "command", {"i": i}) for i in range(5)])
    assert chain.prune(time.time() - 500) == 10
    assert chain.prune(time.time() - 2000) == 0
    anchor = chain.anchor()
    assert anchor is not None and anchor[0] == 10
    v = chain.verify(heads=[head, (3, "x" * 64)])  # (a head from before the anchor: pruned)
    assert v["ok"] and v["rows"] == 5


def _cli_verify(home: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpuosd.main", "audit", "verify", "--home",
                           str(home), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_cpuosd_audit_verify_checks_the_shared_chain(chain: PgAuditChain, pg_url: str,
                                                     tmp_path: Path) -> None:
    """``cpuosd audit verify`` on a node's host with CPUOS_DATABASE_URL walks the chain in
    Postgres (not the home's files) with the key of CPUOS_AUDIT_KEY_FILE and the home's
    audit.head, and answers what ``GET /audit/verify`` answers (the same code: the
    AuditLog of a node over that chain); an edited row, and the newest rows deleted with the
    chain's head rolled back, are found."""
    for b in range(3):
        head = chain.append([(time.time(), "ws-1", f"sbx-{b}", "lifecycle", {"b": b, "i": i})
                             for i in range(5)])
    home = tmp_path / "node-a"
    home.mkdir()
    (home / "audit.head").write_text(json.dumps({"seq": head[0], "hash": head[1]}))
    key_file = tmp_path / "audit.key"
    key_file.write_text(KEY.hex() + "\n")
    env = {"CPUOS_DATABASE_URL": pg_url, "CPUOS_AUDIT_KEY_FILE": str(key_file)}

    def api_answer() -> dict[str, object]:  # (what a node's GET /audit/verify walks)
        node = AuditLog(tmp_path / "api" / "audit.db", key_file, home / "audit.head",
                        chain=PgAuditChain(pg_url, KEY))
        try:
            return node.verify()
        finally:
            node.close()

    (tmp_path / "api").mkdir()
    out = _cli_verify(home, env, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout)
    assert got["ok"] and got["rows"] == 15 and got["head"]["seq"] == 15
    assert got == api_answer()
    assert not (home / "audit.db").exists()  # (the home's files are not what it read)

    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE audit SET detail = '{\"b\": 1, \"i\": 9}' WHERE seq = 7")
    out = _cli_verify(home, env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "seq 7: its content does not match its hash (edited) (sandbox sbx-1)" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("BROKEN: 15 rows checked")
    got = json.loads(_cli_verify(home, env, "--json").stdout)
    assert [p["seq"] for p in got["problems"]] == [7] and got == api_answer()

    # the edit undone, the newest rows deleted and the chain's head row rolled back: the
    # chain alone holds, the row this node last wrote (its audit.head) is gone
    _restore_and_truncate(pg_url, 7, {"b": 1, "i": 1}, 12)
    (tmp_path / "elsewhere").mkdir()
    assert _cli_verify(tmp_path / "elsewhere", env).returncode == 0  # (no head kept there)
    out = _cli_verify(home, env, "--json")
    assert out.returncode == 1
    got = json.loads(out.stdout)
    assert got["problems"] == [{"seq": 15, "sandbox": None,
                                "problem": "a node's last written row is gone or changed"}]
    assert got == api_answer()

    # no key where the configuration says: said, not made
    out = _cli_verify(home, {**env, "CPUOS_AUDIT_KEY_FILE": str(tmp_path / "none.key")})
    assert out.returncode == 2 and "no audit key at" in out.stderr
    assert not (tmp_path / "none.key").exists()
