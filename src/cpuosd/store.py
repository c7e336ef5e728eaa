"""SQLite state: workspaces, hashed API keys, sandboxes, execs.

One connection, WAL mode, used from the event loop thread (every statement is
small). Schema changes go through ``MIGRATIONS`` (append only).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import homedir

MIGRATIONS = [
    """
    CREATE TABLE workspaces (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at REAL NOT NULL
    );
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL REFERENCES workspaces(id),
        key_hash TEXT NOT NULL UNIQUE, label TEXT NOT NULL, created_at REAL NOT NULL
    );
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL REFERENCES workspaces(id),
        template TEXT NOT NULL, backend TEXT NOT NULL, state TEXT NOT NULL,
        reason TEXT, created_at REAL NOT NULL, started_at REAL, ended_at REAL,
        deadline REAL, spec TEXT NOT NULL, metadata TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX sandboxes_ws ON sandboxes(workspace_id, state);
    CREATE TABLE execs (
        id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL REFERENCES sandboxes(id),
        argv TEXT NOT NULL, started_at REAL NOT NULL, ended_at REAL,
        exit_code INTEGER, signal INTEGER, timed_out INTEGER, error TEXT,
        stdout_bytes INTEGER NOT NULL DEFAULT 0, stderr_bytes INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX execs_sbx ON execs(sandbox_id, started_at);
    """,
    """
    ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill';
    ALTER TABLE sandboxes ADD COLUMN paused_at REAL;
    ALTER TABLE sandboxes ADD COLUMN remaining REAL;
    ALTER TABLE sandboxes ADD COLUMN snapshot_bytes INTEGER;
    """,
    """
    ALTER TABLE workspaces ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
    """,
    """
    CREATE TABLE connections (
        n INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT NULL, time REAL NOT NULL,
        proto TEXT NOT NULL, dst TEXT, port INTEGER, name TEXT, verdict TEXT NOT NULL,
        rule TEXT, bytes_out INTEGER, bytes_in INTEGER, extra TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX connections_sbx ON connections(sandbox_id, n);
    """,
    """
    ALTER TABLE workspaces ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';
    """,
    """
    CREATE TABLE usage (
        id INTEGER PRIMARY KEY AUTOINCREMENT, workspace_id TEXT NOT NULL,
        sandbox_id TEXT NOT NULL, kind TEXT NOT NULL, start REAL NOT NULL, end REAL,
        vcpus INTEGER, memory_mib INTEGER, snapshot_bytes INTEGER
    );
    CREATE INDEX usage_ws ON usage(workspace_id, start);
    CREATE INDEX usage_open ON usage(sandbox_id, end);
    """,
    """
    ALTER TABLE api_keys ADD COLUMN revoked_at REAL;
    ALTER TABLE workspaces ADD COLUMN deleted_at REAL;
    """,
    """
    ALTER TABLE usage ADD COLUMN reason TEXT;
    CREATE INDEX sandboxes_state ON sandboxes(state, deadline);
    CREATE INDEX usage_ws_end ON usage(workspace_id, end);
    """,
]
# what is kept of one sandbox's connection record (the oldest go first)
MAX_CONNECTIONS = 10_000

# States with something on the host (a runsc sandbox, a snapshot, or both in flux).
LIVE_STATES = ("creating", "running", "pausing", "paused", "resuming", "killing", "pooled")
ACTIVE_STATES = ("creating", "running", "pausing", "paused", "resuming", "killing")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "cpk_" + secrets.token_urlsafe(32)


@dataclass
class SandboxRow:
    id: str
    workspace_id: str
    template: str
    backend: str
    state: str
    reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    deadline: float | None
    spec: dict[str, Any]
    metadata: dict[str, str]
    on_timeout: str = "kill"
    paused_at: float | None = None
    remaining: float | None = None
    snapshot_bytes: int | None = None

    @classmethod
    def from_row(cls, r: sqlite3.Row) -> SandboxRow:
        d = dict(r)
        d["spec"] = json.loads(d["spec"])
        d["metadata"] = json.loads(d["metadata"])
        return cls(**d)


def _workspace_json(r: sqlite3.Row) -> dict[str, Any]:
    return {"id": r[0], "name": r[1], "created_at": r[2], "limits": json.loads(r[3]),
            "settings": json.loads(r[4]), "deleted_at": r[5]}


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        homedir.create_private(path)  # 0600 before SQLite: its -wal/-shm get the same
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()
        homedir.private_db_files(path)  # (and those an older daemon left 0644)

    def close(self) -> None:
        self._db.close()

    def _migrate(self) -> None:
        with self._lock:
            v = self._db.execute("PRAGMA user_version").fetchone()[0]
            for i, sql in enumerate(MIGRATIONS[v:], start=v + 1):
                self._db.executescript(f"BEGIN; {sql}; PRAGMA user_version={i}; COMMIT;")

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """One statement, for the modules that keep tables of their own here (usage)."""
        return self._exec(sql, args)

    # ---- workspaces and keys --------------------------------------------------------
    def create_workspace(self, name: str, limits: dict[str, int] | None = None) -> str:
        wid = "ws-" + secrets.token_hex(6)
        self._exec("INSERT INTO workspaces (id, name, created_at, limits) VALUES (?,?,?,?)",
                   (wid, name, time.time(), json.dumps(limits or {})))
        return wid

    def workspace(self, wid: str, *, deleted: bool = False) -> dict[str, Any] | None:
        """A workspace's record; a deleted one only with ``deleted``."""
        r = self._exec("SELECT id, name, created_at, limits, settings, deleted_at FROM "
                       "workspaces WHERE id=?", (wid,)).fetchone()
        if r is None or (r[5] is not None and not deleted):
            return None
        return _workspace_json(r)

    def list_workspaces(self, *, deleted: bool = False) -> list[dict[str, Any]]:
        rows = self._exec("SELECT id, name, created_at, limits, settings, deleted_at FROM "
                          "workspaces" + ("" if deleted else " WHERE deleted_at IS NULL")
                          + " ORDER BY created_at").fetchall()
        return [_workspace_json(r) for r in rows]

    def delete_workspace(self, wid: str) -> list[str]:
        """Mark the workspace deleted and revoke its keys, in one transaction; the ids of
        the keys revoked. Its rows (sandboxes, usage, audit) are kept."""
        now = time.time()
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            keys = [r[0] for r in self._db.execute(
                "SELECT id FROM api_keys WHERE workspace_id=? AND revoked_at IS NULL",
                (wid,)).fetchall()]
            self._db.execute("UPDATE api_keys SET revoked_at=? WHERE workspace_id=? AND "
                             "revoked_at IS NULL", (now, wid))
            self._db.execute("UPDATE workspaces SET deleted_at=? WHERE id=? AND deleted_at "
                             "IS NULL", (now, wid))
        return keys

    def set_workspace_settings(self, wid: str, settings: dict[str, Any]) -> None:
        self._exec("UPDATE workspaces SET settings=? WHERE id=?", (json.dumps(settings), wid))

    def set_workspace_limits(self, wid: str, limits: dict[str, int]) -> None:
        self._exec("UPDATE workspaces SET limits=? WHERE id=?", (json.dumps(limits), wid))

    def workspace_by_name(self, name: str) -> str | None:
        """The live workspace of that name (a deleted one's name may be taken again)."""
        r = self._exec("SELECT id FROM workspaces WHERE name=? AND deleted_at IS NULL "
                       "ORDER BY created_at LIMIT 1", (name,)).fetchone()
        return r[0] if r else None

    def add_key(self, workspace_id: str, label: str, key: str | None = None) -> str:
        """A new key of the workspace, returned once (``key``: one made by the caller in
        another format, e.g. the E2B surface's ``e2b_<hex>``)."""
        made: str = self.new_key(workspace_id, label, key)[1]["key"]
        return made

    def new_key(self, workspace_id: str, label: str, key: str | None = None
                ) -> tuple[str, dict[str, Any]]:
        """A new key of the workspace: (its id, its record with the key itself, which is
        shown once and stored only hashed)."""
        key, kid, now = key or new_key(), "key-" + secrets.token_hex(6), time.time()
        self._exec("INSERT INTO api_keys (id, workspace_id, key_hash, label, created_at) "
                   "VALUES (?,?,?,?,?)", (kid, workspace_id, hash_key(key), label, now))
        return kid, {"id": kid, "workspace_id": workspace_id, "label": label,
                     "created_at": now, "revoked_at": None, "key": key}

    def workspace_for_key(self, key: str) -> str | None:
        found = self.key_lookup(key)
        return found[1] if found else None

    def key_lookup(self, key: str) -> tuple[str, str] | None:
        """(key id, workspace id) of a key that is not revoked, of a live workspace."""
        r = self._exec("SELECT k.id, k.workspace_id FROM api_keys k JOIN workspaces w ON "
                       "w.id=k.workspace_id WHERE k.key_hash=? AND k.revoked_at IS NULL AND "
                       "w.deleted_at IS NULL", (hash_key(key),)).fetchone()
        return (r[0], r[1]) if r else None

    def list_keys(self, workspace_id: str) -> list[dict[str, Any]]:
        """The workspace's keys (never a key or its hash), revoked ones included."""
        rows = self._exec("SELECT id, workspace_id, label, created_at, revoked_at FROM "
                          "api_keys WHERE workspace_id=? ORDER BY created_at",
                          (workspace_id,)).fetchall()
        return [dict(r) for r in rows]

    def revoke_key(self, workspace_id: str, key_id: str, *, keep_one: bool) -> str:
        """Revoke one key of the workspace: ``revoked``, ``already`` (it was), ``missing``
        (no such key there) or ``last`` (``keep_one`` and it is the workspace's last live
        key: nothing changed). Checked and written in one transaction."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            r = self._db.execute("SELECT revoked_at FROM api_keys WHERE id=? AND "
                                 "workspace_id=?", (key_id, workspace_id)).fetchone()
            if r is None:
                return "missing"
            if r[0] is not None:
                return "already"
            if keep_one:
                live = self._db.execute("SELECT COUNT(*) FROM api_keys WHERE workspace_id=? "
                                        "AND revoked_at IS NULL", (workspace_id,)).fetchone()
                if live[0] <= 1:
                    return "last"
            self._db.execute("UPDATE api_keys SET revoked_at=? WHERE id=?",
                             (time.time(), key_id))
        return "revoked"

    def key_record(self, key_id: str) -> dict[str, Any] | None:
        r = self._exec("SELECT id, workspace_id, label, created_at, revoked_at FROM api_keys "
                       "WHERE id=?", (key_id,)).fetchone()
        return dict(r) if r else None

    # ---- sandboxes ------------------------------------------------------------------
    def insert_sandbox(self, row: SandboxRow) -> None:
        d = dict(row.__dict__)
        d["spec"], d["metadata"] = json.dumps(row.spec), json.dumps(row.metadata)
        cols = ", ".join(d)
        self._exec(f"INSERT INTO sandboxes ({cols}) VALUES ({', '.join('?' * len(d))})",
                   tuple(d.values()))

    def update_sandbox(self, sid: str, **fields: Any) -> None:
        for k in ("spec", "metadata"):
            if k in fields:
                fields[k] = json.dumps(fields[k])
        cols = ", ".join(f"{k}=?" for k in fields)
        self._exec(f"UPDATE sandboxes SET {cols} WHERE id=?", (*fields.values(), sid))

    def get_sandbox(self, sid: str) -> SandboxRow | None:
        r = self._exec("SELECT * FROM sandboxes WHERE id=?", (sid,)).fetchone()
        return SandboxRow.from_row(r) if r else None

    def list_sandboxes(self, workspace_id: str | None = None, states: tuple[str, ...] = ()
                       ) -> list[SandboxRow]:
        sql, args = "SELECT * FROM sandboxes WHERE 1=1", []
        if workspace_id is not None:
            sql += " AND workspace_id=?"
            args.append(workspace_id)
        if states:
            sql += f" AND state IN ({','.join('?' * len(states))})"
            args.extend(states)
        sql += " ORDER BY created_at"
        return [SandboxRow.from_row(r) for r in self._exec(sql, tuple(args)).fetchall()]

    def sandbox_totals(self, workspace_id: str | None, states: tuple[str, ...]
                       ) -> tuple[int, int, int]:
        """(how many, their vCPUs, their memory MiB) of the sandboxes in these states (of
        one workspace, or all): summed by SQLite from the (workspace, state) index."""
        sql = ("SELECT COUNT(*), COALESCE(SUM(json_extract(spec, '$.vcpus')), 0), "
               "COALESCE(SUM(json_extract(spec, '$.memory_mib')), 0) FROM sandboxes "
               f"WHERE state IN ({','.join('?' * len(states))})")
        args: list[Any] = list(states)
        if workspace_id is not None:
            sql += " AND workspace_id=?"
            args.append(workspace_id)
        n, v, m = self._exec(sql, tuple(args)).fetchone()
        return int(n), int(v), int(m)

    def expired(self, now: float) -> list[tuple[str, str]]:
        rows = self._exec("SELECT id, on_timeout FROM sandboxes WHERE state='running' "
                          "AND deadline<=?", (now,)).fetchall()
        return [(r[0], r[1]) for r in rows]

    # ---- execs ----------------------------------------------------------------------
    def insert_exec(self, eid: str, sandbox_id: str, argv: list[str]) -> None:
        self._exec("INSERT INTO execs (id, sandbox_id, argv, started_at) VALUES (?,?,?,?)",
                   (eid, sandbox_id, json.dumps(argv), time.time()))

    def finish_exec(self, eid: str, **fields: Any) -> None:
        fields["ended_at"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self._exec(f"UPDATE execs SET {cols} WHERE id=?", (*fields.values(), eid))

    def add_connection(self, sandbox_id: str, rec: dict[str, Any]) -> None:
        self.add_connections([(sandbox_id, rec)])

    def add_connections(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        """Connection records, in one transaction."""
        cols = ("time", "proto", "dst", "port", "name", "verdict", "rule", "bytes_out",
                "bytes_in")
        rows = [(sid, *(rec.get(c) for c in cols),
                 json.dumps({k: v for k, v in rec.items() if k not in cols}, default=str))
                for sid, rec in batch]
        with self._lock:
            before = self._db.execute("SELECT COALESCE(MAX(n), 0) FROM connections"
                                      ).fetchone()[0]
            with self._db:
                self._db.executemany(
                    f"INSERT INTO connections (sandbox_id, {', '.join(cols)}, extra) "
                    f"VALUES (?, {', '.join('?' * len(cols))}, ?)", rows)
        if (before + len(rows)) // 500 != before // 500:  # now and then: keep each
            for sid in {s for s, _ in batch}:  # sandbox's newest MAX_CONNECTIONS
                self._exec("DELETE FROM connections WHERE sandbox_id=? AND n <= (SELECT n "
                           "FROM connections WHERE sandbox_id=? ORDER BY n DESC LIMIT 1 "
                           "OFFSET ?)", (sid, sid, MAX_CONNECTIONS))

    def list_connections(self, sandbox_id: str, limit: int = 100, after: int = 0
                         ) -> list[dict[str, Any]]:
        # newest first; with ``after``, the next ones in order (paging forward)
        order = "ASC" if after else "DESC"
        rows = self._exec(f"SELECT * FROM connections WHERE sandbox_id=? AND n>? ORDER BY n "
                          f"{order} LIMIT ?", (sandbox_id, after, limit)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d.update(json.loads(d.pop("extra") or "{}"))
            d.pop("sandbox_id", None)
            out.append({k: v for k, v in d.items() if v is not None})
        return out

    def list_execs(self, sandbox_id: str, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._exec("SELECT * FROM execs WHERE sandbox_id=? ORDER BY started_at DESC "
                          "LIMIT ?", (sandbox_id, limit)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["argv"] = json.loads(d["argv"])
            d["timed_out"] = bool(d["timed_out"]) if d["timed_out"] is not None else None
            out.append(d)
        return out
