"""Background commands: processes that outlive the host connection that started them.

The agent keeps, per background process, its exit status once it ends and a bounded ring of
its output (stdout and stderr, one offset space: the offset of a byte is the count of output
bytes before it). The ring lives here, inside the sandbox, so a daemon that restarts (or a
client that left) loses nothing the ring still holds, and the memory it takes is the
sandbox's own. The process never waits on the host: its pipes are drained into the ring
whatever the readers do; a reader that falls behind the ring sees a gap (its next offset
jumps), never a stalled process.

Readers (``bg_attach``): any number per process, each a stream of its own on a host
connection, read from any offset the ring still holds, under the stream's send credits.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .transport import Closed

if TYPE_CHECKING:
    from .conn import Conn
    from .exec import Exec

MERGE_BELOW = 64 * 1024  # a chunk smaller than this takes the next one of its fd
MAX_CHUNKS = 4096  # whatever the writes' sizes, the ring's index stays small
READ_MAX = P.CHUNK  # bytes per out frame


class Ring:
    """A bounded byte ring over one offset space: ``start`` (the oldest offset held) to
    ``end`` (the next offset to be written). Not thread-safe: the owner locks."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self.chunks: deque[tuple[int, int, bytes]] = deque()  # (offset, fd, data)
        self.start = 0
        self.end = 0
        self.size = 0

    def append(self, fd: int, data: bytes) -> None:
        if not data:
            return
        if len(data) > self.cap:  # only its tail can be kept
            skip = len(data) - self.cap
            self.end += skip
            data = data[skip:]
        last = self.chunks[-1] if self.chunks else None
        if last is not None and last[1] == fd and len(last[2]) < MERGE_BELOW \
                and last[0] + len(last[2]) == self.end:
            self.chunks[-1] = (last[0], fd, last[2] + data)
        else:
            self.chunks.append((self.end, fd, data))
        self.end += len(data)
        self.size += len(data)
        while self.size > self.cap or len(self.chunks) > MAX_CHUNKS:
            off, f0, d0 = self.chunks[0]
            excess = self.size - self.cap
            if excess <= 0 or excess >= len(d0):
                self.chunks.popleft()
                self.size -= len(d0)
            else:
                self.chunks[0] = (off + excess, f0, d0[excess:])
                self.size -= excess
        self.start = self.chunks[0][0] if self.chunks else self.end

    def read(self, off: int, limit: int) -> list[tuple[int, int, bytes]]:
        """Chunks from max(off, start), at most limit bytes in all (at least one chunk's
        part when there is data)."""
        off = max(off, self.start)
        out: list[tuple[int, int, bytes]] = []
        n = 0
        for c_off, fd, data in self.chunks:
            c_end = c_off + len(data)
            if c_end <= off:
                continue
            part = data[max(0, off - c_off):]
            if n + len(part) > limit:
                part = part[: max(0, limit - n)]
            if not part:
                break
            out.append((max(off, c_off), fd, part))
            n += len(part)
            off = max(off, c_off) + len(part)
            if n >= limit:
                break
        return out


class Background:
    """What the agent keeps of one background process (the ``Exec`` that runs it feeds it)."""

    def __init__(self, ex: Exec, cmd: str, cap: int) -> None:
        self.ex = ex
        self.cmd = cmd[:1000]
        self.ring = Ring(cap)
        self.cv = threading.Condition()
        self.started_at = time.time()
        self.result: dict[str, Any] | None = None
        self.ended_at: float | None = None

    @property
    def pid(self) -> int:
        assert self.ex.pid is not None
        return self.ex.pid

    def output(self, fd: int, data: bytes) -> None:
        with self.cv:
            self.ring.append(fd, data)
            self.cv.notify_all()

    def finish(self, result: dict[str, Any]) -> None:
        with self.cv:
            self.result = result
            self.ended_at = time.time()
            self.cv.notify_all()

    def info(self) -> dict[str, Any]:
        with self.cv:
            d: dict[str, Any] = {
                "pid": self.pid, "cmd": self.cmd, "started_at": self.started_at,
                "running": self.result is None, "ended_at": self.ended_at,
                "out_start": self.ring.start, "out_end": self.ring.end,
                "buffer": self.ring.cap, "stdin": self.ex.stdin_open,
            }
            if self.result is not None:
                for k in ("exit_code", "signal", "timed_out", "killed", "duration"):
                    d[k] = self.result.get(k)
            return d

    def wait(self, timeout: float) -> bool:
        """True once it ended; False after timeout seconds."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.result is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
            return True


class Reader:
    """One ``bg_attach`` stream: output from ``offset`` (frames ``out`` with ``fd`` and
    ``off``), then, with ``follow``, the exit (``exit``, as for an exec) once the process
    ended and everything the ring holds was sent; without it, ``eof`` (``next``: the offset
    to read on from) once it reached the end of what is there now."""

    def __init__(self, bg: Background, conn: Conn, sid: int, offset: int, follow: bool,
                 registry: dict[int, Reader]) -> None:
        self.bg, self.conn, self.sid = bg, conn, sid
        self.pos, self.follow = offset, follow
        self.cancelled = False
        self.registry = registry
        registry[sid] = self

    def cancel(self) -> None:
        self.cancelled = True
        with self.bg.cv:
            self.bg.cv.notify_all()

    def run(self) -> None:
        bg, conn, sid = self.bg, self.conn, self.sid
        try:
            with bg.cv:
                if self.pos < 0:  # from the end: only what comes next
                    self.pos = bg.ring.end
                end = bg.ring.end
                head = {"t": "ok", "id": sid, "pid": bg.pid, "start": bg.ring.start,
                        "end": bg.ring.end, "offset": max(self.pos, bg.ring.start),
                        "running": bg.result is None}
            conn.open_stream(sid)
            conn.send(head)
            stop_at: int | None = None if self.follow else end
            while not self.cancelled:
                with bg.cv:
                    while True:
                        if self.cancelled or conn.closed:
                            return
                        limit = READ_MAX
                        if stop_at is not None:
                            limit = min(limit, stop_at - max(self.pos, bg.ring.start))
                        chunks = bg.ring.read(self.pos, limit) if limit > 0 else []
                        if chunks or stop_at is not None or bg.result is not None:
                            break
                        bg.cv.wait()  # output, finish and cancel notify
                    result = bg.result
                if not chunks:
                    if stop_at is not None:
                        conn.send({"t": "eof", "id": sid, "next": max(self.pos, stop_at)})
                    else:
                        assert result is not None
                        conn.send({"t": "exit", "id": sid, "next": self.pos, **result})
                    return
                for off, fd, data in chunks:
                    conn.send_data(sid, {"t": "out", "id": sid, "fd": fd, "off": off}, data)
                    self.pos = off + len(data)
        except Closed:
            pass
        finally:
            conn.close_stream(sid)
            if self.registry.get(sid) is self:
                self.registry.pop(sid, None)
