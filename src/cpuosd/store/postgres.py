"""The state store in Postgres (many hosts: ``CPUOS_DATABASE_URL=postgresql://...``).

psycopg 3, synchronous, through a small pool (``CPUOS_DATABASE_POOL`` connections, default
8): the store's callers are the event loop's plain functions (as with SQLite), and each
call is one short statement or transaction, a loopback or LAN round trip. Every statement
is bounded (``statement_timeout``, ``lock_timeout``; a connection is waited for at most
``POOL_TIMEOUT`` s): an unreachable database fails a request with an error, it never hangs
it. Migrations run under an advisory lock, so API processes starting together apply each
once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from .migrations import MIGRATIONS, render
from .sql import Conn, SqlStore

DEFAULT_POOL = 8  # connections per process (CPUOS_DATABASE_POOL)
POOL_TIMEOUT = 10.0  # s a call waits for a connection of the pool
STATEMENT_TIMEOUT_MS = 15_000
LOCK_TIMEOUT_MS = 10_000
MIGRATION_LOCK = 0x63_70_75_6F_73  # pg_advisory_xact_lock key ("cpuos")


@functools.lru_cache(maxsize=1024)
def _pg(sql: str) -> str:
    """``?`` placeholders as psycopg's (a literal ``%`` doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


def _args(args: Sequence[Any]) -> list[Any]:
    # (the schema's flags are integers, as in SQLite)
    return [int(a) if isinstance(a, bool) else a for a in args]


class _PgConn:
    def __init__(self, conn: psycopg.Connection[dict[str, Any]]) -> None:
        self.conn = conn

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        cur = self.conn.execute(_pg(sql), _args(args))
        return cur.fetchall() if cur.description is not None else []

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self.conn.execute(_pg(sql), _args(args)).rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.conn.cursor() as cur:
            cur.executemany(_pg(sql), [_args(r) for r in rows])


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
    conn.execute(f"SET lock_timeout = {LOCK_TIMEOUT_MS}")
    conn.execute("SET idle_in_transaction_session_timeout = 60000")


def connect_pool(url: str, max_size: int | None = None) -> ConnectionPool[Any]:
    """A pool of autocommit connections returning rows as dicts; waits (bounded) for the
    first one, so that a wrong URL or a database that is down fails the start."""
    size = max_size or DEFAULT_POOL
    pool: ConnectionPool[Any] = ConnectionPool(
        url, min_size=1, max_size=max(1, size), open=False, timeout=POOL_TIMEOUT,
        configure=_configure, name="cpuos-store",
        kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": 10})
    pool.open(wait=True, timeout=30)
    return pool


class PostgresStore(SqlStore):
    dialect = "postgres"

    def __init__(self, url: str, max_size: int | None = None) -> None:
        self.url = url
        self.pool = connect_pool(url, max_size)
        try:
            self._migrate()
        except BaseException:
            self.pool.close()
            raise

    def close(self) -> None:
        self.pool.close()

    def _migrate(self) -> None:
        with self.pool.connection() as c, c.transaction():
            c.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            c.execute("CREATE TABLE IF NOT EXISTS cpuos_schema (id INTEGER PRIMARY KEY "
                      "CHECK (id = 1), version INTEGER NOT NULL)")
            c.execute("INSERT INTO cpuos_schema (id, version) VALUES (1, 0) ON CONFLICT "
                      "(id) DO NOTHING")
            row = c.execute("SELECT version FROM cpuos_schema WHERE id = 1").fetchone()
            v = int(row["version"]) if row else 0
            for i, m in enumerate(MIGRATIONS[v:], start=v + 1):
                sql = render(m, self.dialect)
                if sql:
                    c.execute(sql.encode())  # (bytes: run as is, no placeholders)
                c.execute("UPDATE cpuos_schema SET version = %s WHERE id = 1", (i,))

    def schema_version(self) -> int:
        r = self._one("SELECT version FROM cpuos_schema WHERE id = 1")
        return int(r["version"]) if r else 0

    @contextlib.contextmanager
    def _conn(self) -> Iterator[Conn]:
        with self.pool.connection() as c:
            yield _PgConn(c)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Conn]:
        with self.pool.connection() as c, c.transaction():
            yield _PgConn(c)

    def _json_int(self, col: str, key: str) -> str:
        return f"(({col})::jsonb->>'{key}')::numeric"

    def _greatest(self, a: str, b: str) -> str:
        return f"GREATEST({a}, {b})"

    def _for_update(self) -> str:
        return " FOR UPDATE"
