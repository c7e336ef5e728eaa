"""The host's half of the agent's OOM guard (cpuosd.lifecycle.memwatch) against a fake
agent: the watch's state goes to the agent at once, on every threshold event that changes
it, and again on every new connection (each starts the agent unwatched)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from cpuos_agent import protocol as P
from cpuosd.agentconn import AgentChannel
from cpuosd.lifecycle.memwatch import MemoryWatch, threshold_for


async def _hello(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_unix_connection(str(path))
    w.write(P.encode({"t": "hello", "version": P.PROTOCOL_VERSION}))
    await w.drain()
    return r, w


async def _frame(r: asyncio.StreamReader) -> P.Header:
    prefix = await asyncio.wait_for(r.readexactly(P.PREFIX_LEN), 5)
    hlen, plen = P.parse_prefix(prefix)
    return P.parse_header((await r.readexactly(hlen + plen))[:hlen])


def test_state_on_start_on_change_and_on_each_connection(tmp_path: Path) -> None:
    async def main() -> None:
        d = tmp_path
        chan = AgentChannel(d / "agent.sock")
        await chan.listen()
        r, w = await _hello(chan.sock_path)
        await chan.wait_connected(5)
        used = [10]
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        mw = MemoryWatch(chan, efd, 100, lambda: used[0])
        assert await _frame(r) == {"t": "memory", "id": 0, "watched": True, "high": False}
        used[0] = 150
        os.eventfd_write(efd, 1)  # what the kernel does when usage crosses the threshold
        assert await _frame(r) == {"t": "memory", "id": 0, "watched": True, "high": True}
        os.eventfd_write(efd, 1)  # no change: nothing sent
        await asyncio.sleep(0.05)
        assert mw.events == 2
        # the agent reconnects (a new session starts unwatched): told again
        r2, w2 = await _hello(chan.sock_path)
        assert await _frame(r2) == {"t": "memory", "id": 0, "watched": True, "high": True}
        mw.close()
        assert chan.on_connect == []
        for x in (w, w2):
            x.close()
        await chan.close()

    asyncio.run(main())


def test_threshold_is_half_the_limit() -> None:
    assert threshold_for(2048) == 1 << 30
