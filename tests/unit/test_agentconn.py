"""The host side of the agent channel against a fake (hostile) agent: it never trusts it."""

from __future__ import annotations

import asyncio
import functools
import socket
from pathlib import Path

import pytest

from cpuos_agent import protocol as P
from cpuosd.agentconn import MAX_QUEUED, AgentChannel, AgentGone
from support.daemon import until


async def _setup(d: Path) -> tuple[AgentChannel, asyncio.StreamReader, asyncio.StreamWriter]:
    chan = AgentChannel(d / "agent.sock")
    await chan.listen()
    r, w = await asyncio.open_unix_connection(str(d / "agent.sock"))
    w.write(P.encode({"t": "hello", "version": P.PROTOCOL_VERSION}))
    await w.drain()
    await chan.wait_connected(5)
    return chan, r, w


def test_agent_ignoring_flow_control_is_dropped(tmp_path: Path) -> None:
    async def main() -> None:
        chan, _, w = await _setup(tmp_path)
        st = chan.open()
        chunk = b"x" * P.MAX_PAYLOAD
        sent = 0
        with pytest.raises((ConnectionError, OSError)):
            for _ in range(MAX_QUEUED // len(chunk) + 50):
                w.write(P.encode({"t": "out", "id": st.id, "fd": 1}, chunk))
                await w.drain()
                sent += len(chunk)
                await asyncio.sleep(0)
        for _ in range(100):
            if not chan.connected:
                break
            await asyncio.sleep(0.01)
        assert not chan.connected
        assert sent <= MAX_QUEUED + 2 * len(chunk) + (8 << 20)
        queued = 0
        with pytest.raises(AgentGone):
            while True:
                _, p = await st.get(1)
                queued += len(p)
        assert queued <= MAX_QUEUED
        await chan.close()

    asyncio.run(main())


def test_frames_for_unknown_streams_are_ignored_and_hello_required(tmp_path: Path) -> None:
    async def main() -> None:
        chan, _, w = await _setup(tmp_path)
        st = chan.open()
        w.write(P.encode({"t": "out", "id": st.id + 99, "fd": 1}, b"nope"))
        w.write(P.encode({"t": "ok", "id": st.id}))
        await w.drain()
        h, _ = await st.get(2)
        assert h == {"t": "ok", "id": st.id} and st.queue.empty()
        # a second connection that does not start with hello is refused; the first stays
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(chan.sock_path))
        s.sendall(P.encode({"t": "exit", "id": st.id}))
        await asyncio.sleep(0.2)
        assert chan.connected
        s.close()
        await chan.close()

    asyncio.run(main())


def test_keyed_channel_refuses_impostors_and_old_agents(tmp_path: Path) -> None:
    key = "ab" * 32

    async def hello(path: Path, **fields: object) -> asyncio.StreamWriter:
        _, w = await asyncio.open_unix_connection(str(path))
        w.write(P.encode({"t": "hello", "version": P.PROTOCOL_VERSION, **fields}))
        await w.drain()
        return w

    async def main() -> None:
        d = tmp_path
        chan = AgentChannel(d / "agent.sock", key)
        await chan.listen()
        # no key, a wrong key, an old protocol: refused, nothing connected
        # (one after the other: at most two connections may wait for their hello at once)
        bad: list[dict[str, object]] = [{}, {"key": "cd" * 32}, {"key": key, "version": 1}]
        for i, fields in enumerate(bad, 1):
            await hello(chan.sock_path, **fields)
            await until(functools.partial(lambda n: chan.refusals == n, i),
                        "the refusal counted")
        assert not chan.connected
        with pytest.raises(Exception, match="protocol version 1"):
            await chan.wait_connected(0.1)
        # the agent (it has the key) connects; an impostor after it never displaces it
        agent = await hello(chan.sock_path, key=key)  # (kept: a dropped writer hangs up)
        await chan.wait_connected(5)
        gen = chan.generation
        impostor = await hello(chan.sock_path, key="00" * 32)
        await until(lambda: chan.refusals == 4, "four refusals")
        assert chan.connected and chan.generation == gen
        # the agent itself reconnecting replaces its old connection
        again = await hello(chan.sock_path, key=key)
        await until(lambda: chan.generation == gen + 1, "the next generation")
        assert chan.connected
        for w in (agent, impostor, again):
            w.close()
        await chan.close()

    asyncio.run(main())


