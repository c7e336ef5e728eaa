"""Console sessions (cpuosd.console.sessions) and what the preview proxy keeps from a sandbox:
the parts that need no daemon (sessions in a real SQLite store). The cookie flow end to end:
tests/e2e/test_console_api.py; through the API tier: tests/cluster/test_cluster_console.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest

from cpuosd.console.sessions import (COOKIE, COOKIE_TLS, Sessions, cookie_token, csrf_ok,
                                     same_origin)
from cpuosd.network.preview import _drop_cookies
from cpuosd.store.sqlite import SqliteStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    st = SqliteStore(tmp_path / "cpuos.db")
    yield st
    st.close()


def test_a_session_is_found_by_its_token_only_until_it_expires_or_is_dropped(
        store: SqliteStore, tmp_path: Path) -> None:
    s = Sessions(store, ttl=60)
    wid = store.create_workspace("w")
    k1, k2 = store.add_key(wid, "one"), store.add_key(wid, "two")
    key1, key2 = store.key_lookup(k1), store.key_lookup(k2)
    assert key1 is not None and key2 is not None
    token, sess = s.create(key1[0], wid)
    got = s.get(token)
    assert got == sess and s.get(token + "x") is None and len(s) == 1
    # only its hash is kept, and the CSRF token (an HMAC of the token) not at all
    raw = (tmp_path / "cpuos.db").read_bytes()
    assert token.encode() not in raw and sess.csrf.encode() not in raw
    # another process over the same database (another API process, a restart) finds it
    other = SqliteStore(tmp_path / "cpuos.db")
    try:
        assert Sessions(other, ttl=60).get(token) == sess
        assert Sessions(other, ttl=60).drop(token) and s.get(token) is None
    finally:
        other.close()
    t1, _ = s.create(key1[0], wid)
    store._run("UPDATE console_sessions SET expires_at=?", (time.time() - 1,))
    assert s.get(t1) is None and len(s) == 0
    t2, _ = s.create(key1[0], wid)
    t3, _ = s.create(key2[0], wid)
    assert s.drop_key(key1[0]) == 1 and s.get(t2) is None and s.get(t3) is not None
    # a session of a key revoked since: gone with it
    assert store.revoke_key(wid, key2[0], keep_one=False) == "revoked"
    assert s.get(t3) is not None and s.get(t3, live_key=True) is None and s.get(t3) is None
    t4, _ = s.create(key1[0], wid)
    assert s.drop(t4) and not s.drop(t4)


def test_sessions_are_bounded_the_oldest_make_way(store: SqliteStore) -> None:
    s = Sessions(store, ttl=60, max_sessions=3)
    tokens = []
    for i in range(5):
        tokens.append(s.create(f"key-{i}", "ws")[0])
        time.sleep(0.002)  # (ordered by creation time)
    assert len(s) == 3
    assert s.get(tokens[0]) is None and s.get(tokens[1]) is None
    assert all(s.get(t) is not None for t in tokens[2:])


def test_cookie_and_csrf_and_origin_parsing() -> None:
    h = [(b"cookie", f"a=1; {COOKIE}=tok; b=2".encode())]
    assert cookie_token(h) == "tok"
    assert cookie_token([(b"cookie", f"{COOKIE_TLS}=t2".encode())]) == "t2"
    assert cookie_token([(b"cookie", b"cpuos_sessionx=no")]) is None
    _, sess = Sessions(MagicMock(), ttl=60).create("k", "w")
    assert csrf_ok(sess, [(b"x-cpuos-csrf", sess.csrf.encode())])
    assert not csrf_ok(sess, [(b"x-cpuos-csrf", b"wrong")]) and not csrf_ok(sess, [])

    def scope(origin: str | None, host: str) -> dict[str, Any]:
        hs = [(b"host", host.encode())]
        if origin is not None:
            hs.append((b"origin", origin.encode()))
        return {"headers": hs}

    assert same_origin(scope("http://127.0.0.1:7770", "127.0.0.1:7770"))
    assert same_origin(scope("https://Console.Example.com", "console.example.com"))
    assert not same_origin(scope("http://127.0.0.1:7771", "127.0.0.1:7770"))  # a preview
    assert not same_origin(scope("http://evil.test", "127.0.0.1:7770"))
    assert not same_origin(scope("null", "127.0.0.1:7770"))
    assert not same_origin(scope(None, "127.0.0.1:7770"))


def test_the_preview_proxy_never_passes_the_console_session_to_a_sandbox() -> None:
    # cookies ignore ports: a console on 127.0.0.1:7770 has its cookie sent to the preview
    # proxy on 127.0.0.1:7771 too, whose path form serves every sandbox
    raw = (f"app=1; {COOKIE}=secret; cpuos_token_3000=t; {COOKIE_TLS}=secret2; "
           "other=2").encode()
    assert _drop_cookies(raw) == b"app=1; other=2"
