"""The daemon's CDP client (cpuosd.browser) against a fake DevTools endpoint that misbehaves
as code inside a sandbox could make it: oversized answers, a screenshot that is not a PNG,
an answer that never comes, a failed navigation. (The real chromium: tests/e2e/test_browser.)
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from cpuosd import browser as cdp
from cpuosd.errors import ApiError

Handler = Callable[[dict[str, Any]], Any]  # a CDP request -> its result, or None: no answer


class Fake:
    def __init__(self, handler: Handler, json_list: bytes | None = None) -> None:
        self.handler = handler
        self.lists = 0  # /json/list requests
        self.gone: set[str] = set()  # page ids whose WebSocket is refused
        self.json_list = json_list or json.dumps(
            [{"type": "page", "id": "0123456789ABCDEF0123456789ABCDEF"}]).encode()

    def http(self, conn: ServerConnection, req: Request) -> Response | None:
        if req.path.rsplit("/", 1)[-1] in self.gone:
            return Response(404, "Not Found", Headers(), b"no such target")
        if req.path.startswith("/json/list"):
            self.lists += 1
            return Response(200, "OK", Headers({"Content-Type": "application/json"}),
                            self.json_list)
        return None

    async def ws(self, conn: ServerConnection) -> None:
        async for raw in conn:
            msg = json.loads(raw)
            res = self.handler(msg)
            if res is None:
                continue
            for event in res.pop("_events", []):
                await conn.send(json.dumps(event))
            await conn.send(json.dumps({"id": msg["id"], "result": res}))


@pytest.fixture
def addr() -> str:
    # a loopback address of this test's own, so port 9222 is free whatever else runs here
    return f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"


async def start(addr: str, fake: Fake) -> Server:
    return await serve(fake.ws, addr, cdp.CDP_PORT, process_request=fake.http)


def run(addr: str, fake: Fake, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """``make()`` run against the fake (in an event loop of its own)."""
    async def go() -> Any:
        server = await start(addr, fake)
        try:
            return await make()
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(go())


def test_screenshot_must_be_a_png(addr: str) -> None:
    def h(msg: dict[str, Any]) -> Any:
        return {"data": base64.b64encode(b"<html>not a png").decode()}

    with pytest.raises(ApiError) as e:
        run(addr, Fake(h), lambda: cdp.screenshot(addr, "sbx-x", 5))
    assert e.value.code == "internal" and "PNG" in e.value.message

    def ok(msg: dict[str, Any]) -> Any:
        return {"data": base64.b64encode(cdp.PNG_MAGIC + b"rest").decode()}

    assert (run(addr, Fake(ok), lambda: cdp.screenshot(addr, "sbx-x", 5))).startswith(
        cdp.PNG_MAGIC)


def test_oversized_json_answer_is_refused(addr: str) -> None:
    fake = Fake(lambda m: {}, json_list=b"[" + b" " * (cdp.MAX_JSON + 10) + b"]")
    with pytest.raises(ApiError) as e:
        run(addr, fake, lambda: cdp.content(addr, "sbx-x", 5))
    assert e.value.code == "conflict" and "over" in e.value.message


def test_bad_target_ids_are_refused(addr: str) -> None:
    fake = Fake(lambda m: {}, json_list=json.dumps(
        [{"type": "page", "id": "../../browser/x"}]).encode())
    with pytest.raises(ApiError) as e:
        run(addr, fake, lambda: cdp.content(addr, "sbx-x", 5))
    assert e.value.code == "conflict"


def test_an_answer_that_never_comes_times_out(addr: str) -> None:
    with pytest.raises(ApiError) as e:
        run(addr, Fake(lambda m: None), lambda: cdp.content(addr, "sbx-x", 0.5))
    assert e.value.code == "timeout"


def test_goto_reports_the_navigation_error_and_waits_for_load(addr: str) -> None:
    def failing(msg: dict[str, Any]) -> Any:
        if msg["method"] == "Page.navigate":
            return {"frameId": "F", "loaderId": "L", "errorText": "net::ERR_NAME_NOT_RESOLVED"}
        return {}

    with pytest.raises(ApiError) as e:
        run(addr, Fake(failing), lambda: cdp.goto(addr, "sbx-x", "http://a.test/", 5))
    assert e.value.code == "unavailable"
    assert e.value.details["error"] == "net::ERR_NAME_NOT_RESOLVED"

    def loads(msg: dict[str, Any]) -> Any:
        if msg["method"] == "Page.navigate":
            return {"frameId": "F", "loaderId": "L", "_events": [
                {"method": "Network.responseReceived", "params": {
                    "loaderId": "L", "type": "Document", "response": {"status": 404}}},
                {"method": "Page.loadEventFired", "params": {"timestamp": 1}}]}
        if msg["method"] == "Runtime.evaluate":
            return {"result": {"type": "object", "value": ["http://a.test/", "Gone"]}}
        return {}

    r = run(addr, Fake(loads), lambda: cdp.goto(addr, "sbx-x", "http://a.test/", 5))
    assert r == {"url": "http://a.test/", "status": 404, "title": "Gone"}

    with pytest.raises(ApiError) as e:  # never loads: the navigation's own bound
        run(addr, Fake(lambda m: {"frameId": "F", "loaderId": "L"}
                       if m["method"] == "Page.navigate" else {}),
            lambda: cdp.goto(addr, "sbx-x", "http://a.test/", 0.5))
    assert e.value.code == "timeout"


def test_the_page_is_remembered_until_it_is_gone(addr: str) -> None:
    def h(msg: dict[str, Any]) -> Any:
        return {"result": {"type": "string", "value": "<html></html>"}}

    fake = Fake(h)

    async def three() -> None:
        t = cdp.Targets()  # (the Manager's: Manager.browser_targets)
        assert await cdp.content(addr, "sbx-x", 5, "w/browser", t) == "<html></html>"
        assert await cdp.content(addr, "sbx-x", 5, targets=t) == "<html></html>"
        assert fake.lists == 1  # the second call went straight to the page
        # another clone of the same template (and workspace) tries the same page first
        assert await cdp.content(addr, "sbx-y", 5, "w/browser", t) == "<html></html>"
        assert fake.lists == 1
        # without the cache (another owner's, or none): it asks for the list again
        assert await cdp.content(addr, "sbx-x", 5, targets=cdp.Targets()) == "<html></html>"
        assert fake.lists == 2
        fake.gone.add("0123456789ABCDEF0123456789ABCDEF")
        fake.json_list = json.dumps([{"type": "page", "id": "1" * 32}]).encode()
        assert await cdp.content(addr, "sbx-x", 5, targets=t) == "<html></html>"
        assert fake.lists == 3

    run(addr, fake, three)


def test_nothing_listening_is_no_browser(addr: str) -> None:
    with pytest.raises(ApiError) as e:
        asyncio.run(cdp.screenshot(addr, "sbx-x", 2))
    assert e.value.code == "conflict" and "no browser" in e.value.message


def test_urls_and_selectors_are_checked() -> None:
    for url in ("javascript:alert(1)", "chrome://settings", "ftp://x", "x" * 10):
        with pytest.raises(ApiError):
            cdp.check_url(url)
    cdp.check_url("https://example.test/")
    with pytest.raises(ApiError):
        cdp._sel("")
    assert cdp._sel('a[href="x"]') == json.dumps('a[href="x"]')

