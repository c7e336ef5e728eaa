"""The web console through the API tier (issue 27 on issue 24's cluster, docs/DEPLOY.md): two
node processes (real runsc) and two API processes over one Postgres. A session made by
signing in through one API process works through the other (list, create, exec, a
WebSocket from the console's own origin), a request that changes something without the
CSRF header is refused, ``GET /metrics`` measures each sandbox on its own node, one
``GET /events`` through one API process carries the events of sandboxes on both nodes (a
node killed does not end it; the node back is read again), and signing out through one API
process ends the session on the other, and its event stream."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from support import testbed
from support.daemon import e2e_unavailable, wait_until
from support.testbed import ApiProcess, Cluster, node_of, place_only_on

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(pg_server: testbed.PostgresServer) -> Iterator[tuple[Cluster, str]]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    name = "t_" + secrets.token_hex(6)
    url = pg_server.create_database(name)
    try:
        with testbed.node_cluster(url) as c:
            yield c, url
    finally:
        pg_server.drop_database(name)


def sign_in(api: ApiProcess, key: str) -> tuple[str, str]:
    """(the session cookie's token, the CSRF token) of a console sign-in through ``api``."""
    r = httpx.post(api.url + "/ui/session", json={"key": key},
                   headers={"Origin": api.url}, timeout=30)
    assert r.status_code == 200, r.text
    assert "HttpOnly" in r.headers["set-cookie"] and key not in r.text
    return r.cookies["cpuos_session"], r.json()["csrf"]


class Events:
    """``GET /events`` read in a thread: every event as (kind, data)."""

    def __init__(self, url: str, cookie: str) -> None:
        self.got: list[tuple[str, Any]] = []
        self.ended = threading.Event()
        self.status = 0
        self._client = httpx.Client(timeout=httpx.Timeout(30, read=None))
        self._client.cookies.set("cpuos_session", cookie)
        self._t = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._t.start()

    def _run(self, url: str) -> None:
        try:
            with self._client.stream("GET", url + "/events") as r:
                self.status = r.status_code
                kind = "message"
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:"):
                        self.got.append((kind, json.loads(line[5:])))
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()

    def wait(self, what: str, cond: Any, timeout: float = 60) -> Any:
        def found() -> Any:
            return next((d for k, d in list(self.got) if cond(k, d)), None)

        wait_until(lambda: found() is not None, what, timeout=timeout)
        return found()

    def close(self) -> None:
        self._client.close()


def test_the_console_through_the_api_tier(cluster: tuple[Cluster, str]) -> None:
    c, url = cluster
    api1, api2 = c.apis
    key = c.key
    # the page itself is served by the API process
    page = httpx.get(api2.url + "/ui/", timeout=30)
    assert page.status_code == 200 and "Content-Security-Policy" in page.headers, page.text[:200]
    token, csrf = sign_in(api1, key)
    cookie = {"Cookie": f"cpuos_session={token}"}
    who = httpx.get(api2.url + "/ui/session", headers=cookie, timeout=30)
    assert who.status_code == 200 and who.json()["admin"] and who.json()["csrf"] == csrf

    # one event stream through API 2, open to both nodes before anything happens
    ev = Events(api2.url, token)
    made: dict[str, str] = {}
    try:
        hello = ev.wait("the stream's hello", lambda k, d: k == "hello")
        assert hello["nodes"] == ["node-a", "node-b"] and ev.status == 200

        with httpx.Client(base_url=api2.url, timeout=120, headers=cookie) as s:
            assert s.get("/sandboxes").status_code == 200
            # a request that changes something without the CSRF header: refused (403) by the
            # API process before any node sees it; a wrong one too
            for bad in ({}, {"X-Cpuos-Csrf": "0" * 32}):
                r = s.post("/sandboxes", json={"template": "python", "timeout": 300},
                           headers=bad)
                assert r.status_code == 403 and "X-Cpuos-Csrf" in r.text, r.text
            # a sandbox on each node, created and run through API 2 on API 1's session
            for node in ("node-a", "node-b"):
                place_only_on(url, key, c.apis, node)
                r = s.post("/sandboxes", json={"template": "python", "timeout": 300},
                           headers={"X-Cpuos-Csrf": csrf})
                assert r.status_code in (200, 201), r.text
                made[node] = r.json()["id"]
                assert node_of(url, made[node]) == node
                x = s.post(f"/sandboxes/{made[node]}/exec",
                           json={"cmd": f"echo hi-from-{node}"}, headers={"X-Cpuos-Csrf": csrf})
                assert x.status_code == 200 and f"hi-from-{node}".encode() in x.content
            place_only_on(url, key, c.apis, None)
            listed = {x["id"] for x in s.get("/sandboxes").json()["sandboxes"]}
            assert set(made.values()) <= listed
            assert s.post(f"/sandboxes/{made['node-a']}/exec",
                          json={"cmd": "true"}).status_code == 403  # (no CSRF header)
            # the list's figures (GET /metrics): each sandbox measured by its own node
            m = s.get("/metrics")
            assert m.status_code == 200, m.text
            got = {x["id"]: x for x in m.json()["sandboxes"]}
            for sid in made.values():
                assert "cpu_seconds" in got[sid], got.get(sid)

        # events from both nodes on the one stream
        for node, sid in made.items():
            ev.wait(f"{node}'s sandbox running", lambda k, d, sid=sid: k == "running"
                    and d["sandbox"] == sid)
            ev.wait(f"{node}'s command", lambda k, d, sid=sid: k == "command"
                    and d["sandbox"] == sid)

        # a WebSocket on the cookie through API 1: from the console's own page accepted
        # (the node checks the origin against the API process's host), another site refused
        ws_url = api1.url.replace("http://", "ws://") + f"/sandboxes/{made['node-b']}/pty/1/ws"

        async def close_code(origin: str) -> int:
            try:
                async with websockets.connect(
                        ws_url, origin=origin,  # type: ignore[arg-type]
                        additional_headers={"Cookie": f"cpuos_session={token}"}) as w:
                    while True:
                        await asyncio.wait_for(w.recv(), 30)
            except websockets.InvalidStatus as e:
                return e.response.status_code
            except websockets.ConnectionClosed as e:
                return e.rcvd.code if e.rcvd else 0

        assert asyncio.run(close_code("http://evil.test")) == 403  # (as a bad key)
        assert asyncio.run(close_code(api1.url)) == 4404  # (authenticated: no terminal 1)

        # a process that was not running at sign-in (a restarted API process) takes it
        api3 = ApiProcess(url, c.token, "3")
        try:
            wait_until(lambda: api3.health().get("nodes_alive") == 2, "API 3", timeout=60)
            r = httpx.get(api3.url + "/sandboxes", headers=cookie, timeout=30)
            assert r.status_code == 200 and set(made.values()) <= {
                x["id"] for x in r.json()["sandboxes"]}
        finally:
            api3.stop()

        # node-b killed: the stream goes on with node-a's events; node-b back (its sandbox
        # reattached) is read again, after an overflow naming it (events may be lost)
        c.nodes[1].kill9()
        wait_until(lambda: api2.health().get("nodes_alive") == 1, "node-b dead", timeout=30)
        with httpx.Client(base_url=api1.url, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as k:
            assert k.post(f"/sandboxes/{made['node-a']}/exec",
                          json={"cmd": "echo after"}).status_code == 200
            ev.wait("node-a's event with node-b dead", lambda k_, d: k_ == "command" and
                    d["sandbox"] == made["node-a"] and "after" in json.dumps(d))
            assert not ev.ended.is_set()
            c.nodes[1].start()
            wait_until(lambda: api2.health().get("nodes_alive") == 2, "node-b back",
                       timeout=60)
            ev.wait("the gap of node-b", lambda k_, d: k_ == "overflow"
                    and "node-b" in (d.get("nodes") or ()), timeout=30)
            wait_until(lambda: k.post(f"/sandboxes/{made['node-b']}/exec", json={
                "cmd": "echo back"}).status_code == 200, "node-b's sandbox", timeout=60)
            ev.wait("node-b's event after its return", lambda k_, d: k_ == "command" and
                    d["sandbox"] == made["node-b"] and "back" in json.dumps(d))

        # signing out through API 1 ends the session on API 2, and the stream
        out = httpx.delete(api1.url + "/ui/session", headers={**cookie, "X-Cpuos-Csrf": csrf},
                           timeout=30)
        assert out.status_code == 200, out.text
        r = httpx.get(api2.url + "/sandboxes", headers=cookie, timeout=30)
        assert r.status_code == 401, r.text
        assert httpx.get(api2.url + "/ui/session", headers=cookie).status_code == 401
        assert ev.ended.wait(30), "the event stream outlived the session"
        assert httpx.get(api2.url + "/events", headers=cookie).status_code == 401
    finally:
        ev.close()
        with httpx.Client(base_url=api1.url, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as k:
            for sid in made.values():
                k.delete(f"/sandboxes/{sid}")
        place_only_on(url, key, c.apis, None)


def test_the_api_tier_refuses_the_nodes_internal_routes(cluster: tuple[Cluster, str]) -> None:
    """``/node/drain`` and ``/node/events`` are a node's, for API processes (the node token):
    an API process answers 404 to anyone, the admin too, and drains nothing."""
    c, _ = cluster
    auth = {"Authorization": f"Bearer {c.key}"}
    for method, path in (("POST", "/node/drain"), ("GET", "/node/events")):
        r = httpx.request(method, c.apis[0].url + path, headers=auth, timeout=30)
        assert r.status_code == 404, r.text
    nodes = httpx.get(c.apis[0].url + "/nodes", headers=auth).json()["nodes"]
    assert not any(n["cordoned"] for n in nodes)  # (the drain never ran)


def test_the_console_in_a_browser_through_the_api_tier(cluster: tuple[Cluster, str]) -> None:
    """Debian's chromium signed in at API 2: the list shows a sandbox of each node, its node
    and its sparklines (``/metrics`` of both nodes), and a pause and a resume from the list show up
    live (``/events`` fanned in) on the sandbox of the node API 2's page did not ask."""
    from support.browser import COUNT_PIXELS, chromium_unavailable, launch, shot
    from support.browser import sign_in as ui_sign_in

    why = chromium_unavailable()
    if why:
        pytest.skip(why)
    from playwright.sync_api import expect, sync_playwright

    from cpuos import Sandbox

    c, url = cluster
    api1, api2 = c.apis
    made: dict[str, Sandbox] = {}
    try:
        for node in ("node-a", "node-b"):
            place_only_on(url, c.key, c.apis, node)
            made[node] = Sandbox.create(template="python", timeout="10m", api_url=api1.url,
                                        api_key=c.key)
            assert node_of(url, made[node].id) == node
        place_only_on(url, c.key, c.apis, None)
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                ui_sign_in(page, api2.url, c.key)
                page.goto(api2.url + "/ui/#/sandboxes")
                for node, s in made.items():
                    expect(page.locator(f"tr[data-sid='{s.id}']")).to_have_attribute(
                        "data-state", "running", timeout=90_000)
                    # the node column (there are several): where each one runs
                    expect(page.locator(f"tr[data-sid='{s.id}'] td[data-node]")).to_have_text(
                        node)
                page.wait_for_function(f"() => ({COUNT_PIXELS})(['canvas.spark', null, 0])"
                                       ".filter((n) => n > 0).length >= 2", timeout=90_000)
                shot(page, "cluster-sandboxes")
                sid = made["node-b"].id
                row = page.locator(f"tr[data-sid='{sid}']")
                page.evaluate("() => { window.__noReload = 1 }")
                row.get_by_role("button", name=f"Pause {sid}").click()
                expect(row).to_have_attribute("data-state", "paused", timeout=90_000)
                row.get_by_role("button", name=f"Resume {sid}").click()
                expect(row).to_have_attribute("data-state", "running", timeout=90_000)
                # a change made elsewhere (the SDK, through API 1) shows live too
                made["node-a"].pause()
                expect(page.locator(f"tr[data-sid='{made['node-a'].id}']")).to_have_attribute(
                    "data-state", "paused", timeout=90_000)
                assert page.evaluate("() => window.__noReload") == 1  # the same page
            finally:
                browser.close()
    finally:
        for s in made.values():
            s.kill()
        place_only_on(url, c.key, c.apis, None)
