"""Secrets sealed for the shared database (cpuosd.network.secrets: Sealer, SealedBackend,
load_keys): AES-256-GCM under the cluster's secrets key, the row's name as associated data.
A wrong key, a tampered row or a row moved to another name is refused with a clear error
(naming the row and the key id, never the value); without a key a node refuses to keep
secrets; the key file's format; the wiring's choice of store."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import pytest

from cpuosd.config import Config
from cpuosd.errors import ApiError
from cpuosd.network.secrets import (FileBackend, SealedBackend, Sealer, SecretKeyError,
                                    SecretStore, key_id, load_keys)
from cpuosd.store import SqliteStore
from cpuosd.wiring import secret_store

K1, K2 = bytes(range(32)), bytes(range(1, 33))
VALUE = "sk-live-" + "9" * 30
NAME = "cpuos-secret-" + "a" * 24


class Rows:
    """The store's secrets table, in memory (SealedRows)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str]] = {}

    def put_secret(self, name: str, key_id: str, data: str) -> None:
        self.rows[name] = (key_id, data)

    def get_secret(self, name: str) -> tuple[str, str] | None:
        return self.rows.get(name)

    def delete_secrets(self, names: list[str]) -> None:
        for n in names:
            self.rows.pop(n, None)

    def secret_names(self, *, not_key: str | None = None) -> list[str]:
        return sorted(n for n, (k, _) in self.rows.items() if k != not_key)


def test_round_trip_and_no_plaintext() -> None:
    s = Sealer([K1])
    kid, data = s.seal(NAME, VALUE.encode())
    assert kid == key_id(K1) and len(kid) == 16 and K1.hex()[:16] not in kid
    assert VALUE not in data and VALUE.encode() not in base64.b64decode(data)
    assert s.open(NAME, kid, data) == VALUE.encode()
    assert s.seal(NAME, VALUE.encode())[1] != data  # (a fresh nonce each time)


def test_a_wrong_key_fails_clearly() -> None:
    kid, data = Sealer([K1]).seal(NAME, VALUE.encode())
    with pytest.raises(SecretKeyError) as e:
        Sealer([K2]).open(NAME, kid, data)
    assert f"sealed under key {kid}, which this node does not hold" in str(e.value)
    assert NAME in str(e.value) and VALUE not in str(e.value)
    # another key that claims the same id (a key file replaced, not rotated): the tag fails
    with pytest.raises(SecretKeyError, match="does not open under key"):
        Sealer([K2]).open(NAME, key_id(K2), data)