def test_liveness_watch_runs_only_while_streams_are_open(tmp_path: Path) -> None:
    """An idle channel (no stream) has no watch task, so no periodic wakeup per sandbox;
    a stream starts one, which pings a silent agent and ends with the last stream; one
    opened after a long quiet spell does not count that spell against the agent."""
    async def main() -> None:
        chan, r, w = await _setup(tmp_path)
        chan.liveness = 0.4  # ticks every 0.1 s
        await asyncio.sleep(0.5)  # idle longer than liveness: nothing runs, nothing dropped
        assert chan.watch_runs == 0 and chan.connected
        st = chan.open()
        assert chan.watch_runs == 1
        # the agent's side sees a ping once the stream has been quiet for a tick, answers
        prefix = await asyncio.wait_for(r.readexactly(P.PREFIX_LEN), 5)
        hlen, plen = P.parse_prefix(prefix)
        h = P.parse_header((await r.readexactly(hlen + plen))[:hlen])
        assert h["t"] == "ping"
        w.write(P.encode({"t": "pong", "id": 0}))
        await w.drain()
        st2 = chan.open()  # a second stream: still the one watch
        assert chan.watch_runs == 1
        st.close()
        st2.close()
        t = chan._watch_task
        assert t is not None
        await asyncio.wait_for(t, 5)  # ends by itself with the last stream
        assert chan.connected
        # a stream on an agent that stays silent: dropped after liveness
        st3 = chan.open()
        assert chan.watch_runs == 2
        with pytest.raises(AgentGone, match="stopped answering"):
            await st3.get(5)
        assert not chan.connected
        w.close()
        await chan.close()

    asyncio.run(main())


def test_connections_without_a_hello_are_bounded(tmp_path: Path) -> None:
    """Issue 25: before the key is checked the channel reads one small hello, keeps at most
    MAX_UNAUTHENTICATED connections waiting for one (a newer one closes the oldest), and
    buffers nothing else; the agent still gets in through a flood of them."""
    import os
    import resource
    import struct

    from cpuosd import agentconn

    key = "ab" * 32

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        d = tmp_path
        chan = AgentChannel(d / "agent.sock", key)
        await chan.listen()
        base = open_fds()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        held = []
        for i in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(chan.sock_path))
            except BlockingIOError:  # the backlog is full until the channel accepts
                await asyncio.sleep(0.001)
                s.close()
                continue
            if i % 2:  # a hello's start, never finished
                s.send(struct.pack("!II", 200, 0) + b'{"t": "hello"')
            held.append(s)
            await asyncio.sleep(0)
        await until(lambda: len(chan._unauthenticated) <= agentconn.MAX_UNAUTHENTICATED,
                    "the unauthenticated bounded")
        # what the channel holds: its few waiting connections (ours are in `held`)
        assert open_fds() - base - len(held) <= agentconn.MAX_UNAUTHENTICATED + 2
        # a frame too big for a hello is refused after its prefix, its rest never read
        big = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        big.connect(str(chan.sock_path))
        big.setblocking(False)
        n = chan.refusals
        try:
            big.send(struct.pack("!II", P.MAX_HEADER, P.MAX_PAYLOAD) + b"{" * 65536)
        except OSError:
            pass
        await until(lambda: chan.refusals > n and "at most" in (chan.last_refusal or ""),
                    "a refusal past the bound")
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 16 << 10  # KiB
        # the agent connects (its hello comes at once) and is taken, flood or not
        _, w = await asyncio.open_unix_connection(str(chan.sock_path))
        w.write(P.encode({"t": "hello", "version": P.PROTOCOL_VERSION, "key": key}))
        await w.drain()
        await chan.wait_connected(5)
        for s in [*held, big]:
            s.close()
        w.close()
        await chan.close()

    asyncio.run(main())
