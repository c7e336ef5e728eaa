"""The state store's schema: one list of migrations for SQLite and Postgres (append only).

A migration is written once, in the SQL both accept, with the types ``REAL``, ``INTEGER``
and ``TEXT`` and ``{id}`` for an auto-numbered primary key; ``render`` turns it into each
dialect's (Postgres: ``DOUBLE PRECISION`` and ``BIGINT``, as its ``REAL`` and ``INTEGER``
are 4 bytes: a time or a byte count would not fit). Column names that are keywords in one
of them are quoted (``"end"``). A migration that only one of them needs says so
(``only``): the audit chain lives in the state database only on Postgres (on SQLite it has
a database of its own, cpuosd.accounting.audit).

SQLite counts the migrations applied in ``PRAGMA user_version``; Postgres in the one row of
``cpuos_schema``, under an advisory lock, so that API processes starting together apply each
migration once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GENESIS = "0" * 64  # (the audit chain's: cpuosd.accounting.audit.GENESIS)


@dataclass(frozen=True)
class Migration:
    sql: str
    only: str | None = None  # "sqlite" | "postgres": the other one skips it (counted)


MIGRATIONS: list[Migration] = [
    Migration("""
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
    """),
    Migration("""
    ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill';
    ALTER TABLE sandboxes ADD COLUMN paused_at REAL;
    ALTER TABLE sandboxes ADD COLUMN remaining REAL;
    ALTER TABLE sandboxes ADD COLUMN snapshot_bytes INTEGER;
    """),
    Migration("""
    ALTER TABLE workspaces ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
    """),
    Migration("""
    CREATE TABLE connections (
        n {id}, sandbox_id TEXT NOT NULL, time REAL NOT NULL,
        proto TEXT NOT NULL, dst TEXT, port INTEGER, name TEXT, verdict TEXT NOT NULL,
        rule TEXT, bytes_out INTEGER, bytes_in INTEGER, extra TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX connections_sbx ON connections(sandbox_id, n);
    """),
    Migration("""
    ALTER TABLE workspaces ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';
    """),
    Migration("""
    CREATE TABLE usage (
        id {id}, workspace_id TEXT NOT NULL,
        sandbox_id TEXT NOT NULL, kind TEXT NOT NULL, start REAL NOT NULL, "end" REAL,
        vcpus INTEGER, memory_mib INTEGER, snapshot_bytes INTEGER
    );
    CREATE INDEX usage_ws ON usage(workspace_id, start);
    CREATE INDEX usage_open ON usage(sandbox_id, "end");
    """),
    Migration("""
    ALTER TABLE api_keys ADD COLUMN revoked_at REAL;
    ALTER TABLE workspaces ADD COLUMN deleted_at REAL;
    """),
    Migration("""
    ALTER TABLE usage ADD COLUMN reason TEXT;
    CREATE INDEX sandboxes_state ON sandboxes(state, deadline);
    CREATE INDEX usage_ws_end ON usage(workspace_id, "end");
    """),
    # many hosts (issue 24): the node holding a sandbox, and the epoch its state changes
    # are compared against
    Migration("""
    ALTER TABLE sandboxes ADD COLUMN node_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX sandboxes_node ON sandboxes(node_id, state);
    """),
    # the audit chain shared by every node (cpuosd.store.audit_chain): rows as in
    # cpuosd.accounting.audit, the chain's head (the row appenders lock) and its anchor
    Migration(f"""
    CREATE TABLE audit (
        seq INTEGER PRIMARY KEY, time REAL NOT NULL, workspace TEXT NOT NULL,
        sandbox TEXT NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL,
        prev_hash TEXT NOT NULL, hash TEXT NOT NULL
    );
    CREATE INDEX audit_sbx ON audit(sandbox, seq);
    CREATE INDEX audit_time ON audit(time);
    CREATE TABLE audit_head (
        id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, hash TEXT NOT NULL
    );
    INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, '{GENESIS}');
    CREATE TABLE audit_anchor (
        id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, hash TEXT NOT NULL,
        mac TEXT NOT NULL
    );
    """, only="postgres"),
    # nodes registered in the store (membership without Kubernetes: cpuosd.cluster.nodes)
    Migration("""
    CREATE TABLE nodes (
        id TEXT PRIMARY KEY, address TEXT NOT NULL, incarnation TEXT NOT NULL,
        facts TEXT NOT NULL, started_at REAL NOT NULL, heartbeat_at REAL NOT NULL,
        cordoned INTEGER NOT NULL DEFAULT 0
    );
    """),
    # named leases of cluster-wide chores (Store.take_lease: the snapshot store's sweep)
    Migration("""
    CREATE TABLE leases (
        name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_at REAL NOT NULL
    );
    """),
    # sandboxes' secret values and CA keys shared by the nodes, sealed
    # under the cluster's secrets key (cpuosd.network.secrets.SealedBackend; one host keeps
    # files instead): a row's placeholder or CA id, the id of the key that sealed it, and
    # base64 of nonce + AES-GCM ciphertext
    Migration("""
    CREATE TABLE secrets (
        name TEXT PRIMARY KEY, key_id TEXT NOT NULL, data TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    """),
    # the web console's sessions (cpuosd.console.sessions): only the SHA-256 of a session's
    # token, the key it was made with and that key's workspace, and its expiry; shared by
    # every API process and node of many hosts, kept across a restart
    Migration("""
    CREATE TABLE console_sessions (
        token_hash TEXT PRIMARY KEY, key_id TEXT NOT NULL, workspace_id TEXT NOT NULL,
        created_at REAL NOT NULL, expires_at REAL NOT NULL
    );
    CREATE INDEX console_sessions_key ON console_sessions(key_id);
    CREATE INDEX console_sessions_expiry ON console_sessions(expires_at);
    """),
]

_PG_TYPES = {"REAL": "DOUBLE PRECISION", "INTEGER": "BIGINT"}


def render(m: Migration, dialect: str) -> str | None:
    """The migration's SQL in ``dialect``; None where it does not apply."""
    if m.only is not None and m.only != dialect:
        return None
    if dialect == "sqlite":
        return m.sql.replace("{id}", "INTEGER PRIMARY KEY AUTOINCREMENT")
    if dialect == "postgres":
        sql = re.sub(r"\b(REAL|INTEGER)\b", lambda x: _PG_TYPES[x.group(1)], m.sql)
        return sql.replace("{id}", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
    raise ValueError(f"unknown SQL dialect {dialect!r}")
