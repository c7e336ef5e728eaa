"""WebSocket connections to the daemon (terminals): the async SDK's and the sync SDK's
(``scripts/gen_sync.py`` swaps the names)."""

from __future__ import annotations

import ssl

from websockets.asyncio.client import ClientConnection as AsyncWsConn
from websockets.asyncio.client import connect as _aconnect
from websockets.sync.client import ClientConnection as WsConn
from websockets.sync.client import connect as _connect

from ._config import tls_context

__all__ = ["AsyncWsConn", "WsConn", "ws_connect", "ws_connect_async"]

OPEN_TIMEOUT = 30.0


def _url(base: str, path: str) -> tuple[str, ssl.SSLContext | None]:
    if base.startswith("https:"):
        return "wss:" + base[len("https:"):].rstrip("/") + path, tls_context()
    return "ws:" + base[len("http:"):].rstrip("/") + path, None


async def ws_connect_async(base: str, path: str, key: str) -> AsyncWsConn:
    url, ctx = _url(base, path)
    return await _aconnect(url, additional_headers={"Authorization": f"Bearer {key}"},
                           ssl=ctx, open_timeout=OPEN_TIMEOUT, max_size=None,
                           compression=None)


def ws_connect(base: str, path: str, key: str) -> WsConn:
    url, ctx = _url(base, path)
    conn = _connect(url, additional_headers={"Authorization": f"Bearer {key}"},
                    ssl=ctx, open_timeout=OPEN_TIMEOUT, max_size=None, compression=None)
    # kept open across calls, closed by Terminal.disconnect/wait (not a with block)
    conn.pending_legacy_warning = False
    return conn
