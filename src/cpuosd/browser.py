"""Driving the browser inside a sandbox (the ``browser`` template's headless chromium) over
the Chrome DevTools Protocol, for the helpers of ``/sandboxes/{id}/browser/*``.

The daemon speaks CDP itself, to the sandbox's address on ``CDP_PORT`` (as the preview proxy
does), so the SDKs, the CLI and the MCP server need nothing but HTTP. Everything that comes
back is treated as hostile (code inside may have replaced chromium with a server of its
own): HTTP answers and WebSocket messages are size-capped, ids are checked against their
shapes, every wait has a deadline, and a screenshot must be a PNG.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from .errors import ApiError, invalid

CDP_PORT = 9222
MAX_JSON = 1 << 20  # a /json answer
MAX_MESSAGE = 64 << 20  # a CDP message (a full-page screenshot in base64)
MAX_EVENTS = 10_000  # events kept while waiting for an answer
CONNECT_TIMEOUT = 5.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GUID_RE = re.compile(r"^[0-9a-fA-F-]{8,64}$")
TARGET_RE = re.compile(r"^[0-9A-Za-z-]{8,64}$")
URL_SCHEMES = ("http://", "https://", "about:", "data:", "file://")
MAX_URL = 1 << 20


def no_browser(sid: str, why: str) -> ApiError:
    return ApiError("conflict", f"no browser answers in {sid} on port {CDP_PORT} ({why}); "
                    "create the sandbox from the 'browser' template", {"port": CDP_PORT})


async def get_json(addr: str, path: str, sid: str, method: str = "GET") -> Any:
    """A small JSON answer from chromium's HTTP endpoint (``/json/...``), capped."""
    import httpx  # (here: a daemon that never drives a browser does not load it, ~40 ms)

    try:
        async with httpx.AsyncClient(trust_env=False, timeout=CONNECT_TIMEOUT) as c:
            async with c.stream(method, f"http://{addr}:{CDP_PORT}{path}") as r:
                body = b""
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_JSON:
                        raise no_browser(sid, f"{path}: answer over {MAX_JSON} bytes")
                if r.status_code != 200:
                    raise no_browser(sid, f"{path}: HTTP {r.status_code}")
    except httpx.HTTPError as e:
        raise no_browser(sid, f"{path}: {type(e).__name__}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise no_browser(sid, f"{path}: not JSON") from None


async def browser_guid(addr: str, sid: str) -> tuple[str, dict[str, str]]:
    """The browser target's id (the last part of its WebSocket path) and its version."""
    v = await get_json(addr, "/json/version", sid)
    ws = v.get("webSocketDebuggerUrl") if isinstance(v, dict) else None
    guid = ws.rsplit("/devtools/browser/", 1)[-1] if isinstance(ws, str) else ""
    if not GUID_RE.fullmatch(guid):
        raise no_browser(sid, "/json/version names no browser target")
    version = {k: str(v[k])[:200] for k in ("Browser", "Protocol-Version", "User-Agent")
               if k in v}
    return guid, version


async def page_target(addr: str, sid: str) -> str:
    """The id of the page to drive: the first page target, or a new blank one."""
    targets = await get_json(addr, "/json/list", sid)
    if isinstance(targets, list):
        for t in targets:
            if (isinstance(t, dict) and t.get("type") == "page"
                    and isinstance(t.get("id"), str) and TARGET_RE.fullmatch(t["id"])):
                return str(t["id"])
    t = await get_json(addr, "/json/new?about:blank", sid, method="PUT")
    if not (isinstance(t, dict) and isinstance(t.get("id"), str)
            and TARGET_RE.fullmatch(t["id"])):
        raise no_browser(sid, "no page target, and none could be opened")
    return str(t["id"])


class Page:
    """One CDP connection to a page target: calls answered in order, events kept until a
    wait looks at them."""

    def __init__(self, ws: ClientConnection, deadline: float) -> None:
        self.ws = ws
        self.deadline = deadline
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        self.doc_status: dict[str, int] = {}  # loaderId -> HTTP status of its document

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ApiError("timeout", "the browser did not finish in time")
        return left

    async def _recv(self) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self._left()):
                raw = await self.ws.recv()
        except TimeoutError:
            raise ApiError("timeout", "the browser did not answer in time") from None
        except WebSocketException as e:
            raise ApiError("unavailable", f"the browser's connection ended: {e}") from None
        try:
            msg = json.loads(raw)
        except ValueError:
            raise ApiError("internal", "the browser sent a message that is not JSON") from None
        if not isinstance(msg, dict):
            raise ApiError("internal", "the browser sent a message that is not an object")
        if msg.get("method") == "Network.responseReceived":
            pr = msg.get("params") or {}
            status = (pr.get("response") or {}).get("status") if isinstance(pr, dict) else None
            if (pr.get("type") == "Document" and isinstance(pr.get("loaderId"), str)
                    and isinstance(status, int) and len(self.doc_status) < 100):
                self.doc_status[pr["loaderId"]] = status
        return msg

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        mid = self.next_id
        try:
            await self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        except WebSocketException as e:
            raise ApiError("unavailable", f"the browser's connection ended: {e}") from None
        while True:
            msg = await self._recv()
            if msg.get("id") == mid:
                err = msg.get("error")
                if err is not None:
                    text = err.get("message") if isinstance(err, dict) else err
                    raise ApiError("invalid_argument", f"{method}: {str(text)[:500]}",
                                   {"method": method})
                res = msg.get("result")
                return res if isinstance(res, dict) else {}
            if "method" in msg and len(self.events) < MAX_EVENTS:
                self.events.append(msg)

    async def wait_event(self, method: str, what: str, **match: Any) -> dict[str, Any]:
        """The first event ``method`` (kept or coming) whose params have ``match``."""
        def hit(m: dict[str, Any]) -> bool:
            p = m.get("params")
            return (m.get("method") == method and isinstance(p, dict)
                    and all(p.get(k) == v for k, v in match.items()))

        for i, m in enumerate(self.events):
            if hit(m):
                del self.events[:i + 1]
                return m.get("params") or {}
        self.events.clear()
        while True:
            try:
                m = await self._recv()
            except ApiError as e:
                if e.code == "timeout":
                    raise ApiError("timeout", f"{what}: not within the time given") from None
                raise
            if hit(m):
                return m.get("params") or {}

    async def evaluate(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                            awaitPromise=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            text = (d.get("exception") or {}).get("description") or d.get("text")
            raise ApiError("invalid_argument", f"script error: {str(text)[:500]}")
        return (r.get("result") or {}).get("value")


MAX_TARGETS = 4096


class Targets:
    """The page target each sandbox's helpers drove last (by sandbox and address: a restored
    sandbox has a new address), and the one last driven in any sandbox of the same template
    and workspace (clones of one template snapshot have the same target ids): a call tries
    them before asking for /json/list, a round trip through the sandbox's relay. The
    Manager's (``Manager.browser_targets``); at most MAX_TARGETS, the oldest go first."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self._last.get(key)

    def remember(self, key: str, target: str) -> None:
        self._last.pop(key, None)
        self._last[key] = target
        while len(self._last) > MAX_TARGETS:
            del self._last[next(iter(self._last))]


async def _connect(addr: str, target: str) -> ClientConnection:
    async with asyncio.timeout(CONNECT_TIMEOUT):
        return await connect(f"ws://{addr}:{CDP_PORT}/devtools/page/{target}",
                             max_size=MAX_MESSAGE, compression=None, proxy=None,
                             open_timeout=CONNECT_TIMEOUT, ping_interval=None)


@contextlib.asynccontextmanager
async def open_page(addr: str, sid: str, timeout: float, family: str = "",
                    targets: Targets | None = None) -> AsyncIterator[Page]:
    """A connection to the page to drive. ``family``: the sandbox's workspace and template
    (whose clones share target ids), or empty; ``targets``: the pages driven last (None:
    none remembered)."""
    targets = targets if targets is not None else Targets()
    deadline = time.monotonic() + timeout
    key = f"{sid}@{addr}"
    ws: ClientConnection | None = None
    target = ""
    tried = [t for t in dict.fromkeys((targets.get(key), targets.get("family:" + family)
                                       if family else None)) if t]
    for cached in tried:
        try:
            ws, target = await _connect(addr, cached), cached
            break
        except (OSError, TimeoutError, WebSocketException):
            pass  # the page is gone (closed, or the browser restarted)
    if ws is None:
        target = await page_target(addr, sid)
        try:
            ws = await _connect(addr, target)
        except (OSError, TimeoutError, WebSocketException) as e:
            raise no_browser(sid, f"page {target}: {type(e).__name__}: {str(e)[:200]}"
                             ) from None
    targets.remember(key, target)
    if family:
        targets.remember("family:" + family, target)
    try:
        yield Page(ws, deadline)
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1):
                await ws.close()


# ---- the helpers ----------------------------------------------------------------------------
def check_url(url: str) -> None:
    if len(url) > MAX_URL or not url.lower().startswith(URL_SCHEMES):
        raise invalid(f"url must start with one of {', '.join(URL_SCHEMES)} (at most "
                      f"{MAX_URL} characters)", field="url")


async def goto(addr: str, sid: str, url: str, timeout: float, family: str = "",
               targets: Targets | None = None) -> dict[str, Any]:
    """Navigate and wait for the page's load event: {url, status, title}. A navigation the
    browser cannot make (a name that does not resolve, a connection refused by the egress
    policy...) is ``unavailable`` with chromium's error (``net::ERR_...``)."""
    check_url(url)
    async with open_page(addr, sid, timeout, family, targets) as p:
        await p.call("Page.enable")
        await p.call("Network.enable", maxTotalBufferSize=0, maxResourceBufferSize=0)
        r = await p.call("Page.navigate", url=url)
        err = r.get("errorText")
        if err:
            raise ApiError("unavailable", f"the browser could not load {url[:200]}: "
                           f"{str(err)[:200]}", {"url": url[:2000], "error": str(err)[:200]})
        loader = r.get("loaderId")
        if loader:  # a new document (not a same-document navigation)
            await p.wait_event("Page.loadEventFired", f"loading {url[:200]}")
        status = p.doc_status.get(loader) if isinstance(loader, str) else None
        info = await p.evaluate("[location.href, document.title]")
        href, title = (info if isinstance(info, list) and len(info) == 2 else ["", ""])
        return {"url": str(href)[:MAX_URL], "title": str(title)[:10_000],
                "status": status}


async def screenshot(addr: str, sid: str, timeout: float, full_page: bool = False,
                     family: str = "", targets: Targets | None = None) -> bytes:
    async with open_page(addr, sid, timeout, family, targets) as p:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            m = await p.call("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m.get("contentSize") or {}
            w, h = size.get("width"), size.get("height")
            if isinstance(w, int | float) and isinstance(h, int | float) and w > 0 and h > 0:
                params.update(captureBeyondViewport=True, clip={
                    "x": 0, "y": 0, "width": min(float(w), 16384.0),
                    "height": min(float(h), 16384.0), "scale": 1})
        r = await p.call("Page.captureScreenshot", **params)
    data = r.get("data")
    try:
        png = base64.b64decode(data if isinstance(data, str) else "", validate=True)
    except ValueError:
        png = b""
    if not png.startswith(PNG_MAGIC):
        raise ApiError("internal", "the browser's screenshot is not a PNG")
    return png


async def content(addr: str, sid: str, timeout: float, family: str = "",
                  targets: Targets | None = None) -> str:
    async with open_page(addr, sid, timeout, family, targets) as p:
        html = await p.evaluate(
            "(document.doctype ? new XMLSerializer().serializeToString(document.doctype) : '')"
            " + document.documentElement.outerHTML")
    return html if isinstance(html, str) else ""


# A CSS selector's element, scrolled into view: its centre in the viewport, or why not.
_LOCATE = """(() => {
  const el = document.querySelector(%s);
  if (!el) return {error: "not_found"};
  el.scrollIntoView({block: "center", inline: "center", behavior: "instant"});
  const r = el.getBoundingClientRect();
  if (r.width <= 0 || r.height <= 0) return {error: "not_visible"};
  return {x: r.left + r.width / 2, y: r.top + r.height / 2};
})()"""

_FILL = """(() => {
  const el = document.querySelector(%s);
  if (!el) return "not_found";
  el.focus();
  if (el.isContentEditable) { document.execCommand("selectAll"); document.execCommand("delete"); }
  else if ("value" in el) { el.value = ""; }
  else return "not_editable";
  return "ok";
})()"""

_CHANGE = """(() => {
  const el = document.querySelector(%s);
  if (el) el.dispatchEvent(new Event("change", {bubbles: true}));
})()"""


def _sel(selector: str) -> str:
    if not selector or len(selector) > 10_000:
        raise invalid("selector must be a CSS selector (at most 10000 characters)",
                      field="selector")
    return json.dumps(selector)


async def click(addr: str, sid: str, selector: str, timeout: float, family: str = "",
                targets: Targets | None = None) -> None:
    """A real mouse click (pressed and released) at the centre of the first element the CSS
    selector matches, scrolled into view."""
    sel = _sel(selector)
    async with open_page(addr, sid, timeout, family, targets) as p:
        at = await p.evaluate(_LOCATE % sel)
        if not isinstance(at, dict) or "error" in at:
            why = at.get("error") if isinstance(at, dict) else "not_found"
            raise ApiError("not_found" if why == "not_found" else "conflict",
                           f"{selector[:200]!r}: " + ("no element matches" if why == "not_found"
                                                      else "the element is not visible"),
                           {"selector": selector[:2000]})
        x, y = at.get("x"), at.get("y")
        if not isinstance(x, int | float) or not isinstance(y, int | float):
            raise ApiError("internal", "the browser gave no position for the element")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            extra = {"button": "left", "clickCount": 1} if kind != "mouseMoved" else {}
            await p.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)


async def fill(addr: str, sid: str, selector: str, text: str, timeout: float,
               family: str = "", targets: Targets | None = None) -> None:
    """Replace the value of an input, textarea or contenteditable element with ``text``,
    typed as one insertion (``input`` events fire), then a ``change`` event."""
    sel = _sel(selector)
    async with open_page(addr, sid, timeout, family, targets) as p:
        r = await p.evaluate(_FILL % sel)
        if r != "ok":
            raise ApiError("not_found" if r == "not_found" else "conflict",
                           f"{selector[:200]!r}: " + ("no element matches" if r == "not_found"
                                                      else "the element takes no text"),
                           {"selector": selector[:2000]})
        if text:
            await p.call("Input.insertText", text=text)
        await p.evaluate(_CHANGE % sel)
