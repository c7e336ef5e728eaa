"""The state store in Postgres (many hosts: ``CPUOS_DATABASE_URL=postgresql://...``).

psycopg 3, synchronous, through a small pool (``CPUOS_DATABASE_POOL`` connections, default
8): the store's callers are the event loop's plain functions (as with SQLite), and each
call is one short statement or transaction, a loopback or LAN round trip. Every statement
is bounded (``statement_timeout``, ``lock_timeout``; a connection is waited for at most
``POOL_TIMEOUT`` s): an unreachable database fails a request with an error, it never hangs
it. Migrations run under an advisory lock, so API processes starting together apply each
once.

``serialized(scope)`` (admission per workspace, the first start's bootstrap): one
transaction on one connection of the pool holding ``pg_advisory_xact_lock(SERIAL_LOCK_CLASS,
hashtext(scope))``; the store's calls made by the same thread inside the block run in it
(``_Held``), and the lock goes with its commit (or rollback, or the connection's end).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from ..errors import ApiError
from .migrations import MIGRATIONS, render
from .sql import Conn, SqlStore

DEFAULT_POOL = 8  # connections per process (CPUOS_DATABASE_POOL)
POOL_TIMEOUT = 10.0  # s a call waits for a connection of the pool
STATEMENT_TIMEOUT_MS = 15_000
LOCK_TIMEOUT_MS = 10_000
MIGRATION_LOCK = 0x63_70_75_6F_73  # pg_advisory_xact_lock key ("cpuos")
# serialized(scope): pg_advisory_xact_lock(SERIAL_LOCK_CLASS, hashtext(scope)) (two int4
# keys: a space of its own beside MIGRATION_LOCK's one bigint)
SERIAL_LOCK_CLASS = 0x63_70_75_73  # "cpus"
SERIAL_LOCK_TIMEOUT_MS = 5_000  # ms a serialized block waits for its lock, then 503


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


@dataclass
class _Held:
    """The connection of a ``serialized`` block, for the calls of its store on its thread
    while it runs (``active``: a task or thread that copied the context inside the block
    and runs after it uses the pool again)."""

    store: PostgresStore
    conn: _PgConn
    thread: int
    active: bool = True


_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("cpuos_store_held",
                                                                     default=None)


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

    def _held(self) -> _PgConn | None:
        h = _HELD.get()
        if h is not None and h.active and h.store is self and h.thread == threading.get_ident():
            return h.conn
        return None

    @contextlib.contextmanager
    def _conn(self) -> Iterator[Conn]:
        held = self._held()
        if held is not None:
            yield held
            return
        with self.pool.connection() as c:
            yield _PgConn(c)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Conn]:
        held = self._held()
        if held is not None:  # (a savepoint in the serialized block's transaction)
            with held.conn.transaction():
                yield held
            return
        with self.pool.connection() as c, c.transaction():
            yield _PgConn(c)

    serial_lock_timeout_ms = SERIAL_LOCK_TIMEOUT_MS

    @contextlib.contextmanager
    def serialized(self, scope: str) -> Iterator[None]:
        if self._held() is not None:
            raise RuntimeError(f"serialized({scope!r}) inside another serialized block")
        with self.pool.connection() as c, c.transaction():
            c.execute(f"SET LOCAL lock_timeout = {int(self.serial_lock_timeout_ms)}")
            try:
                c.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                          (SERIAL_LOCK_CLASS, scope))
            except psycopg.errors.LockNotAvailable:
                raise ApiError(
                    "unavailable", f"the store's lock {scope!r} is held by another process "
                    f"past {self.serial_lock_timeout_ms / 1000:g} s; try again",
                    {"lock": scope}) from None
            c.execute(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")
            held = _Held(self, _PgConn(c), threading.get_ident())
            token = _HELD.set(held)
            try:
                yield
            finally:
                held.active = False
                _HELD.reset(token)

    def _json_int(self, col: str, key: str) -> str:
        return f"(({col})::jsonb->>'{key}')::numeric"

    def _greatest(self, a: str, b: str) -> str:
        return f"GREATEST({a}, {b})"

    def _for_update(self) -> str:
        return " FOR UPDATE"
