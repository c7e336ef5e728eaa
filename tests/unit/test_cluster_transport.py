"""The API process's transport to the nodes (cpuosd.cluster.transport: aiohttp behind
httpx's seam) against a real HTTP/1.1 server on loopback (h11, one task per connection):
what the forwarder relies on, byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
import functools
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import pytest

from cpuosd.cluster.transport import AiohttpTransport, NodeAnswer


def sync(f: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(f)
    def run() -> None:
        asyncio.run(f())
    return run


@dataclass
class Seen:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class Server:
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # a client closed early
    # what each request is answered with: (status, headers, chunks, then end or hang)
    answer: Callable[[Seen], Awaitable[tuple[int, list[tuple[bytes, bytes]], list[bytes],
                                             bool]]] | None = None


async def _answer_ok(s: Seen) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]:
    return 200, [(b"content-type", b"text/plain")], [b"hello ", b"world"], False


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[Server]:
    srv = Server(answer=_answer_ok)

    async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        srv.connections += 1
        c = h11.Connection(h11.SERVER)
        try:
            while True:
                ev = c.next_event()
                if ev is h11.NEED_DATA:
                    data = await r.read(65536)
                    c.receive_data(data)
                    if not data and c.their_state is not h11.DONE:
                        srv.gone.set()
                        return
                    continue
                if isinstance(ev, h11.ConnectionClosed):
                    srv.gone.set()
                    return
                assert isinstance(ev, h11.Request), ev
                body = b""
                while True:
                    e2 = c.next_event()
                    if e2 is h11.NEED_DATA:
                        c.receive_data(await r.read(65536))
                    elif isinstance(e2, h11.Data):
                        body += e2.data
                    else:
                        assert isinstance(e2, h11.EndOfMessage)
                        break
                seen = Seen(ev.method, ev.target, list(ev.headers.raw_items()), body)
                srv.seen.append(seen)
                assert srv.answer is not None
                status, headers, chunks, hang = await srv.answer(seen)
                w.write(c.send(h11.Response(status_code=status, headers=headers)) or b"")
                for ch in chunks:
                    w.write(c.send(h11.Data(data=ch)) or b"")
                    await w.drain()
                if hang:  # (until the client goes away)
                    if not await r.read(1):
                        srv.gone.set()
                    return
                w.write(c.send(h11.EndOfMessage()) or b"")
                await w.drain()
                c.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError):
            srv.gone.set()
        finally:
            w.close()

    s = await asyncio.start_server(conn, "127.0.0.1", 0)
    srv.port = s.sockets[0].getsockname()[1]
    try:
        yield srv
    finally:
        s.close()


def _names(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [k.lower() for k, _ in headers]


@sync
async def test_bytes_path_and_headers_as_sent() -> None:
    async with server() as srv:
        t = AiohttpTransport()
        try:
            url = f"http://127.0.0.1:{srv.port}/sandboxes/sbx-1/files/a%2F..%2Fb%20c?path=%2Fx&q=1"
            req = httpx.Request("POST", url, headers=[(b"Authorization", b"Bearer k"),
                                                      (b"X-Dup", b"1"), (b"X-Dup", b"2")],
                                content=b'{"cmd": "true"}')
            resp = await t.handle_async_request(req)
            body = b"".join([c async for c in resp.aiter_raw()])
            await resp.aclose()
            assert resp.status_code == 200 and body == b"hello world"
            assert resp.headers["content-type"] == "text/plain"
            s = srv.seen[0]
            # the target exactly as written (no re-quoting, no ../ resolved)
            assert s.target == b"/sandboxes/sbx-1/files/a%2F..%2Fb%20c?path=%2Fx&q=1"
            assert s.body == b'{"cmd": "true"}'
            names = _names(s.headers)
            assert names.count(b"x-dup") == 2 and names.count(b"content-length") == 1
            for auto in (b"accept", b"accept-encoding", b"user-agent", b"content-type",
                         b"cookie"):
                assert auto not in names, (auto, s.headers)
        finally:
            await t.aclose()


@sync
async def test_connections_are_kept_alive_and_no_cookie_is_replayed() -> None:
    async def with_cookie(s: Seen) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]:
        return 200, [(b"set-cookie", b"session=secret; Path=/")], [b"ok"], False

    async with server() as srv:
        srv.answer = with_cookie
        t = AiohttpTransport()
        try:
            for _ in range(3):
                resp = await t.handle_async_request(
                    httpx.Request("GET", f"http://127.0.0.1:{srv.port}/x"))
                assert b"".join([c async for c in resp.aiter_raw()]) == b"ok"
                assert resp.headers["set-cookie"].startswith("session=")
                await resp.aclose()
            assert srv.connections == 1
            assert all(b"cookie" not in _names(s.headers) for s in srv.seen)
        finally:
            await t.aclose()


@sync
async def test_an_answer_streams_and_closing_it_early_closes_the_connection() -> None:
    async def endless(s: Seen) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]:
        return 200, [], [b"first"], True

    async with server() as srv:
        srv.answer = endless
        t = AiohttpTransport()
        try:
            resp = await t.handle_async_request(
                httpx.Request("POST", f"http://127.0.0.1:{srv.port}/exec", content=b"{}"))
            it = resp.aiter_raw().__aiter__()
            assert await asyncio.wait_for(it.__anext__(), 10) == b"first"  # before the end
            await resp.aclose()
            await asyncio.wait_for(srv.gone.wait(), 10)  # the node sees the client gone
        finally:
            await t.aclose()


@sync
async def test_a_streamed_body_is_sent_chunked() -> None:
    async def parts() -> AsyncIterator[bytes]:
        for i in range(5):
            yield b"part%d," % i

    async with server() as srv:
        t = AiohttpTransport()
        try:
            resp = await t.handle_async_request(
                httpx.Request("PUT", f"http://127.0.0.1:{srv.port}/up", content=parts()))
            await resp.aread()
            await resp.aclose()
            s = srv.seen[0]
            assert s.body == b"part0,part1,part2,part3,part4,"
            assert (b"transfer-encoding", b"chunked") in [(k.lower(), v) for k, v in s.headers]
        finally:
            await t.aclose()


@sync
async def test_failures_are_httpx_errors() -> None:
    t = AiohttpTransport()
    try:
        with socket_closed() as port, pytest.raises(httpx.ConnectError):
            await t.handle_async_request(httpx.Request("GET", f"http://127.0.0.1:{port}/"))

        async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read(65536)
            w.close()  # (no answer at all)

        s = await asyncio.start_server(drop, "127.0.0.1", 0)
        port = s.sockets[0].getsockname()[1]
        try:
            with pytest.raises(httpx.HTTPError):
                await t.handle_async_request(httpx.Request("GET", f"http://127.0.0.1:{port}/"))
        finally:
            s.close()
    finally:
        await t.aclose()


@sync
async def test_a_client_over_it_reads_the_answer() -> None:
    """The forwarder's own calls (drain, forks, metrics) go through an httpx.AsyncClient
    over this transport."""
    async with server() as srv:
        async with httpx.AsyncClient(transport=AiohttpTransport()) as c:
            r = await c.post(f"http://127.0.0.1:{srv.port}/node/drain", json={"a": 1})
            assert r.status_code == 200 and r.text == "hello world"
            assert srv.seen[0].body == b'{"a":1}'


@contextlib.contextmanager
def socket_closed() -> Iterator[int]:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    yield port


@sync
async def test_a_read_timeout_is_httpx_read_timeout() -> None:
    """A node that answers nothing within the request's read timeout: httpx.ReadTimeout."""
    gate = asyncio.Event()

    async def never(s: Seen) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]:
        await gate.wait()
        return 200, [], [], False

    async with server() as srv:
        srv.answer = never
        t = AiohttpTransport()
        try:
            req = httpx.Request("GET", f"http://127.0.0.1:{srv.port}/slow",
                                extensions={"timeout": {"connect": 5.0, "read": 0.2}})
            with pytest.raises(httpx.ReadTimeout):
                await t.handle_async_request(req)
        finally:
            gate.set()
            await t.aclose()


