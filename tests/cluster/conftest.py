"""Fixtures of the cluster tests: real Postgres, S3 and kube-apiserver processes
(tests/support/testbed.py), one of each per session, started on first use and stopped by pid
at the end. A test that needs one that cannot start here is skipped saying why (and in CI,
where a skip fails, it fails)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import testbed
from support.testbed import open_test_store
from cpuosd.store import Store


@pytest.fixture(scope="session")
def pg_server() -> Iterator[testbed.PostgresServer]:
    why = testbed.postgres_unavailable()
    if why:
        pytest.skip(why)
    with testbed.postgres() as pg:
        yield pg


@pytest.fixture
def pg_url(pg_server: testbed.PostgresServer) -> Iterator[str]:
    """A new database of the session's Postgres, dropped after the test."""
    name = "t_" + secrets.token_hex(6)
    url = pg_server.create_database(name)
    yield url
    pg_server.drop_database(name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.cluster)])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a store of the kind under test lives: a Postgres URL, or a SQLite path."""
    if store_kind == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return str(tmp_path / "cpuos.db")


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_test_store(store_url)
    yield s
    s.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testbed.S3Server]:
    why = testbed.s3_unavailable()
    if why:
        pytest.skip(why)
    s3 = testbed.S3Server(tmp_path_factory.mktemp("s3"))
    try:
        s3.start()
        yield s3
    finally:
        s3.stop()
