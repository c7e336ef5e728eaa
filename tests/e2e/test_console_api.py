"""The web console's sign-in and what a session may do, over real HTTP against a real daemon
(no sandbox needed): the key exchanged for a cookie (HttpOnly, SameSite=Strict, Secure and
``__Host-`` over TLS), never accepted in a URL; the cookie authenticates the public API's
routes, a request that changes something needs the CSRF header, a WebSocket needs the
daemon's own origin; sign out and key revocation end the session; the admin acts in another
workspace (header or query) and no one else may; ``/events`` and ``/usage?by=day``; the
page's Content-Security-Policy. The console in a browser: tests/e2e/test_console_ui.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets

from support.daemon import Daemon, e2e_unavailable, new_daemon

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def d() -> Iterator[Daemon]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    dm = new_daemon(CPUOS_POOL_SIZE="0")
    dm.start()
    yield dm
    assert not dm.teardown(False)


def sign_in(d: Daemon, key: str, **headers: str) -> httpx.Response:
    return httpx.post(d.url + "/ui/session", json={"key": key},
                      headers={"Origin": d.url, **headers}, timeout=30)


def session(d: Daemon, key: str | None = None) -> tuple[httpx.Client, str]:
    """A client holding a console session of ``key`` (the admin's): (client, csrf)."""
    r = sign_in(d, key or d.key)
    assert r.status_code == 200, r.text
    c = httpx.Client(base_url=d.url, timeout=30)
    c.cookies.set("cpuos_session", r.cookies["cpuos_session"])
    return c, r.json()["csrf"]


def workspace(d: Daemon, name: str) -> tuple[str, str]:
    with d.client() as c:
        r = c.post("/workspaces", json={"name": name})
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["key"]


def test_sign_in_gives_a_strict_http_only_cookie_and_says_when_a_key_is_bad(d: Daemon) -> None:
    bad = sign_in(d, "cpk_not-a-key")
    assert bad.status_code == 401 and "not valid" in bad.json()["error"]["message"]
    assert "set-cookie" not in bad.headers
    r = sign_in(d, d.key)
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("cpuos_session=") and "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "Path=/" in cookie and "Secure" not in cookie  # plain HTTP here
    who = r.json()
    assert who["admin"] is True and who["workspace"]["name"] == "default" and who["csrf"]
    assert d.key not in r.text and "key" not in r.cookies["cpuos_session"]
    # behind a TLS front proxy (X-Forwarded-Proto from loopback, trusted by uvicorn)
    tls = sign_in(d, d.key, **{"X-Forwarded-Proto": "https"})
    assert tls.status_code == 200
    assert tls.headers["set-cookie"].startswith("__Host-cpuos_session=")
    assert "Secure" in tls.headers["set-cookie"]


def test_sign_in_only_from_the_console_page_and_only_as_json(d: Daemon) -> None:
    # another site's form posting a key (login CSRF), or a form body at all
    assert sign_in(d, d.key, Origin="http://evil.test").status_code == 403
    r = httpx.post(d.url + "/ui/session", data={"key": d.key}, timeout=30)
    assert r.status_code == 422
    # the key is never taken from a URL: not by the sign-in, not by the API
    r = httpx.post(d.url + f"/ui/session?key={d.key}", json={}, timeout=30)
    assert r.status_code == 422
    assert httpx.get(d.url + f"/sandboxes?key={d.key}", timeout=30).status_code == 401


def test_the_cookie_authenticates_the_api_and_changes_need_the_csrf_header(d: Daemon) -> None:
    c, csrf = session(d)
    with c:
        assert c.get("/sandboxes").status_code == 200
        assert c.get("/ui/session").json()["csrf"] == csrf
        body = {"name": "csrf-probe"}
        r = c.post("/workspaces", json=body)  # no header: a cross-site form could do this
        assert r.status_code == 403 and "X-Cpuos-Csrf" in r.json()["error"]["message"]
        r = c.post("/workspaces", json=body, headers={"X-Cpuos-Csrf": "wrong"})
        assert r.status_code == 403
        r = c.post("/workspaces", json=body, headers={"X-Cpuos-Csrf": csrf})
        assert r.status_code == 201, r.text
        # a bearer key works as before, with no CSRF header
        with d.client() as k:
            assert k.delete(f"/workspaces/{r.json()['id']}").status_code == 200
        # sign out: the cookie is cleared and the session is gone
        out = c.delete("/ui/session", headers={"X-Cpuos-Csrf": csrf})
        assert out.status_code == 200 and "cpuos_session=" in out.headers["set-cookie"]
        c.cookies.clear()
    stale = httpx.get(d.url + "/sandboxes", cookies={"cpuos_session": "x" * 43}, timeout=30)
    assert stale.status_code == 401 and "sign in again" in stale.json()["error"]["message"]


def test_signed_out_and_revoked_sessions_end(d: Daemon) -> None:
    c, csrf = session(d)
    with c:
        token = c.cookies["cpuos_session"]
        assert c.delete("/ui/session", headers={"X-Cpuos-Csrf": csrf}).status_code == 200
    assert httpx.get(d.url + "/sandboxes", cookies={"cpuos_session": token},
                     timeout=30).status_code == 401
    _, key = workspace(d, "revoked-ws")
    c, csrf = session(d, key)
    with c:
        assert c.get("/sandboxes").status_code == 200
        with httpx.Client(base_url=d.url, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as k:
            mine = k.get("/workspace/keys").json()["keys"][0]["id"]
            k.post("/workspace/keys", json={"label": "other"}).raise_for_status()
            assert k.delete(f"/workspace/keys/{mine}").status_code == 200
        r = c.get("/sandboxes")
        assert r.status_code == 401
        assert c.get("/ui/session").status_code == 401


def test_a_websocket_on_the_cookie_must_come_from_the_daemons_own_page(d: Daemon) -> None:
    c, _ = session(d)
    token = c.cookies["cpuos_session"]
    c.close()
    ws_url = d.url.replace("http://", "ws://") + "/sandboxes/sbx-000000000000/pty/1/ws"

    async def close_code(origin: str) -> int:
        try:
            async with websockets.connect(
                    ws_url, origin=origin,  # type: ignore[arg-type]
                    additional_headers={"Cookie": f"cpuos_session={token}"}) as ws:
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
        except websockets.InvalidStatus as e:  # refused before the handshake: as a bad key
            return e.response.status_code
        except websockets.ConnectionClosed as e:
            return e.rcvd.code if e.rcvd else 0

    # another site's page (cross-site WebSocket hijacking): refused as unauthenticated,
    # as a WebSocket with a bad key is
    assert asyncio.run(close_code("http://evil.test")) == 403
    # the console's own page: authenticated; the sandbox does not exist
    assert asyncio.run(close_code(d.url)) == 4404


def test_the_admin_acts_in_another_workspace_and_no_one_else_may(d: Daemon) -> None:
    wid, key = workspace(d, "acted-in")
    oid, _ = workspace(d, "other-ws")
    with d.client() as admin:
        r = admin.get("/workspace", headers={"X-Cpuos-Workspace": wid})
        assert r.status_code == 200 and r.json()["id"] == wid and "host" not in r.json()
        assert admin.get("/workspace", params={"workspace": wid}).json()["id"] == wid
        assert admin.get("/sandboxes", params={"workspace": "*"}).status_code == 200
        assert admin.get("/workspace", params={"workspace": "ws-nope"}).status_code == 404
    with httpx.Client(base_url=d.url, timeout=30, headers={"Authorization": f"Bearer {key}"}
                      ) as c:
        assert c.get("/workspace", params={"workspace": wid}).status_code == 200  # its own
        r = c.get("/workspace", headers={"X-Cpuos-Workspace": oid})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert c.get("/sandboxes", params={"workspace": "*"}).status_code == 403
        assert c.get("/events", params={"workspace": oid}).status_code == 404


def test_usage_by_day(d: Daemon) -> None:
    now = time.time()
    with d.client() as c:
        r = c.get("/usage", params={"by": "day", "since": now - 3 * 86400})
        assert r.status_code == 200, r.text
        days = r.json()["days"]
        assert len(days) == 4 and all(re.fullmatch(r"\d{4}-\d\d-\d\d", x["date"]) for x in days)
        assert days[0]["since"] == pytest.approx(now - 3 * 86400, abs=5)
        assert all(x["cost"] == 0 and x["vcpu_seconds"] == 0 for x in days)
        assert c.get("/usage", params={"by": "week"}).status_code == 422
        assert c.get("/usage", params={"by": "day", "since": now - 500 * 86400}
                     ).status_code == 422


def test_events_stream_opens_with_hello(d: Daemon) -> None:
    with d.client() as c, c.stream("GET", "/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0] == "retry: 2000" and got[1] == "event: hello"
        assert json.loads(got[2].removeprefix("data: "))["workspace"]
    with d.client() as c:
        assert c.get("/events", params={"kind": "nonsense"}).status_code == 422
        assert c.get("/events", params={"sandbox": "sbx-000000000000"}).status_code == 404


def test_the_page_has_a_strict_content_security_policy(d: Daemon) -> None:
    a = httpx.get(d.url + "/ui/", timeout=30)
    b = httpx.get(d.url + "/ui/", timeout=30)
    assert a.status_code == 200 and "<div id=\"app\">" in a.text
    csp = a.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "unsafe-eval" not in csp
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "connect-src 'self'" in csp and "'unsafe-inline'" not in csp.split("style-src-attr")[0]
    nonce = re.search(r"'nonce-([^']+)'", csp)
    assert nonce and f'content="{nonce.group(1)}"' in a.text
    assert nonce.group(1) not in b.headers["content-security-policy"]  # fresh per answer
    assert a.headers["cache-control"] == "no-store" and a.headers["x-frame-options"] == "DENY"
    asset = re.search(r'src="(/ui/assets/[^"]+\.js)"', a.text)
    assert asset
    js = httpx.get(d.url + asset.group(1), timeout=30)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "immutable" in js.headers["cache-control"]
    for bad in ("/ui/assets/..%2f..%2fapi%2fapp.py", "/ui/assets/nope.js", "/ui/assets/.x"):
        assert httpx.get(d.url + bad, timeout=30).status_code == 404, bad
    assert httpx.get(d.url + "/ui", timeout=30).status_code == 307
