"""The API process's HTTP transport to the nodes: aiohttp's client (its HTTP/1.1 parser is
llhttp, in C) behind httpx's transport seam (``httpx.AsyncBaseTransport``), so the
forwarder and its callers keep httpx's types (``httpx.Request``, ``httpx.Response``,
``httpx.HTTPError``) and tests may put any transport in its place.

Why: every forwarded request went through httpcore's pure-Python HTTP/1.1 (h11) both ways;
measured with one kept-alive connection to a local uvicorn (uvloop, a 60-byte answer in
two chunks), the client side cost ~420 us of CPU per request with httpx's transport and
~150 us with this one (``bench/cluster.py`` measures the whole hop).

What it keeps of what the forwarder relied on:
- bytes as sent and received: the URL is used as written (``yarl.URL(..., encoded=True)``:
  no re-quoting or normalisation of the path the API process routed on), no automatic
  headers beyond Host and the body's framing, no decompression, no redirects, no cookie
  jar (one node's Set-Cookie is never sent with another client's request);
- a body given whole is sent with its head; an async stream is sent chunked;
- the answer streams as it comes; closing it before its end closes the connection, so
  the node sees the client gone (an exec is killed, a download stops);
- failures are httpx's errors (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``ReadError``, ``WriteError``, ``RemoteProtocolError``), with the request;
- the request's connect and read timeouts (``extensions["timeout"]``, as httpx passes
  them); no write timeout: as with an answer that takes long, the node bounds what it does
  with a body, and a client that goes away ends the request;
- kept-alive connections, reused; closed after ``KEEPALIVE`` s idle (well below the
  node's own idle limit, ``CPUOS_API_KEEPALIVE``, so the node never closes one as it is
  reused). No cap on connections: the API process caps the connections it accepts
  (``CPUOS_API_MAX_CONNECTIONS``), and each forwarded request holds at most one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
from yarl import URL

KEEPALIVE = 60.0  # s an idle connection to a node is kept for reuse
READ_BUFFER = 256 << 10  # bytes of an answer read ahead of the client (aiohttp: 64 KiB)


class NodeAnswer(httpx.AsyncByteStream):
    """A node's answer body as it comes; closed early: the connection is closed."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp, self._request = resp, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except aiohttp.ServerTimeoutError as e:
            raise httpx.ReadTimeout(f"reading the node's answer: {e}",
                                    request=self._request) from e
        except (aiohttp.ClientError, OSError) as e:
            raise httpx.ReadError(f"reading the node's answer: {e}",
                                  request=self._request) from e

    def at_end(self) -> bool:
        """The answer's body is all read: nothing more will come (a chunk just read was its
        last; its end arrived with it)."""
        return self._resp.content.at_eof() and not self._resp.content.exception()

    async def aclose(self) -> None:
        resp = self._resp
        if self.at_end():
            resp.release()  # (read to its end: the connection goes back to the pool)
        else:
            resp.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # made in the running loop, at the first request (aiohttp binds it to that loop)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE,
                                               use_dns_cache=False),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                read_bufsize=READ_BUFFER,
                skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent",
                                   "Content-Type"),
                trust_env=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, Any] = request.extensions.get("timeout") or {}
        connect = timeouts.get("connect", self.connect_timeout)
        # (the body's framing: Content-Length as given, else aiohttp chunks a stream)
        headers = [(k.decode("latin-1"), v.decode("latin-1"))
                   for k, v in request.headers.raw if k.lower() != b"transfer-encoding"]
        data: Any
        if isinstance(request.stream, httpx.ByteStream):
            data = request.content or None
        else:
            data = request.stream  # (an async iterable of bytes: aiohttp sends it as it comes)
        try:
            resp = await self._client().request(
                request.method, URL(str(request.url), encoded=True), headers=headers,
                data=data, allow_redirects=False, compress=None,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect,
                                              sock_read=timeouts.get("read")))
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(str(e), request=request) from e
        except aiohttp.ConnectionTimeoutError as e:
            raise httpx.ConnectTimeout(f"connecting: {e}", request=request) from e
        except aiohttp.ServerTimeoutError as e:  # (the request's read timeout, if any)
            raise httpx.ReadTimeout(f"reading: {e}", request=request) from e
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                aiohttp.ClientResponseError) as e:
            raise httpx.RemoteProtocolError(str(e) or type(e).__name__,
                                            request=request) from e
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise httpx.WriteError(str(e) or type(e).__name__, request=request) from e
        return httpx.Response(resp.status, headers=list(resp.raw_headers),
                              stream=NodeAnswer(resp, request),
                              extensions={"http_version": b"HTTP/1.1",
                                          "reason_phrase": (resp.reason or "").encode()})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
