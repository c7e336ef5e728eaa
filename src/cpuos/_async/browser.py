"""``sbx.browser``: the headless chromium of a sandbox made from the ``browser`` template.

The helpers need no CDP knowledge: the daemon drives the browser (over the Chrome DevTools
Protocol, inside the host) and answers over plain HTTP, so this SDK needs no WebSocket
client. ``cdp_url()`` is for clients that speak CDP themselves (Playwright, Puppeteer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._durations import parse_duration
from .._errors import InvalidArgument

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox


def _seconds(timeout: str | float) -> float:
    try:
        return parse_duration(timeout, "timeout")
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


class AsyncBrowser:
    """The sandbox's browser: one page, driven by these helpers or by any CDP client.

    >>> await sbx.browser.goto("http://127.0.0.1:8000/")
    >>> png = await sbx.browser.screenshot()
    """

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    @property
    def _base(self) -> str:
        return f"/sandboxes/{self._sbx.id}/browser"

    async def cdp_url(self) -> str:
        """A WebSocket URL of the browser's DevTools endpoint through the daemon's preview
        proxy, its token in the query (keep it secret): e.g. Playwright's
        ``p.chromium.connect_over_cdp(url)``."""
        d = await self._sbx._http.request("GET", self._base)
        return str(d["cdp_url"])

    async def goto(self, url: str, *, timeout: str | float = 30) -> dict[str, Any]:
        """Load ``url`` and wait for its load event: ``{"url", "status", "title"}``. A page
        that cannot be reached (a name that does not resolve, a connection the sandbox's
        network policy refuses) raises Unavailable with chromium's error in
        ``details["error"]`` (e.g. ``net::ERR_NAME_NOT_RESOLVED``)."""
        d: dict[str, Any] = await self._sbx._http.request(
            "POST", self._base + "/goto", json={"url": url, "timeout": _seconds(timeout)})
        return d

    async def screenshot(self, *, full_page: bool = False,
                         timeout: str | float = 30) -> bytes:
        """The page as PNG bytes (the viewport, or the whole page with ``full_page``)."""
        parts = []
        async for chunk in self._sbx._http.stream(
                "GET", self._base + "/screenshot",
                params={"full_page": str(full_page).lower(), "timeout": _seconds(timeout)}):
            parts.append(chunk)
        return b"".join(parts)

    async def content(self, *, timeout: str | float = 30) -> str:
        """The page's HTML as it is now (the DOM serialized, scripts' changes included)."""
        d = await self._sbx._http.request("GET", self._base + "/content",
                                          params={"timeout": _seconds(timeout)})
        return str(d["html"])

    async def click(self, selector: str, *, timeout: str | float = 30) -> None:
        """Click (a real mouse press and release) the first element matching the CSS
        ``selector``, scrolled into view. NotFound if none matches."""
        await self._sbx._http.request("POST", self._base + "/click",
                                      json={"selector": selector,
                                            "timeout": _seconds(timeout)})

    async def fill(self, selector: str, text: str, *, timeout: str | float = 30) -> None:
        """Replace the text of the input, textarea or contenteditable element matching the
        CSS ``selector`` with ``text`` (``input`` and ``change`` events fire)."""
        await self._sbx._http.request("POST", self._base + "/fill",
                                      json={"selector": selector, "text": text,
                                            "timeout": _seconds(timeout)})
