"""The daemon's state store: one interface (``Store``), two databases.

- SQLite (default; one host): ``$CPUOS_HOME/cpuos.db`` (cpuosd.store.sqlite).
- Postgres (many hosts): ``CPUOS_DATABASE_URL=postgresql://user@host/db``
  (cpuosd.store.postgres; the ``cluster`` extra installs psycopg).

Both run the same queries (cpuosd.store.sql) and the same migrations
(cpuosd.store.migrations). ``open_store`` picks one.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import (ACTIVE_STATES, LIVE_STATES, MAX_CONNECTIONS, SandboxRow, Store,
                   UsageInterval, hash_key, new_key)
from .sqlite import SqliteStore

__all__ = ["ACTIVE_STATES", "LIVE_STATES", "MAX_CONNECTIONS", "SandboxRow", "SqliteStore",
           "Store", "UsageInterval", "database_url", "hash_key", "new_key", "open_store"]


def database_url() -> str | None:
    """``CPUOS_DATABASE_URL`` when it names Postgres; None: SQLite. Anything else is
    refused (a typo must not quietly give each host a database of its own)."""
    url = (os.environ.get("CPUOS_DATABASE_URL") or "").strip()
    if not url:
        return None
    if not url.startswith(("postgresql://", "postgres://")):
        raise ValueError("CPUOS_DATABASE_URL must be a postgresql:// URL (unset: SQLite "
                         f"in $CPUOS_HOME), not {url.split(':', 1)[0]!r}")
    return url


def open_store(sqlite_path: Path, url: str | None = None) -> Store:
    """Postgres at ``url`` (default: ``CPUOS_DATABASE_URL``), else SQLite at
    ``sqlite_path``."""
    url = url if url is not None else database_url()
    if url:
        from .postgres import PostgresStore

        return PostgresStore(url)
    return SqliteStore(sqlite_path)
