"""The byte relay both proxies use (cpuosd.network.relay), over real loopback TCP: bytes and
their counts both ways, half-close, the end of the exchange (both sides, or the server's
side for the preview), resets, masking, the first-bytes hook and quickack."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NamedTuple

from cpuosd.network.relay import CHUNK, PlainStream, quickack, relay
from cpuosd.network.secrets import Scrubber

SECRET = b"sk-live-0123456789abcdef"
PLACEHOLDER = b"cpuos-secret-00112233445566778899aabb"
BOUND = 30.0  # s any one test may take (a relay that never returns fails, not hangs)


class Conn(NamedTuple):
    """A loopback connection: ``inner`` (what the relay gets) and ``outer`` (the peer the
    test drives)."""
    inner: PlainStream
    outer: PlainStream


@asynccontextmanager
async def connection() -> AsyncIterator[Conn]:
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accepted.put((r, w))

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    ir, iw = await accepted.get()
    try:
        yield Conn(PlainStream(ir, iw), PlainStream(r, w))
    finally:
        for writer in (w, iw):
            writer.close()
        server.close()
        await server.wait_closed()


async def read_all(s: PlainStream) -> bytes:
    out = bytearray()
    while chunk := await s.read(CHUNK):
        out += chunk
    return bytes(out)


def test_bytes_both_ways_with_half_close_and_counts() -> None:
    asyncio.run(asyncio.wait_for(_bytes_both_ways_with_half_close_and_counts(), BOUND))


async def _bytes_both_ways_with_half_close_and_counts() -> None:
    """a sends and shuts its sending side; b still answers after seeing that EOF; the
    relay returns once both have ended, counting what was sent first too."""
    async with connection() as a, connection() as b:
        task = asyncio.create_task(relay(a.inner, b.inner, to_b=b"early:", to_a=b"late:"))
        payload = bytes(range(256)) * 5000  # > several reads
        a.outer.write(payload)
        a.outer.write_eof()
        assert await read_all(b.outer) == b"early:" + payload  # b sees a's EOF
        b.outer.write(b"answer after the client's EOF")
        await b.outer.drain()
        b.outer.write_eof()
        assert await read_all(a.outer) == b"late:answer after the client's EOF"
        assert await task == (6 + len(payload), 5 + 29)


def test_both_sides_must_end_unless_until_b_ends() -> None:
    asyncio.run(asyncio.wait_for(_both_sides_must_end_unless_until_b_ends(), BOUND))


async def _both_sides_must_end_unless_until_b_ends() -> None:
    async with connection() as a, connection() as b:
        task = asyncio.create_task(relay(a.inner, b.inner))
        b.outer.write(b"bye")
        b.outer.write_eof()
        assert await read_all(a.outer) == b"bye"  # b's end reached a
        a.outer.write(b"still here")  # a->b goes on after b's side ended
        await a.outer.drain()
        assert await b.outer.read(CHUNK) == b"still here"
        assert not task.done()
        a.outer.write_eof()
        assert await task == (10, 3)


def test_until_b_ends_returns_when_the_server_side_ends() -> None:
    asyncio.run(asyncio.wait_for(_until_b_ends_returns_when_the_server_side_ends(), BOUND))


async def _until_b_ends_returns_when_the_server_side_ends() -> None:
    """The preview's upgrade: a browser that keeps its end open does not hold the relay
    once the sandbox's server has closed."""
    async with connection() as a, connection() as b:
        task = asyncio.create_task(relay(a.inner, b.inner, until_b_ends=True))
        a.outer.write(b"ping")
        await a.outer.drain()
        assert await b.outer.read(CHUNK) == b"ping"
        b.outer.write(b"pong")
        b.outer.write_eof()
        assert await task == (4, 4)  # a never closed
        assert await read_all(a.outer) == b"pong"


def test_a_reset_ends_its_direction_without_an_error() -> None:
    asyncio.run(asyncio.wait_for(_a_reset_ends_its_direction_without_an_error(), BOUND))


async def _a_reset_ends_its_direction_without_an_error() -> None:
    async with connection() as a, connection() as b:
        task = asyncio.create_task(relay(a.inner, b.inner))
        a.outer.write(b"x")
        await a.outer.drain()
        assert await b.outer.read(CHUNK) == b"x"
        sock = a.outer.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        a.outer.abort()  # RST: a's reads fail, writes to it fail
        assert await read_all(b.outer) == b""  # b is told: EOF
        b.outer.write(b"into a reset connection")
        b.outer.write_eof()
        sent, _ = await task
        assert sent == 1


def test_scrub_masks_what_b_sends_and_first_sees_a_first_bytes() -> None:
    asyncio.run(asyncio.wait_for(_scrub_masks_what_b_sends_and_first_sees_a_first_bytes(), BOUND))


async def _scrub_masks_what_b_sends_and_first_sees_a_first_bytes() -> None:
    seen: list[bytes] = []
    async with connection() as a, connection() as b:
        scrub = Scrubber({PLACEHOLDER: SECRET})
        task = asyncio.create_task(relay(a.inner, b.inner, scrub=scrub, first=seen.append))
        a.outer.write(b"GET / HTTP/1.1\r\n\r\n")
        a.outer.write_eof()
        assert await read_all(b.outer) == b"GET / HTTP/1.1\r\n\r\n"
        # the secret split across two writes, the second ending the stream (flush)
        b.outer.write(b"echo: " + SECRET[:7])
        await b.outer.drain()
        b.outer.write(SECRET[7:])
        b.outer.write_eof()
        assert await read_all(a.outer) == b"echo: " + PLACEHOLDER[:len(SECRET)]
        await task
    assert seen == [b"GET / HTTP/1.1\r\n\r\n"]


def test_plain_stream_acks_after_each_read() -> None:
    asyncio.run(asyncio.wait_for(_plain_stream_acks_after_each_read(), BOUND))


async def _plain_stream_acks_after_each_read() -> None:
    acked: list[asyncio.StreamWriter] = []
    async with connection() as a, connection() as b:
        sandbox = PlainStream(b.inner.reader, b.inner.writer, ack=acked.append)
        task = asyncio.create_task(relay(a.inner, sandbox, until_b_ends=True))
        b.outer.write(b"from the sandbox")
        b.outer.write_eof()
        await task
        assert acked and all(w is b.inner.writer for w in acked)
        assert await read_all(a.outer) == b"from the sandbox"
        quickack(b.inner.writer)  # sets TCP_QUICKACK on a real socket without raising
