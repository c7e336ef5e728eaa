"""CPUOS_ADMIN_KEY (the Kubernetes Secret's admin-key): the first start on an empty database
puts that key in as the admin workspace's; nodes starting later add none; a key revoked
since is not brought back; a value too short to be a key stops the daemon; masked."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from cpuosd.config import Config, ConfigError, effective
from cpuosd.store import SqliteStore
from cpuosd.wiring import bootstrap, build_api_services

KEY = "cpk_" + "ab" * 32


def _cfg(home: Path, **env: str) -> Config:
    home.mkdir(parents=True, exist_ok=True)
    return Config.from_env({"CPUOS_HOME": str(home), **env})


def test_the_given_key_goes_into_an_empty_database_once(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    store = SqliteStore(tmp_path / "cpuos.db")
    try:
        a = _cfg(tmp_path / "node-a", CPUOS_ADMIN_KEY=KEY)
        bootstrap(a, store)
        wid = store.workspace_by_name("default")
        assert wid is not None and store.key_lookup(KEY) is not None
        assert store.key_lookup(KEY)[1] == wid  # type: ignore[index]
        assert [k["label"] for k in store.list_keys(wid)] == ["admin"]
        assert not a.admin_key_path.exists()  # (the Secret is where it is kept)
        # a second node, and the first one restarted: no other key
        bootstrap(_cfg(tmp_path / "node-b", CPUOS_ADMIN_KEY=KEY), store)
        bootstrap(a, store)
        assert len(store.list_keys(wid)) == 1
        # revoked (another key made first): a restart does not bring it back
        other = store.add_key(wid, "ops")
        kid = store.key_lookup(KEY)[0]  # type: ignore[index]
        assert store.revoke_key(wid, kid, keep_one=True) == "revoked"
        with caplog.at_level(logging.WARNING, "cpuosd.api"):
            bootstrap(a, store)
        assert store.key_lookup(KEY) is None and store.key_lookup(other) is not None
        assert "CPUOS_ADMIN_KEY is not a live key" in caplog.text
        assert len(store.list_keys(wid)) == 2
    finally:
        store.close()


def test_a_database_with_an_admin_key_gets_no_other(tmp_path: Path) -> None:
    """Set up without CPUOS_ADMIN_KEY (a key made, in admin.key); a node started later with
    the variable adds nothing; without it, a node with no admin.key makes its own as
    before."""
    store = SqliteStore(tmp_path / "cpuos.db")
    try:
        first = _cfg(tmp_path / "first")
        bootstrap(first, store)
        made = first.admin_key_path.read_text().strip()
        wid = store.workspace_by_name("default")
        assert wid is not None and store.key_lookup(made) is not None
        bootstrap(_cfg(tmp_path / "later", CPUOS_ADMIN_KEY=KEY), store)
        assert store.key_lookup(KEY) is None and len(store.list_keys(wid)) == 1
    finally:
        store.close()


def test_an_api_process_puts_the_key_in_too(tmp_path: Path) -> None:
    """An API process that starts before any node: the admin key works at once."""
    store = SqliteStore(tmp_path / "cpuos.db")
    cfg = _cfg(tmp_path / "api", CPUOS_ROLE="api", CPUOS_ADMIN_KEY=KEY,
               CPUOS_NODE_TOKEN="t" * 32)

    async def main() -> None:
        svc = await build_api_services(cfg, store=store)
        await svc.close()

    try:
        asyncio.run(main())
        assert store.key_lookup(KEY) is not None
    finally:
        store.close()


@pytest.mark.parametrize("value", ["CHANGE-ME", "short", "x" * 31, "a key with spaces " * 3])
def test_a_value_that_is_no_key_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="CPUOS_ADMIN_KEY"):
        Config.from_env({"CPUOS_ADMIN_KEY": value})


def test_the_key_is_masked() -> None:
    rows = {n: v for n, v, _ in effective(Config.from_env({"CPUOS_ADMIN_KEY": KEY}))}
    assert rows["CPUOS_ADMIN_KEY"] == "****"
