"""The state store in SQLite (one host: ``--role=all``, the default).

One connection, WAL mode, used from the event loop thread (every statement is small) and,
under its lock, from the threads that need it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .. import homedir
from .migrations import MIGRATIONS, render
from .sql import Conn, SqlStore


class _SqliteConn:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.execute(sql, tuple(args)).fetchall()]

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self.db.execute(sql, tuple(args)).rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.db.executemany(sql, [tuple(r) for r in rows])


class SqliteStore(SqlStore):
    dialect = "sqlite"

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        homedir.create_private(path)  # 0600 before SQLite: its -wal/-shm get the same
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                   timeout=10)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._serial = False  # in a serialized block (its thread holds _lock)
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
            for i, m in enumerate(MIGRATIONS[v:], start=v + 1):
                sql = render(m, self.dialect) or ""
                self._db.executescript(f"BEGIN; {sql}; PRAGMA user_version={i}; COMMIT;")

    @contextlib.contextmanager
    def _conn(self) -> Iterator[Conn]:
        with self._lock:
            yield _SqliteConn(self._db)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Conn]:
        with self._lock:
            if self._serial:  # (inside serialized: a savepoint of its transaction)
                self._db.execute("SAVEPOINT tx")
                try:
                    yield _SqliteConn(self._db)
                except BaseException:
                    self._db.execute("ROLLBACK TO tx")
                    self._db.execute("RELEASE tx")
                    raise
                self._db.execute("RELEASE tx")
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteConn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextlib.contextmanager
    def serialized(self, scope: str) -> Iterator[None]:
        """(One host: one write transaction, the connection's lock held throughout, so
        other threads' calls wait for its end.)"""
        with self._lock:
            if self._serial:
                raise RuntimeError(f"serialized({scope!r}) inside another serialized block")
            with self._tx():
                self._serial = True
                try:
                    yield
                finally:
                    self._serial = False

    def _json_int(self, col: str, key: str) -> str:
        return f"json_extract({col}, '$.{key}')"

    def _greatest(self, a: str, b: str) -> str:
        return f"MAX({a}, {b})"

    def _indexed_by(self, index: str) -> str:
        return f"INDEXED BY {index}"

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """One statement of SQLite's own (tests set up rows with it); not part of Store."""
        with self._lock:
            return self._db.execute(sql, args)
