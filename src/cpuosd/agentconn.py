"""Host side of the agent channel: one unix socket per sandbox, listened on by the
daemon; the guest agent connects out to it (and reconnects after a restore or a
daemon restart). Requests are multiplexed as streams on that one connection.

Nothing the agent sends is trusted: frame sizes are bounded by the protocol
module, headers are checked by the callers, and a stream only ever receives
frames carrying its own id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from cpuos_agent import messages as M
from cpuos_agent import protocol as P
from cpuos_agent.protocol import ErrorCode, Kind

from .config import SandboxConfig
from .errors import ApiError
from .fdbudget import BUDGET

log = logging.getLogger("cpuosd.agent")

CREDIT_BATCH = 1 << 20
# What one stream may have queued here: the agent's send window, plus a margin for the
# control frames that need no credit. More is a protocol violation and drops the agent.
MAX_QUEUED = P.WINDOW + 2 * P.MAX_PAYLOAD
# s a device agent (a microVM's: it cannot hang up itself) gets to see the host hang up after
# a quiesce: whoever checkpoints one waits this long after disconnect()
DEVICE_SETTLE = 0.1
# s a stdin sender waits for the command to take bytes (credit) before it gives up
STDIN_STALL = 60.0


class TransportError(Exception):
    """The agent channel failed: not an API error (no HTTP status here). Whoever answers a
    client maps it (``cpuosd.errors.api_error``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AgentGone(TransportError):
    """The agent is not connected, went away, or stopped answering (its streams end)."""

    def __init__(self, message: str = "sandbox agent disconnected") -> None:
        super().__init__(message)


class AgentTimeout(TransportError):
    """The agent did not answer (or take stdin) within the time given."""


class StdinClosed(ApiError):
    """The agent says the command's stdin is gone (its ``stdin_closed``)."""

    def __init__(self, message: str = "the command's stdin is closed") -> None:
        super().__init__("invalid_argument", message)


_AGENT_CODES = frozenset(ErrorCode)


class AgentError(ApiError):
    """The agent's ``err`` answer: its code if it is one an agent may report
    (``cpuos_agent.protocol.ErrorCode``), else ``internal``; its message, bounded."""

    def __init__(self, h: P.Header) -> None:
        code, msg = h.get("code"), h.get("message")
        # (a code that is not a string, say a list, is no error of ours: checked first)
        super().__init__(code if isinstance(code, str) and code in _AGENT_CODES
                         else "internal",
                         msg[:500] if isinstance(msg, str) else "sandbox agent error")


# a stream's end of its own (never sent: queued to its reader when the agent is gone)
GONE = "_gone"


class Stream:
    def __init__(self, chan: AgentChannel, sid: int) -> None:
        self.chan = chan
        self.id = sid
        self.queue: asyncio.Queue[tuple[P.Header, bytes]] = asyncio.Queue()
        self._uncredited = 0
        self.queued = 0  # bytes received for this stream and not yet taken by its reader
        self.gen = chan.generation
        # stdin: bytes sent and not yet written by the agent to the command's pipe
        self.stdin_inflight = 0
        self.stdin_closed: str | None = None
        self.stdin_sent = 0
        self._stdin_ev = asyncio.Event()
        self.gone = False

    def on_stdin(self, h: P.Header) -> None:
        """A ``stdin_credit`` or ``stdin_closed`` from the agent (never queued)."""
        if h["t"] == Kind.STDIN_CREDIT:
            n = h.get("n")
            if isinstance(n, int) and n > 0:
                self.stdin_inflight = max(0, self.stdin_inflight - n)
        else:
            msg = h.get("message")
            self.stdin_closed = msg[:300] if isinstance(msg, str) and msg else "stdin closed"
        self._stdin_ev.set()

    async def send_stdin(self, data: bytes, *, close: bool = False, ack: bool = False,
                         stall: float = STDIN_STALL) -> None:
        """Bytes for the command's stdin, at most P.STDIN_WINDOW of them not yet written
        inside: waits (at most ``stall`` s without progress) for the agent's credit.
        Raises StdinClosed once the command's stdin is gone, AgentGone with the agent."""
        view = memoryview(data)
        while True:
            chunk = bytes(view[: P.CHUNK])
            view = view[len(chunk):]
            while self.stdin_inflight and self.stdin_inflight + len(chunk) > P.STDIN_WINDOW:
                if self.gone:
                    raise AgentGone()
                if self.stdin_closed:
                    raise StdinClosed(self.stdin_closed)
                self._stdin_ev.clear()
                try:
                    await asyncio.wait_for(self._stdin_ev.wait(), stall)
                except TimeoutError:
                    raise AgentTimeout(f"the command took no stdin for {stall:.0f}s"
                                       ) from None
            if self.gone:
                raise AgentGone()
            if self.stdin_closed:
                raise StdinClosed(self.stdin_closed)
            last = not view
            h = M.Stdin(t=Kind.STDIN)
            if last and close:
                h["close"] = True
            if last and ack:
                h["ack"] = True
            if chunk or len(h) > 1:
                self.stdin_inflight += len(chunk)
                self.stdin_sent += len(chunk)
                await self.send(h, chunk)
            if last:
                return

    async def send(self, header: M.Request, payload: bytes = b"") -> None:
        header["id"] = self.id
        await self.chan.send(header, payload, generation=self.gen)

    async def get(self, timeout: float | None = None) -> tuple[P.Header, bytes]:
        if timeout is None:
            h, payload = await self.queue.get()
        else:
            h, payload = await asyncio.wait_for(self.queue.get(), timeout)
        if h["t"] == GONE:
            raise AgentGone(h.get("message") or "sandbox agent disconnected")
        self.queued -= len(payload) + 64
        if h["t"] in P.DATA_KINDS:
            self._uncredited += len(payload)
            if self._uncredited >= CREDIT_BATCH or self.queue.empty():
                n, self._uncredited = self._uncredited, 0
                with contextlib.suppress(AgentGone):
                    await self.chan.send({"t": Kind.CREDIT, "id": self.id, "n": n},
                                         generation=self.gen)
        return h, payload

    def close(self) -> None:
        self.chan.streams.pop(self.id, None)


# at most one logged refusal per channel per this many seconds (code inside a sandbox can
# knock on its socket in a loop: that must not flood the daemon's log)
REFUSAL_LOG_INTERVAL = 10.0
# Before the key is checked (issue 25: code inside a sandbox may connect to its socket):
# the hello alone is read, a frame of at most HELLO_MAX header bytes and no payload, whole
# within HELLO_TIMEOUT s, read straight off the socket (nothing buffered beyond it); at most
# MAX_UNAUTHENTICATED such connections per sandbox at once, and none once the daemon's
# descriptor budget (cpuosd.fdbudget) is spent. A new connection past the cap closes the
# oldest one without a hello rather than itself: the agent sends its hello as soon as it
# has connected, so it is read before the next connection is accepted, and a flood from
# inside cannot hold the socket against the agent coming back after a restore (it would,
# if the connections it holds were the ones kept).
HELLO_MAX = 4096
HELLO_TIMEOUT = 5.0
MAX_UNAUTHENTICATED = 2
BACKLOG = 16


class AgentChannel:
    """``key``: the agent must present it in its hello (hmac-compared). A hello without it
    (code inside the sandbox knocking on the socket) is refused and never displaces the
    connected agent; only a hello with the key, i.e. the agent itself reconnecting, may."""

    def __init__(self, sock_path: Path, key: str | None = None,
                 liveness: float = SandboxConfig.agent_liveness) -> None:
        self.sock_path = sock_path
        self.key = key
        self.refusals = 0
        self.last_refusal: str | None = None
        self._refusal_logged = -REFUSAL_LOG_INTERVAL
        self.streams: dict[int, Stream] = {}
        self.generation = 0
        self.hello: P.Header | None = None
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        # set when the current connection ends (a new one per connection): a wait for the
        # hang-up cannot miss it when the agent reconnects at once
        self._hung_up = asyncio.Event()
        self._lsock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        # connections read for their hello, oldest first
        self._unauthenticated: dict[asyncio.Task[None], None] = {}
        self._write_lock = asyncio.Lock()
        self.on_disconnect: list[Any] = []
        self.on_connect: list[Callable[[], None]] = []  # after each accepted hello
        self.last_rx = 0.0
        # s without a frame from an agent that has streams open before the host gives up on
        # it (CPUOS_AGENT_LIVENESS): its connection is dropped and every stream on it ends
        # ``unavailable`` (a frozen or wedged sandbox must not hang a client). The host
        # pings it after a quarter of that.
        self.liveness = liveness
        # the liveness watch runs only while streams are open (an idle sandbox costs no
        # wakeup here): started by open(), it ends when the last stream has closed
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_gen = -1
        self.watch_runs = 0  # how many times it was started (tests)

    async def listen(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.sock_path.unlink()
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lsock.setblocking(False)
            lsock.bind(str(self.sock_path))
            lsock.listen(BACKLOG)
            os.chmod(self.sock_path, 0o666)
        except BaseException:
            lsock.close()
            raise
        self._lsock = lsock
        self._accepting = asyncio.get_running_loop().create_task(self._accept(lsock))

    async def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(lsock)
            except OSError as e:  # EMFILE and the like: the budget should have kept us off
                self._refuse(f"accept: {e}")
                await asyncio.sleep(0.1)
                continue
            self._admit(conn)
            await asyncio.sleep(0)  # the hellos already there are read before the next accept

    def _admit(self, conn: socket.socket) -> None:
        """A new connection, read for its hello (the oldest one still without one closed if
        there are MAX_UNAUTHENTICATED); closed at once if the descriptor budget is spent."""
        if len(self._unauthenticated) >= MAX_UNAUTHENTICATED:
            oldest = next(iter(self._unauthenticated))
            del self._unauthenticated[oldest]
            oldest.cancel()
            self._refuse(f"over {MAX_UNAUTHENTICATED} connections without a hello: the "
                         "oldest closed")
        if not BUDGET.take():
            conn.close()
            self._refuse("the daemon's descriptor budget is spent")
            return
        conn.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._hello(conn))
        self._unauthenticated[task] = None
        task.add_done_callback(lambda t: self._unauthenticated.pop(t, None))

    async def _hello(self, conn: socket.socket) -> None:
        """Read and check the hello; on success the connection is the agent's."""
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        try:
            try:
                async with asyncio.timeout(HELLO_TIMEOUT):
                    hlen, plen = P.parse_prefix(await _recv_exactly(loop, conn, P.PREFIX_LEN))
                    if hlen > HELLO_MAX or plen:
                        raise P.ProtocolError(f"a hello is at most {HELLO_MAX} header bytes "
                                              f"and no payload (got {hlen}, {plen})")
                    h = P.parse_header(await _recv_exactly(loop, conn, hlen))
                self._check_hello(h)
                if me is not None:  # the agent's now: not to be closed for a newer one
                    self._unauthenticated.pop(me, None)
                reader, writer = await asyncio.open_unix_connection(sock=conn,
                                                                    limit=P.MAX_PAYLOAD * 2)
            except (TimeoutError, P.ProtocolError, OSError) as e:
                self._refuse(str(e) or type(e).__name__)
                conn.close()
                return
            except BaseException:
                conn.close()
                raise
            await self._on_connect(reader, writer, h)
        finally:
            BUDGET.give()

    async def adopt(self, sock: socket.socket) -> None:
        """Take a connection made to our socket before we listened on it (a standby
        microVM's chardev): served as if accepted."""
        self._admit(sock)

    def stop_listening(self) -> None:
        """Close the listening socket and remove it, so the agent cannot (re)connect."""
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
        with contextlib.suppress(FileNotFoundError):
            self.sock_path.unlink()

    async def wait_disconnected(self, timeout: float) -> None:
        """Until the connection current at the call ends (even if the agent is back by
        then)."""
        if not self.connected:
            return
        try:
            await asyncio.wait_for(self._hung_up.wait(), timeout)
        except TimeoutError:
            raise AgentTimeout("sandbox agent did not let go of its connection") from None

    def disconnect(self) -> None:
        """Drop the current agent connection from our side."""
        self._drop_connection()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def wait_connected(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            why = f" (refused: {self.last_refusal})" if self.last_refusal else ""
            raise AgentGone(f"sandbox agent did not connect within {timeout:.0f}s{why}"
                            ) from None

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          h: P.Header) -> None:
        """The agent's connection, its hello (``h``) read and checked by ``_hello``."""
        self._drop_connection()  # the agent itself (it has the key) reconnected
        self.generation += 1
        if self.hello is None and h.get("tracking") == "tree-scan":
            # an agent without its cgroup tree (not started as root: e.g. a microVM guest
            # built before root mode): a process that double-forks, calls setsid and clears
            # its environment escapes an exec's timeout
            log.warning("agent channel %s: the agent tracks execs by a process-tree scan, "
                        "not a cgroup (ruid %r)", self.sock_path, h.get("ruid"))
        self.hello = h
        self._writer = writer
        self._hung_up = asyncio.Event()
        self._connected.set()
        for cb in list(self.on_connect):
            cb()
        self._reader_task = asyncio.current_task()
        gen = self.generation
        self.last_rx = time.monotonic()
        try:
            while True:
                hdr, payload = await self._read_frame(reader)
                self.last_rx = time.monotonic()
                sid = hdr.get("id")
                st = self.streams.get(sid) if isinstance(sid, int) else None
                if st is not None and st.gen == gen and hdr["t"] in (Kind.STDIN_CREDIT,
                                                                     Kind.STDIN_CLOSED):
                    st.on_stdin(hdr)
                elif st is not None and st.gen == gen:
                    st.queued += len(payload) + 64
                    if st.queued > MAX_QUEUED:
                        # the agent ignored flow control: it may not grow our memory
                        raise P.ProtocolError(f"stream {sid} exceeded its window")
                    st.queue.put_nowait((hdr, payload))
        except (asyncio.IncompleteReadError, P.ProtocolError, OSError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                log.warning("agent channel %s: %s", self.sock_path, e)
        except asyncio.CancelledError:
            pass
        finally:
            if self.generation == gen:
                self._stop_watch()
                self._drop_connection()
            writer.close()

    def _start_watch(self) -> None:
        t = self._watch_task
        if t is not None and not t.done() and self._watch_gen == self.generation:
            return
        self._stop_watch()  # (one of an older connection's)
        self.watch_runs += 1
        self._watch_gen = self.generation
        self._watch_task = asyncio.get_running_loop().create_task(
            self._watch(self.generation, time.monotonic()))

    def _stop_watch(self) -> None:
        t, self._watch_task = self._watch_task, None
        if t is not None and t is not asyncio.current_task():
            t.cancel()

    async def _watch(self, gen: int, since: float) -> None:
        """Liveness, while streams are open: an agent silent for a quarter of ``liveness``
        (since the later of its last frame and this watch's start) is pinged; one silent
        for all of it is dropped (its streams end unavailable). Ends once no stream is
        open (``open`` starts it again)."""
        tick = max(0.05, self.liveness / 4)
        while self.generation == gen and self._writer is not None and self.streams:
            await asyncio.sleep(tick)
            if self.generation != gen or not self.streams:
                break
            idle = time.monotonic() - max(self.last_rx, since)
            if idle >= self.liveness:
                log.warning("agent channel %s: no answer for %.1fs; dropping it",
                            self.sock_path, idle)
                w = self._writer
                if w is not None:
                    w.transport.abort()
                self._drop_connection(f"the sandbox stopped answering (nothing for "
                                      f"{idle:.0f}s)")
                return
            if idle >= tick:
                with contextlib.suppress(AgentGone):
                    await asyncio.wait_for(self.send({"t": Kind.PING, "id": 0}), tick)

    def _check_hello(self, h: P.Header) -> None:
        if h["t"] != Kind.HELLO:
            raise P.ProtocolError("first frame must be hello")
        v = h.get("version")
        if v != P.PROTOCOL_VERSION:
            raise P.ProtocolError(f"agent speaks protocol version {v!r}; this daemon speaks "
                                  f"{P.PROTOCOL_VERSION} (a sandbox paused by an older cpuos "
                                  "cannot resume)")
        if self.key is not None:
            got = h.get("key")
            if not isinstance(got, str) or not hmac.compare_digest(got.encode(),
                                                                   self.key.encode()):
                raise P.ProtocolError("hello without the agent key (not the agent)")

    def _refuse(self, why: str) -> None:
        self.refusals += 1
        self.last_refusal = why[:300]
        now = time.monotonic()
        if now - self._refusal_logged >= REFUSAL_LOG_INTERVAL:
            self._refusal_logged = now
            log.warning("agent channel %s refused a connection (%d so far): %s",
                        self.sock_path, self.refusals, self.last_refusal)

    @staticmethod
    async def _read_frame(reader: asyncio.StreamReader) -> tuple[P.Header, bytes]:
        prefix = await reader.readexactly(P.PREFIX_LEN)
        hlen, plen = P.parse_prefix(prefix)
        raw = await reader.readexactly(hlen + plen)
        return P.parse_header(raw[:hlen]), raw[hlen:]

    def _drop_connection(self, why: str = "sandbox agent disconnected") -> None:
        had = self._writer is not None
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        self._connected.clear()
        self._hung_up.set()
        for st in list(self.streams.values()):
            st.gone = True
            st._stdin_ev.set()
            st.queue.put_nowait(({"t": GONE, "message": why}, b""))
        self.streams.clear()
        if had:
            for cb in self.on_disconnect:
                cb()

    async def send(self, header: M.Request, payload: bytes = b"",
                   generation: int | None = None) -> None:
        """header: a message to the agent (cpuos_agent.messages)."""
        w = self._writer
        if w is None or (generation is not None and generation != self.generation):
            raise AgentGone()
        data = P.encode(header, payload)
        async with self._write_lock:
            try:
                w.write(data)
                await w.drain()
            except (ConnectionError, OSError):
                raise AgentGone() from None

    def open(self) -> Stream:
        if not self.connected:
            raise AgentGone("sandbox agent is not connected")
        st = Stream(self, next(self._ids))
        self.streams[st.id] = st
        self._start_watch()
        return st

    async def call(self, header: M.Request, timeout: float = 30.0) -> P.Header:
        """One request, one ok/err answer."""
        return (await self.call_full(header, timeout))[0]

    async def call_full(self, header: M.Request, timeout: float = 30.0
                        ) -> tuple[P.Header, bytes]:
        """One request, one ok/err answer, with its payload."""
        st = self.open()
        try:
            await st.send(header)
            try:
                h, payload = await st.get(timeout)
            except TimeoutError:
                raise AgentTimeout(f"sandbox agent did not answer {header['t']!r}"
                                   ) from None
            raise_for_agent_error(h)
            return h, payload
        finally:
            st.close()

    async def close(self) -> None:
        self.stop_listening()
        self._drop_connection()
        for t in list(self._unauthenticated):
            t.cancel()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.sock_path.unlink()




async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int
                        ) -> bytes:
    """n bytes off a non-blocking socket, read as they come (never more than n)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError("closed before its hello")
        buf += chunk
    return bytes(buf)


def raise_for_agent_error(h: P.Header) -> None:
    if h.get("t") == Kind.ERR:
        raise AgentError(h)


async def open_stream(chan: AgentChannel, msg: M.Request, wait: float, what: str,
                      on_error: Callable[[Stream], None] | None = None
                      ) -> tuple[Stream, P.Header]:
    """A new stream on chan: msg sent and its first answer awaited, which must be ``ok``
    (an agent error is raised as such; no answer within ``wait``: a timeout saying the
    agent did not ``what``). On any failure the stream is let go (``on_error``, else
    closed) and the error raised."""
    st = chan.open()
    try:
        await st.send(msg)
        try:
            h, _ = await st.get(wait)
        except TimeoutError:
            raise AgentTimeout(f"sandbox agent did not {what}") from None
        raise_for_agent_error(h)
        if h.get("t") != Kind.OK:
            raise ApiError("internal", f"unexpected agent answer {h.get('t')!r}")
    except BaseException:
        if on_error is not None:
            on_error(st)
        else:
            st.close()
        raise
    return st, h
