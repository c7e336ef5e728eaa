"""The audit chain in Postgres: one hash chain that every node appends to.

On one host the audit trail is a SQLite database of its own with one writer thread
(cpuosd.accounting.audit.AuditLog), which numbers rows and links each to the one before
in memory. With many nodes writing into one database there is no such single writer, so
the chain's head is a row (``audit_head``: the last seq and hash) and an append is one
transaction that locks it (``SELECT ... FOR UPDATE``), links its batch to it, inserts the
rows and moves it. Appends from all nodes are thus serialized (each holds the lock for one
batch: a few ms for a few hundred rows), and the rows form one chain whatever node wrote
them: ``verify_chain`` (cpuosd.accounting.audit) checks it as on one host, with the same
HMAC key, which every node must hold (a Secret; ``$CPUOS_HOME/audit.key`` on each).

Why one chain and not one per node: a per-node chain needs no lock, but then a verifier
must know every node that ever wrote, and deleting all of one node's newest rows is
undetectable without that node's head. With one chain every row is linked to every other;
contention is one short lock per batch, and the AuditLog already batches (up to 500 rows
per transaction). Should it ever become the bottleneck, the way out is a chain per node
(``audit.chain`` column, a head row per chain) verified chain by chain.

Deleting the newest rows (and rolling ``audit_head`` back) is found by comparing with a
head kept elsewhere: ``append`` returns the new (seq, hash), which each node keeps (its
``audit.head`` file, as on one host), and ``verify(heads=...)`` checks that each such row is
still there with that hash.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Sequence
from typing import Any

from ..accounting.audit import (COLS, GENESIS, _anchor_mac, encode_detail, row_hash, row_json,
                                verify_chain)
from .postgres import connect_pool

AppendRow = tuple[float, str, str, str, dict[str, Any]]  # (time, workspace, sandbox, kind,
#                                                            detail)


class PgAuditChain:
    """Append, read, prune and verify the shared chain (the state store's database: its
    migrations made the tables)."""

    def __init__(self, url: str, key: bytes, max_size: int = 2) -> None:
        self.key = key
        self.pool = connect_pool(url, max_size)

    def close(self) -> None:
        self.pool.close()

    def append(self, batch: Sequence[AppendRow]) -> tuple[int, str]:
        """Link ``batch`` to the chain's head and insert it, in one transaction that holds
        the head's row lock; the new head (seq, hash)."""
        with self.pool.connection() as c, c.transaction():
            head = c.execute("SELECT seq, hash FROM audit_head WHERE id = 1 FOR UPDATE"
                             ).fetchone()
            if head is None:
                raise RuntimeError("audit_head is missing: the store's migrations did not run")
            seq, prev = int(head["seq"]), str(head["hash"])
            rows = []
            for t, ws, sbx, kind, detail in batch:
                seq += 1
                text = encode_detail(detail)
                h = row_hash(self.key, prev, seq, t, ws, sbx, kind, text)
                rows.append((seq, t, ws, sbx, kind, text, prev, h))
                prev = h
            if rows:
                with c.cursor() as cur:
                    cur.executemany(f"INSERT INTO audit ({COLS}) VALUES "
                                    "(%s, %s, %s, %s, %s, %s, %s, %s)", rows)
                c.execute("UPDATE audit_head SET seq = %s, hash = %s WHERE id = 1", (seq, prev))
        return seq, prev

    def head(self) -> tuple[int, str]:
        with self.pool.connection() as c:
            r = c.execute("SELECT seq, hash FROM audit_head WHERE id = 1").fetchone()
        return (int(r["seq"]), str(r["hash"])) if r else (0, GENESIS)

    def query(self, sandbox: str | None = None, kinds: tuple[str, ...] = (),
              after: int = 0, limit: int = 1000, workspace: str | None = None,
              since: float | None = None, until: float | None = None
              ) -> list[dict[str, Any]]:
        sql = f"SELECT {COLS} FROM audit WHERE seq > %s"
        args: list[Any] = [after]
        for col, val in (("sandbox", sandbox), ("workspace", workspace)):
            if val is not None:
                sql += f" AND {col} = %s"
                args.append(val)
        if kinds:
            sql += " AND kind = ANY(%s)"
            args.append(list(kinds))
        if since is not None:
            sql += " AND time >= %s"
            args.append(since)
        if until is not None:
            sql += " AND time < %s"
            args.append(until)
        sql += " ORDER BY seq LIMIT %s"
        args.append(limit)
        with self.pool.connection() as c:
            rows = c.execute(sql, args).fetchall()
        return [row_json(tuple(r.values())) for r in rows]

    def iter_rows(self, after: int = 0, chunk: int = 5000) -> Iterator[tuple[Any, ...]]:
        while True:
            with self.pool.connection() as c:
                rows = c.execute(f"SELECT {COLS} FROM audit WHERE seq > %s ORDER BY seq "
                                 "LIMIT %s", (after, chunk)).fetchall()
            if not rows:
                return
            for r in rows:
                yield tuple(r.values())
            after = int(rows[-1]["seq"])

    def anchor(self) -> tuple[int, str, str] | None:
        with self.pool.connection() as c:
            r = c.execute("SELECT seq, hash, mac FROM audit_anchor WHERE id = 1").fetchone()
        return None if r is None else (int(r["seq"]), str(r["hash"]), str(r["mac"]))

    def prune(self, before: float) -> int:
        """Delete rows older than ``before`` from the front of the chain; the last one
        deleted becomes the anchor (never moved back by a slower pruner)."""
        with self.pool.connection() as c, c.transaction():
            r = c.execute("SELECT seq, hash FROM audit WHERE time < %s ORDER BY seq DESC "
                          "LIMIT 1", (before,)).fetchone()
            if r is None:
                return 0
            seq, h = int(r["seq"]), str(r["hash"])
            n = c.execute("DELETE FROM audit WHERE seq <= %s", (seq,)).rowcount
            c.execute("INSERT INTO audit_anchor (id, seq, hash, mac) VALUES (1, %s, %s, %s) "
                      "ON CONFLICT (id) DO UPDATE SET seq = EXCLUDED.seq, hash = EXCLUDED.hash, "
                      "mac = EXCLUDED.mac WHERE audit_anchor.seq < EXCLUDED.seq",
                      (seq, h, _anchor_mac(self.key, seq, h)))
        return int(n)

    def verify(self, heads: Sequence[tuple[int, str]] = ()) -> dict[str, Any]:
        """The whole chain (``verify_chain``), and each head a node kept: its row must still
        be there with that hash (else rows were deleted from the end, or edited)."""
        chain_head = self.head()
        out = verify_chain(self.iter_rows(), self.key, self.anchor(),
                           {"seq": chain_head[0], "hash": chain_head[1]})
        anchor = self.anchor()
        for seq, h in heads:
            if anchor is not None and seq <= anchor[0]:
                continue  # (pruned since: the anchor vouches for the chain's start)
            with self.pool.connection() as c:
                r = c.execute("SELECT hash FROM audit WHERE seq = %s", (seq,)).fetchone()
            if r is None or not hmac.compare_digest(str(r["hash"]), h):
                out["ok"] = False
                out["problem_count"] += 1
                out["problems"].append({"seq": seq, "sandbox": None, "problem":
                                        "a node's last written row is gone or changed"})
        return out
