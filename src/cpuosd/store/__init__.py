"""The daemon's state store: one interface (``Store``), two databases.

- SQLite (default; one host): ``$CPUOS_HOME/cpuos.db`` (cpuosd.store.sqlite).
- Postgres (many hosts): ``CPUOS_DATABASE_URL=postgresql://user@host/db``
  (``Config.cluster.database_url``; cpuosd.store.postgres; the ``cluster`` extra installs
  psycopg).

Both run the same queries (cpuosd.store.sql) and the same migrations
(cpuosd.store.migrations). ``open_store`` picks one.
"""

from __future__ import annotations

from pathlib import Path

from .base import (ACTIVE_STATES, LIVE_STATES, MAX_CONNECTIONS, RowSpec, SandboxRow, Store,
                   UsageInterval, hash_key, new_key)
from .sqlite import SqliteStore

__all__ = ["ACTIVE_STATES", "LIVE_STATES", "MAX_CONNECTIONS", "RowSpec", "SandboxRow",
           "SqliteStore", "Store", "UsageInterval", "hash_key", "new_key", "open_store"]


def open_store(sqlite_path: Path, url: str | None = None, pool_size: int | None = None
               ) -> Store:
    """Postgres at ``url`` (``Config.cluster.database_url``; ``pool_size`` connections at
    most), else SQLite at ``sqlite_path``."""
    if url:
        from .postgres import PostgresStore

        return PostgresStore(url, pool_size)
    return SqliteStore(sqlite_path)