def test_tampered_or_moved_ciphertext_is_refused() -> None:
    s = Sealer([K1])
    kid, data = s.seal(NAME, VALUE.encode())
    raw = bytearray(base64.b64decode(data))
    for i in (0, 12, len(raw) // 2, len(raw) - 1):  # nonce, ciphertext, tag
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(SecretKeyError, match="altered"):
            s.open(NAME, kid, base64.b64encode(bytes(bad)).decode())
    for junk in ("", "not base64!", base64.b64encode(b"short").decode()):
        with pytest.raises(SecretKeyError, match="altered"):
            s.open(NAME, kid, junk)
    # the same row under another name (e.g. another sandbox's placeholder): refused
    with pytest.raises(SecretKeyError, match="altered"):
        s.open("cpuos-secret-" + "b" * 24, kid, data)


def test_rotation_seals_with_the_first_opens_with_any() -> None:
    rows = Rows()
    old = SealedBackend(rows, Sealer([K1]))
    old.write(NAME, {"value": VALUE})
    new = SealedBackend(rows, Sealer([K2, K1]))
    assert new.read(NAME) == {"value": VALUE}  # (before the rewrap: the old key opens it)
    assert new.rewrap() == 1 and rows.rows[NAME][0] == key_id(K2)
    assert new.rewrap() == 0
    assert new.read(NAME) == {"value": VALUE}


def test_a_tampered_row_reads_as_missing_and_is_logged(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    rows = Rows()
    b = SealedBackend(rows, Sealer([K1]))
    b.write(NAME, {"value": VALUE})
    kid, data = rows.rows[NAME]
    rows.rows[NAME] = (kid, data[:-4] + ("AAAA" if not data.endswith("AAAA") else "BBBB"))
    with caplog.at_level(logging.ERROR):
        assert b.read(NAME) is None
    assert "altered" in caplog.text and VALUE not in caplog.text


def test_no_key_refuses_secrets(tmp_path: Path) -> None:
    rows = Rows()
    store = SecretStore(tmp_path / "secrets", SealedBackend(rows, None))
    with pytest.raises(ApiError) as e:
        store.add({"API_KEY": {"value": VALUE, "hosts": ["api.test"]}})
    assert e.value.code == "unavailable" and "CPUOS_SECRETS_KEY_FILE" in e.value.message
    assert rows.rows == {} and not list((tmp_path / "secrets").iterdir())


def test_a_sealed_store_keeps_nothing_on_disk(tmp_path: Path) -> None:
    rows = Rows()
    store = SecretStore(tmp_path / "secrets", SealedBackend(rows, Sealer([K1])))
    env, view, ca = store.add({"API_KEY": {"value": VALUE, "hosts": ["api.test"]}})
    token = view["API_KEY"]["placeholder"]
    assert env["API_KEY"] == token and store.value(token) == VALUE
    assert set(rows.rows) == {token, ca}
    assert VALUE not in json.dumps(rows.rows) and "PRIVATE KEY" not in json.dumps(rows.rows)
    assert store.ca_cert_pem(ca) and store.server_context(ca, "api.test") is not None
    assert not list((tmp_path / "secrets").iterdir())  # (leaf files: a temporary dir)
    # another node's store over the same rows, with the same key: the same value and CA
    other = SecretStore(tmp_path / "other", SealedBackend(rows, Sealer([K1])))
    assert other.value(token) == VALUE and other.ca_cert_pem(ca) == store.ca_cert_pem(ca)
    store.forget([token, ca])
    assert rows.rows == {} and other.value(token) is None
    # a refusal half-way (the second entry) leaves nothing behind
    with pytest.raises(ApiError):
        store.add({"A": {"value": VALUE, "hosts": ["api.test"]}, "B": {"value": ""}})
    assert rows.rows == {}


def test_key_file(tmp_path: Path) -> None:
    f = tmp_path / "secrets.key"
    f.write_text(f"# rotated 2026-12\n{K2.hex()}\n\n{K1.hex().upper()}  # the old one\n")
    assert load_keys(f) == [K2, K1]
    for text, why in (("", "holds no key"), ("abcd\n", "line 1: not a key"),
                      (K1.hex() + "zz\n", "line 1: not a key")):
        f.write_text(text)
        with pytest.raises(SecretKeyError, match=why):
            load_keys(f)
    with pytest.raises(SecretKeyError, match="cannot be read"):
        load_keys(tmp_path / "missing.key")


def test_wiring_chooses_files_on_sqlite(tmp_path: Path) -> None:
    """One host (SQLite) keeps the files, with or without a key file."""
    (tmp_path / "k").write_text(K1.hex())
    cfg = Config.from_env({"CPUOS_HOME": str(tmp_path),
                           "CPUOS_SECRETS_KEY_FILE": str(tmp_path / "k")})
    db = SqliteStore(tmp_path / "cpuos.db")
    try:
        assert isinstance(secret_store(cfg, db).backend, FileBackend)
    finally:
        db.close()


def test_wiring_on_postgres(tmp_path: Path) -> None:
    """With Postgres: sealed rows; no key file: the store refuses secrets; a bad one: the
    start fails. (A SQLite store posing as Postgres: the queries are the same.)"""
    db = SqliteStore(tmp_path / "cpuos.db")
    db.dialect = "postgres"
    try:
        cfg = Config.from_env({"CPUOS_HOME": str(tmp_path)})
        b = secret_store(cfg, db).backend
        assert isinstance(b, SealedBackend) and b.sealer is None
        (tmp_path / "k").write_text("nonsense\n")
        cfg = Config.from_env({"CPUOS_HOME": str(tmp_path),
                               "CPUOS_SECRETS_KEY_FILE": str(tmp_path / "k")})
        with pytest.raises(SecretKeyError, match="not a key"):
            secret_store(cfg, db)
        (tmp_path / "k").write_text(K1.hex())
        b = secret_store(cfg, db).backend
        assert isinstance(b, SealedBackend) and b.sealer is not None
        assert b.sealer.current == key_id(K1)
    finally:
        db.close()
