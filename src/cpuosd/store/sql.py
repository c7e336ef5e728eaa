"""The state store's queries, written once for SQLite and Postgres (cpuosd.store.base.Store).

A dialect (cpuosd.store.sqlite, cpuosd.store.postgres) gives connections that run one
statement (``?`` placeholders; rows as dicts) and write transactions, and the few
fragments that differ (a JSON field as a number, the larger of two values, an index
hint). Schema changes go through cpuosd.store.migrations (append only).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..lifecycle.states import State
from .base import MAX_CONNECTIONS, RowSpec, SandboxRow, UsageInterval, hash_key, new_key


class Conn(Protocol):
    """One connection (or transaction) of a dialect."""

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]: ...
    def run(self, sql: str, args: Sequence[Any] = ()) -> int: ...  # rows changed
    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...


def _workspace_json(r: dict[str, Any]) -> dict[str, Any]:
    return {"id": r["id"], "name": r["name"], "created_at": r["created_at"],
            "limits": json.loads(r["limits"]), "settings": json.loads(r["settings"]),
            "deleted_at": r["deleted_at"]}


_WS_COLS = "id, name, created_at, limits, settings, deleted_at"
_USAGE_COLS = 'sandbox_id, kind, start, "end", vcpus, memory_mib, snapshot_bytes, reason'


def _interval(r: dict[str, Any]) -> UsageInterval:
    return UsageInterval(r["sandbox_id"], r["kind"], float(r["start"]),
                         None if r["end"] is None else float(r["end"]), r["vcpus"],
                         r["memory_mib"], r["snapshot_bytes"], r["reason"])


def _dump_spec(spec: RowSpec | dict[str, Any]) -> str:
    return json.dumps(spec.to_json() if isinstance(spec, RowSpec) else spec)


def _in(values: Sequence[str]) -> str:
    return ",".join("?" * len(values))


class SqlStore:
    """Everything of ``Store`` but the connections (``_conn``, ``_tx``) and the dialect's
    fragments."""

    dialect = ""

    # ---- the dialect ----------------------------------------------------------------
    def _conn(self) -> contextlib.AbstractContextManager[Conn]:
        """A connection for one statement (autocommit)."""
        raise NotImplementedError

    def _tx(self) -> contextlib.AbstractContextManager[Conn]:
        """A write transaction: committed at the end of the block, rolled back on error."""
        raise NotImplementedError

    def _json_int(self, col: str, key: str) -> str:
        raise NotImplementedError

    def _greatest(self, a: str, b: str) -> str:
        raise NotImplementedError

    def _indexed_by(self, index: str) -> str:
        return ""

    def close(self) -> None:
        raise NotImplementedError

    # ---- helpers --------------------------------------------------------------------
    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._conn() as c:
            return c.rows(sql, args)

    def _one(self, sql: str, args: Sequence[Any] = ()) -> dict[str, Any] | None:
        rows = self._rows(sql, args)
        return rows[0] if rows else None

    def _run(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._conn() as c:
            return c.run(sql, args)

    # ---- workspaces and keys --------------------------------------------------------
    def create_workspace(self, name: str, limits: dict[str, int] | None = None) -> str:
        wid = "ws-" + secrets.token_hex(6)
        self._run("INSERT INTO workspaces (id, name, created_at, limits) VALUES (?,?,?,?)",
                  (wid, name, time.time(), json.dumps(limits or {})))
        return wid

    def workspace(self, wid: str, *, deleted: bool = False) -> dict[str, Any] | None:
        """A workspace's record; a deleted one only with ``deleted``."""
        r = self._one(f"SELECT {_WS_COLS} FROM workspaces WHERE id=?", (wid,))
        if r is None or (r["deleted_at"] is not None and not deleted):
            return None
        return _workspace_json(r)

    def list_workspaces(self, *, deleted: bool = False) -> list[dict[str, Any]]:
        rows = self._rows(f"SELECT {_WS_COLS} FROM workspaces"
                          + ("" if deleted else " WHERE deleted_at IS NULL")
                          + " ORDER BY created_at")
        return [_workspace_json(r) for r in rows]

    def delete_workspace(self, wid: str) -> list[str]:
        """Mark the workspace deleted and revoke its keys, in one transaction; the ids of
        the keys revoked. Its rows (sandboxes, usage, audit) are kept."""
        now = time.time()
        with self._tx() as c:
            keys = [r["id"] for r in c.rows(
                "SELECT id FROM api_keys WHERE workspace_id=? AND revoked_at IS NULL", (wid,))]
            c.run("UPDATE api_keys SET revoked_at=? WHERE workspace_id=? AND revoked_at IS "
                  "NULL", (now, wid))
            c.run("UPDATE workspaces SET deleted_at=? WHERE id=? AND deleted_at IS NULL",
                  (now, wid))
        return keys

    def set_workspace_settings(self, wid: str, settings: dict[str, Any]) -> None:
        self._run("UPDATE workspaces SET settings=? WHERE id=?", (json.dumps(settings), wid))

    def set_workspace_limits(self, wid: str, limits: dict[str, int]) -> None:
        self._run("UPDATE workspaces SET limits=? WHERE id=?", (json.dumps(limits), wid))

    def workspace_by_name(self, name: str) -> str | None:
        """The live workspace of that name (a deleted one's name may be taken again)."""
        r = self._one("SELECT id FROM workspaces WHERE name=? AND deleted_at IS NULL "
                      "ORDER BY created_at LIMIT 1", (name,))
        return r["id"] if r else None

    def workspaces_with_setting(self, name: str) -> list[str]:
        """Workspaces whose settings may name ``name`` (a superset: read each to be sure)."""
        return [r["id"] for r in self._rows("SELECT id FROM workspaces WHERE settings LIKE ?",
                                            (f'%"{name}"%',))]

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
        self._run("INSERT INTO api_keys (id, workspace_id, key_hash, label, created_at) "
                  "VALUES (?,?,?,?,?)", (kid, workspace_id, hash_key(key), label, now))
        return kid, {"id": kid, "workspace_id": workspace_id, "label": label,
                     "created_at": now, "revoked_at": None, "key": key}

    def workspace_for_key(self, key: str) -> str | None:
        found = self.key_lookup(key)
        return found[1] if found else None

    def key_lookup(self, key: str) -> tuple[str, str] | None:
        """(key id, workspace id) of a key that is not revoked, of a live workspace."""
        r = self._one("SELECT k.id, k.workspace_id FROM api_keys k JOIN workspaces w ON "
                      "w.id=k.workspace_id WHERE k.key_hash=? AND k.revoked_at IS NULL AND "
                      "w.deleted_at IS NULL", (hash_key(key),))
        return (r["id"], r["workspace_id"]) if r else None

    def list_keys(self, workspace_id: str) -> list[dict[str, Any]]:
        """The workspace's keys (never a key or its hash), revoked ones included."""
        return self._rows("SELECT id, workspace_id, label, created_at, revoked_at FROM "
                          "api_keys WHERE workspace_id=? ORDER BY created_at", (workspace_id,))

    def revoke_key(self, workspace_id: str, key_id: str, *, keep_one: bool) -> str:
        """Revoke one key of the workspace: ``revoked``, ``already`` (it was), ``missing``
        (no such key there) or ``last`` (``keep_one`` and it is the workspace's last live
        key: nothing changed). Checked and written in one transaction."""
        with self._tx() as c:
            rows = c.rows("SELECT revoked_at FROM api_keys WHERE id=? AND workspace_id=?",
                          (key_id, workspace_id))
            if not rows:
                return "missing"
            if rows[0]["revoked_at"] is not None:
                return "already"
            if keep_one:
                # (the workspace's live keys, locked where the dialect locks rows, so two
                # revocations of its last two keys cannot both pass)
                live = c.rows("SELECT id FROM api_keys WHERE workspace_id=? AND revoked_at "
                              "IS NULL" + self._for_update(), (workspace_id,))
                if len(live) <= 1:
                    return "last"
            c.run("UPDATE api_keys SET revoked_at=? WHERE id=? AND revoked_at IS NULL",
                  (time.time(), key_id))
        return "revoked"

    def _for_update(self) -> str:
        return ""

    def key_live(self, key_id: str) -> bool:
        """Whether the key (by id) is not revoked and its workspace not deleted (a console
        session lives only as long as its key)."""
        return self._one("SELECT 1 AS one FROM api_keys k JOIN workspaces w ON "
                         "w.id=k.workspace_id WHERE k.id=? AND k.revoked_at IS NULL AND "
                         "w.deleted_at IS NULL", (key_id,)) is not None

    def key_record(self, key_id: str) -> dict[str, Any] | None:
        return self._one("SELECT id, workspace_id, label, created_at, revoked_at FROM "
                         "api_keys WHERE id=?", (key_id,))

    # ---- console sessions -----------------------------------------------------------
    def session_create(self, token_hash: str, key_id: str, workspace_id: str,
                       created_at: float, expires_at: float, max_sessions: int) -> None:
        """A new session (its token's hash); expired ones go, and past ``max_sessions``
        the oldest make way (one transaction)."""
        with self._tx() as c:
            c.run("DELETE FROM console_sessions WHERE expires_at <= ?", (created_at,))
            n = int(c.rows("SELECT COUNT(*) AS n FROM console_sessions")[0]["n"])
            if n >= max_sessions:
                c.run("DELETE FROM console_sessions WHERE token_hash IN (SELECT token_hash "
                      "FROM console_sessions ORDER BY created_at, token_hash LIMIT ?)",
                      (n - max_sessions + 1,))
            c.run("INSERT INTO console_sessions (token_hash, key_id, workspace_id, "
                  "created_at, expires_at) VALUES (?,?,?,?,?)",
                  (token_hash, key_id, workspace_id, created_at, expires_at))

    def session_get(self, token_hash: str) -> dict[str, Any] | None:
        """The session (key_id, workspace_id, created_at, expires_at) and whether its key
        is still live (``live``: not revoked, its workspace not deleted), in one query;
        None if there is none. Expiry is the caller's to judge."""
        r = self._one("SELECT s.key_id, s.workspace_id, s.created_at, s.expires_at, "
                      "k.id AS kid, k.revoked_at, w.deleted_at FROM console_sessions s "
                      "LEFT JOIN api_keys k ON k.id=s.key_id "
                      "LEFT JOIN workspaces w ON w.id=k.workspace_id "
                      "WHERE s.token_hash=?", (token_hash,))
        if r is None:
            return None
        kid, revoked, deleted = r.pop("kid"), r.pop("revoked_at"), r.pop("deleted_at")
        live = kid is not None and revoked is None and deleted is None
        return {**r, "live": live}

    def session_drop(self, token_hash: str) -> bool:
        return self._run("DELETE FROM console_sessions WHERE token_hash=?", (token_hash,)) > 0

    def session_drop_key(self, key_id: str) -> int:
        return self._run("DELETE FROM console_sessions WHERE key_id=?", (key_id,))

    def session_count(self) -> int:
        return int(self._rows("SELECT COUNT(*) AS n FROM console_sessions")[0]["n"])

    # ---- sandboxes ------------------------------------------------------------------
    def insert_sandbox(self, row: SandboxRow) -> None:
        d = dict(row.__dict__)
        d["spec"], d["metadata"] = _dump_spec(row.spec), json.dumps(row.metadata)
        self._run(f"INSERT INTO sandboxes ({', '.join(d)}) VALUES ({_in(list(d))})",
                  tuple(d.values()))

    @staticmethod
    def _set(fields: dict[str, Any]) -> tuple[list[str], list[Any]]:
        cols, args = [], []
        for k, v in fields.items():
            cols.append(f"{k}=?")
            args.append(_dump_spec(v) if k == "spec" else json.dumps(v) if k == "metadata"
                        else v)
        return cols, args

    def update_sandbox(self, sid: str, **fields: Any) -> None:
        cols, args = self._set(fields)
        self._run(f"UPDATE sandboxes SET {', '.join(cols)} WHERE id=?", (*args, sid))

    def transition(self, sid: str, from_states: Iterable[State], to_state: State, *,
                   expect_epoch: int | None = None, new_epoch: bool = False,
                   **fields: Any) -> bool:
        """Compare-and-set: move the sandbox to ``to_state`` (and write ``fields``) only if
        it is in one of ``from_states`` (and, with ``expect_epoch``, at that epoch); with
        ``new_epoch`` its epoch grows by one (a change of owner: ``node_id`` in fields).
        True: this call made the change; False: another writer got there first (nothing
        written)."""
        frm = tuple(from_states)
        if not frm:
            raise ValueError("transition needs at least one state to move from")
        cols, args = self._set({"state": to_state, **fields})
        if new_epoch:
            cols.append("epoch=epoch+1")
        sql = f"UPDATE sandboxes SET {', '.join(cols)} WHERE id=? AND state IN ({_in(frm)})"
        args += [sid, *frm]
        if expect_epoch is not None:
            sql += " AND epoch=?"
            args.append(expect_epoch)
        return self._run(sql, args) == 1

    def fence_node(self, node_id: str, states: Iterable[State], to_state: State,
                   reason: str) -> list[str]:
        """A node declared dead: its sandboxes in ``states`` move to ``to_state`` with
        ``reason`` and a new epoch, in one statement, so that whatever that node still
        writes with its old epoch is refused. The ids of those sandboxes."""
        st = tuple(states)
        with self._tx() as c:
            rows = c.rows(f"UPDATE sandboxes SET state=?, reason=?, ended_at=?, epoch=epoch+1 "
                          f"WHERE node_id=? AND state IN ({_in(st)}) RETURNING id",
                          (to_state, reason, time.time(), node_id, *st))
        return sorted(r["id"] for r in rows)

    def get_sandbox(self, sid: str) -> SandboxRow | None:
        r = self._one("SELECT * FROM sandboxes WHERE id=?", (sid,))
        return SandboxRow.from_row(r) if r else None

    def list_sandboxes(self, workspace_id: str | None = None, states: tuple[State, ...] = (),
                       *, node_id: str | None = None) -> list[SandboxRow]:
        sql, args = "SELECT * FROM sandboxes WHERE 1=1", []
        if workspace_id is not None:
            sql += " AND workspace_id=?"
            args.append(workspace_id)
        if node_id is not None:
            sql += " AND node_id=?"
            args.append(node_id)
        if states:
            sql += f" AND state IN ({_in(states)})"
            args.extend(states)
        sql += " ORDER BY created_at"
        return [SandboxRow.from_row(r) for r in self._rows(sql, args)]

    def sandbox_totals(self, workspace_id: str | None, states: tuple[State, ...]
                       ) -> tuple[int, int, int]:
        """(how many, their vCPUs, their memory MiB) of the sandboxes in these states (of
        one workspace, or all): summed by the database from the (workspace, state) index."""
        sql = (f"SELECT COUNT(*) AS n, COALESCE(SUM({self._json_int('spec', 'vcpus')}), 0) "
               f"AS v, COALESCE(SUM({self._json_int('spec', 'memory_mib')}), 0) AS m FROM "
               f"sandboxes WHERE state IN ({_in(states)})")
        args: list[Any] = list(states)
        if workspace_id is not None:
            sql += " AND workspace_id=?"
            args.append(workspace_id)
        r = self._rows(sql, args)[0]
        return int(r["n"]), int(r["v"]), int(r["m"])

    def expired(self, now: float, *, node_id: str | None = None) -> list[tuple[str, str]]:
        sql = "SELECT id, on_timeout FROM sandboxes WHERE state=? AND deadline<=?"
        args: list[Any] = [State.RUNNING, now]
        if node_id is not None:
            sql += " AND node_id=?"
            args.append(node_id)
        rows = self._rows(sql, args)
        return [(r["id"], r["on_timeout"]) for r in rows]

    # ---- nodes (many hosts: membership without Kubernetes, cpuosd.cluster.nodes) -----
    def register_node(self, node_id: str, address: str, incarnation: str,
                      facts: dict[str, Any]) -> None:
        """A node (re)starting: its row, with a new incarnation (the cordon mark kept)."""
        now = time.time()
        with self._tx() as c:
            if c.run("UPDATE nodes SET address=?, incarnation=?, facts=?, started_at=?, "
                     "heartbeat_at=? WHERE id=?",
                     (address, incarnation, json.dumps(facts), now, now, node_id)) == 0:
                c.run("INSERT INTO nodes (id, address, incarnation, facts, started_at, "
                      "heartbeat_at, cordoned) VALUES (?,?,?,?,?,?,0)",
                      (node_id, address, incarnation, json.dumps(facts), now, now))

    def node_heartbeat(self, node_id: str, incarnation: str,
                       facts: dict[str, Any] | None = None) -> bool:
        """Renew a node's heartbeat (and its facts); False: the row has another incarnation
        (a newer process of that node took over) or is gone."""
        cols: list[str] = ["heartbeat_at=?"]
        args: list[Any] = [time.time()]
        if facts is not None:
            cols.append("facts=?")
            args.append(json.dumps(facts))
        return self._run(f"UPDATE nodes SET {', '.join(cols)} WHERE id=? AND incarnation=?",
                         (*args, node_id, incarnation)) == 1

    def list_nodes(self) -> list[dict[str, Any]]:
        """Every registered node: id, address, incarnation, facts (a dict), started_at,
        heartbeat_at (the node's own clock: observers judge liveness by when it changes,
        cpuosd.cluster.nodes) and cordoned."""
        out = []
        for r in self._rows("SELECT * FROM nodes ORDER BY id"):
            r = dict(r)
            r["facts"] = json.loads(r["facts"] or "{}")
            r["cordoned"] = bool(r["cordoned"])
            out.append(r)
        return out

    def set_node_cordoned(self, node_id: str, cordoned: bool) -> bool:
        return self._run("UPDATE nodes SET cordoned=? WHERE id=?",
                         (1 if cordoned else 0, node_id)) == 1

    def remove_node(self, node_id: str) -> None:
        self._run("DELETE FROM nodes WHERE id=?", (node_id,))

    def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        now = time.time()
        return self._run("INSERT INTO leases (name, holder, expires_at) VALUES (?,?,?) "
                         "ON CONFLICT (name) DO UPDATE SET holder=excluded.holder, "
                         "expires_at=excluded.expires_at WHERE leases.holder=excluded.holder "
                         "OR leases.expires_at < ?", (name, holder, now + ttl, now)) == 1

    # ---- sealed secrets (cpuosd.network.secrets.SealedBackend) ------------------------
    def put_secret(self, name: str, key_id: str, data: str) -> None:
        self._run("INSERT INTO secrets (name, key_id, data, created_at) VALUES (?,?,?,?) "
                  "ON CONFLICT (name) DO UPDATE SET key_id=excluded.key_id, "
                  "data=excluded.data", (name, key_id, data, time.time()))

    def get_secret(self, name: str) -> tuple[str, str] | None:
        r = self._one("SELECT key_id, data FROM secrets WHERE name=?", (name,))
        return (str(r["key_id"]), str(r["data"])) if r else None

    def delete_secrets(self, names: list[str]) -> None:
        if names:
            self._run(f"DELETE FROM secrets WHERE name IN ({_in(names)})", names)

    def secret_names(self, *, not_key: str | None = None) -> list[str]:
        if not_key is None:
            rows = self._rows("SELECT name FROM secrets ORDER BY name")
        else:
            rows = self._rows("SELECT name FROM secrets WHERE key_id<>? ORDER BY name",
                              (not_key,))
        return [str(r["name"]) for r in rows]

    # ---- execs ----------------------------------------------------------------------
    def insert_exec(self, eid: str, sandbox_id: str, argv: list[str]) -> None:
        self._run("INSERT INTO execs (id, sandbox_id, argv, started_at) VALUES (?,?,?,?)",
                  (eid, sandbox_id, json.dumps(argv), time.time()))

    def finish_exec(self, eid: str, **fields: Any) -> None:
        fields["ended_at"] = time.time()
        cols = ", ".join(f"{k}=?" for k in fields)
        self._run(f"UPDATE execs SET {cols} WHERE id=?", (*fields.values(), eid))

    def list_execs(self, sandbox_id: str, limit: int = 100) -> list[dict[str, Any]]:
        out = self._rows("SELECT * FROM execs WHERE sandbox_id=? ORDER BY started_at DESC "
                         "LIMIT ?", (sandbox_id, limit))
        for d in out:
            d["argv"] = json.loads(d["argv"])
            d["timed_out"] = bool(d["timed_out"]) if d["timed_out"] is not None else None
        return out

    # ---- connection records ---------------------------------------------------------
    def add_connection(self, sandbox_id: str, rec: dict[str, Any]) -> None:
        self.add_connections([(sandbox_id, rec)])

    def add_connections(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        """Connection records, in one transaction."""
        cols = ("time", "proto", "dst", "port", "name", "verdict", "rule", "bytes_out",
                "bytes_in")
        rows = [(sid, *(rec.get(c) for c in cols),
                 json.dumps({k: v for k, v in rec.items() if k not in cols}, default=str))
                for sid, rec in batch]
        with self._tx() as c:
            before = int(c.rows("SELECT COALESCE(MAX(n), 0) AS n FROM connections")[0]["n"])
            c.many(f"INSERT INTO connections (sandbox_id, {', '.join(cols)}, extra) "
                   f"VALUES (?, {_in(cols)}, ?)", rows)
        if (before + len(rows)) // 500 != before // 500:  # now and then: keep each
            for sid in {s for s, _ in batch}:  # sandbox's newest MAX_CONNECTIONS
                self._run("DELETE FROM connections WHERE sandbox_id=? AND n <= (SELECT n "
                          "FROM connections WHERE sandbox_id=? ORDER BY n DESC LIMIT 1 "
                          "OFFSET ?)", (sid, sid, MAX_CONNECTIONS))

    def list_connections(self, sandbox_id: str, limit: int = 100, after: int = 0
                         ) -> list[dict[str, Any]]:
        # newest first; with ``after``, the next ones in order (paging forward)
        order = "ASC" if after else "DESC"
        rows = self._rows(f"SELECT * FROM connections WHERE sandbox_id=? AND n>? ORDER BY n "
                          f"{order} LIMIT ?", (sandbox_id, after, limit))
        out = []
        for d in rows:
            d.update(json.loads(d.pop("extra") or "{}"))
            d.pop("sandbox_id", None)
            out.append({k: v for k, v in d.items() if v is not None})
        return out

    # ---- usage intervals ------------------------------------------------------------
    def usage_open(self, workspace_id: str, sandbox_id: str, kind: str, start: float, *,
                   vcpus: int | None = None, memory_mib: int | None = None,
                   snapshot_bytes: int | None = None, reason: str | None = None) -> None:
        self._run("INSERT INTO usage (workspace_id, sandbox_id, kind, start, vcpus, "
                  "memory_mib, snapshot_bytes, reason) VALUES (?,?,?,?,?,?,?,?)",
                  (workspace_id, sandbox_id, kind, start, vcpus, memory_mib, snapshot_bytes,
                   reason))

    def usage_close(self, sandbox_id: str, at: float) -> None:
        """Close the sandbox's open intervals at ``at`` (never before they started)."""
        self._run(f'UPDATE usage SET "end"={self._greatest("start", "?")} WHERE '
                  'sandbox_id=? AND "end" IS NULL', (at, sandbox_id))

    def usage_dangling(self) -> list[tuple[int, str, str | None, float | None, float | None]]:
        """Open intervals with their sandbox's state, ended_at and paused_at (None where
        the sandbox is gone): what a restarted daemon reconciles."""
        rows = self._rows('SELECT u.id, u.kind, s.state, s.ended_at, s.paused_at FROM usage u '
                          'LEFT JOIN sandboxes s ON s.id = u.sandbox_id WHERE u."end" IS NULL')
        return [(int(r["id"]), r["kind"], r["state"], r["ended_at"], r["paused_at"])
                for r in rows]

    def usage_close_interval(self, interval_id: int, at: float) -> None:
        self._run(f'UPDATE usage SET "end"={self._greatest("start", "?")} WHERE id=?',
                  (at, interval_id))

    def usage_intervals(self, workspace_id: str, since: float, until: float,
                        sandbox_id: str | None = None) -> list[UsageInterval]:
        """The workspace's intervals that overlap [since, until)."""
        sql = (f"SELECT {_USAGE_COLS} FROM usage WHERE workspace_id=? AND start < ? AND "
               '("end" IS NULL OR "end" > ?)')
        args: list[Any] = [workspace_id, until, since]
        if sandbox_id is not None:
            sql += " AND sandbox_id=?"
            args.append(sandbox_id)
        return [_interval(r) for r in self._rows(sql, args)]

    def usage_recent(self, workspace_id: str, ended_after: float, now: float
                     ) -> list[UsageInterval]:
        """The workspace's open intervals and those that ended after ``ended_after``, that
        started before ``now`` (through the index on their end: O(active))."""
        hint = self._indexed_by("usage_ws_end")
        return [_interval(r) for r in self._rows(
            f"SELECT {_USAGE_COLS} FROM usage {hint} WHERE workspace_id=? AND \"end\" IS NULL "
            f"AND start < ? UNION ALL SELECT {_USAGE_COLS} FROM usage {hint} WHERE "
            "workspace_id=? AND \"end\" > ? AND start < ?",
            (workspace_id, now, workspace_id, ended_after, now))]