@sync
async def test_an_answer_says_when_it_is_whole() -> None:
    """``NodeAnswer.at_end``: what the API process uses to send a node's last chunk with the
    answer's end (cluster.api._Streamed): False while more may come, True once the end was
    read."""
    async def endless(s: Seen) -> tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]:
        return 200, [], [b"first"], True

    async with server() as srv:
        t = AiohttpTransport()
        try:
            srv.answer = endless
            resp = await t.handle_async_request(
                httpx.Request("POST", f"http://127.0.0.1:{srv.port}/exec", content=b"{}"))
            assert isinstance(resp.stream, NodeAnswer)
            it = resp.aiter_raw().__aiter__()
            assert await asyncio.wait_for(it.__anext__(), 10) == b"first"
            assert not resp.stream.at_end()  # (the node has not ended it)
            await resp.aclose()
            srv.answer = _answer_ok
            resp = await t.handle_async_request(
                httpx.Request("GET", f"http://127.0.0.1:{srv.port}/x"))
            stream = resp.stream
            assert isinstance(stream, NodeAnswer)
            body = b""
            async for chunk in stream:  # (to its end; aiter_raw would close it there)
                body += chunk
            assert body == b"hello world" and stream.at_end()
            await resp.aclose()
        finally:
            await t.aclose()
