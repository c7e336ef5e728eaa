"""Console sessions (cpuosd.console.sessions) and what the preview proxy keeps from a sandbox:
the parts that need no daemon. The cookie flow end to end: tests/e2e/test_console_api.py."""

from __future__ import annotations

import time
from typing import Any

from cpuosd.console.sessions import (COOKIE, COOKIE_TLS, Sessions, cookie_token, csrf_ok,
                                     same_origin)
from cpuosd.network.preview import _drop_cookies


def test_a_session_is_found_by_its_token_only_until_it_expires_or_is_dropped() -> None:
    s = Sessions(ttl=60)
    token, sess = s.create("key-1", "ws-1")
    assert s.get(token) is sess and s.get(token + "x") is None and len(s) == 1
    assert token not in repr(s._by_hash)  # only its hash is kept
    sess.expires = time.time() - 1
    assert s.get(token) is None and len(s) == 0
    t2, _ = s.create("key-1", "ws-1")
    t3, _ = s.create("key-2", "ws-1")
    assert s.drop_key("key-1") == 1 and s.get(t2) is None and s.get(t3) is not None
    assert s.drop(t3) and not s.drop(t3)


def test_sessions_are_bounded_the_oldest_make_way() -> None:
    s = Sessions(ttl=60, max_sessions=3)
    tokens = [s.create(f"key-{i}", "ws")[0] for i in range(5)]
    assert len(s) == 3
    assert s.get(tokens[0]) is None and s.get(tokens[1]) is None
    assert all(s.get(t) is not None for t in tokens[2:])


def test_cookie_and_csrf_and_origin_parsing() -> None:
    h = [(b"cookie", f"a=1; {COOKIE}=tok; b=2".encode())]
    assert cookie_token(h) == "tok"
    assert cookie_token([(b"cookie", f"{COOKIE_TLS}=t2".encode())]) == "t2"
    assert cookie_token([(b"cookie", b"cpuos_sessionx=no")]) is None
    s = Sessions(ttl=60)
    _, sess = s.create("k", "w")
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
