"""The byte relay: bytes both ways between two connections, for both of the daemon's proxies.

- the egress proxy (``network/proxy.py``): a connection it does not parse (``on`` policy,
  TLS it does not end), and, through ``httpflow``, a connection after a 101 or a CONNECT's
  2xx (masked by a ``Scrubber`` where secrets went in). It waits for both directions to end
  and counts the bytes for the connection's record;
- the preview proxy (``network/preview.py``): a WebSocket (or other) upgrade that the
  sandbox's server answered 101. The exchange is over once the server's side has ended
  (``until_b_ends``): a browser may keep its end open after the server closed.

Each direction ends at its reader's EOF or at an error (reset, TLS failure) and then
half-closes its writer (``write_eof``), so the other direction goes on: a client that
sends its request and shuts down its sending side still gets the whole answer. The relay
has no timeout of its own and closes nothing: the caller owns both connections.

``quickack``: ACK at once on a socket after each read from it (``PlainStream(ack=)``), for
the side that faces a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Protocol

from .secrets import Scrubber

CHUNK = 256 * 1024  # one read


class Stream(Protocol):
    async def read(self, n: int) -> bytes: ...

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def drain(self) -> None: ...

    def write_eof(self) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


def quickack(w: asyncio.StreamWriter) -> None:
    """ACK at once on this socket (Linux clears TCP_QUICKACK after a while: set it after
    each read): a sandbox's server that writes a response's head and body separately would
    otherwise wait for our delayed ACK (gVisor's netstack holds the second write, Nagle)."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


class PlainStream:
    """An asyncio stream pair; ``ack``: called with the writer after each read (quickack)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 ack: Callable[[asyncio.StreamWriter], None] | None = None) -> None:
        self.reader, self.writer, self.ack = reader, writer, ack

    async def read(self, n: int) -> bytes:
        data = await self.reader.read(n)
        if self.ack is not None:
            self.ack(self.writer)
        return data

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()

    def write_eof(self) -> None:
        with contextlib.suppress(Exception):
            if self.writer.can_write_eof():
                self.writer.write_eof()

    def abort(self) -> None:
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.close()


async def relay(a: Stream, b: Stream, to_b: bytes = b"", to_a: bytes = b"", *,
                until_b_ends: bool = False, scrub: Scrubber | None = None,
                first: Callable[[bytes], None] | None = None) -> tuple[int, int]:
    """Bytes both ways, (from a, from b) counted with ``to_b``/``to_a`` (bytes read
    already, sent first). Returns once both directions have ended or, with
    ``until_b_ends``, once b's has (what a still sends is then dropped). ``scrub`` masks
    what b sends; ``first`` sees a's first bytes read here."""
    counts = [len(to_b), len(to_a)]

    async def pump(r: Stream, w: Stream, i: int, pre: bytes) -> None:
        masked = scrub if i == 1 else None
        try:
            if masked is not None:
                pre = masked.feed(pre)
            if pre:
                w.write(pre)
                await w.drain()
            seen = bool(pre)
            while True:
                chunk = await r.read(CHUNK)
                if not chunk:
                    break
                counts[i] += len(chunk)
                if i == 0 and not seen and first is not None:
                    first(chunk)
                seen = True
                if masked is not None:
                    chunk = masked.feed(chunk)
                if chunk:
                    w.write(chunk)
                    await w.drain()
            if masked is not None and (rest := masked.flush()):
                w.write(rest)
        except OSError:  # ConnectionError, ssl.SSLError: this direction is over
            pass
        finally:
            w.write_eof()

    a_to_b = asyncio.ensure_future(pump(a, b, 0, to_b))
    b_to_a = asyncio.ensure_future(pump(b, a, 1, to_a))
    try:
        await (b_to_a if until_b_ends else asyncio.gather(a_to_b, b_to_a))
    finally:
        a_to_b.cancel()
        b_to_a.cancel()
    return counts[0], counts[1]
