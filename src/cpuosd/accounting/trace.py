"""What runs inside a gVisor sandbox without going through the API, recorded from outside
it: gVisor's runtime monitoring (seccheck trace points) with a ``remote`` sink in the daemon.

``Traced`` wraps the gVisor backend: before runsc starts or restores a sandbox, a listener
(a SOCK_SEQPACKET unix socket in the sandbox's host directory, never mounted inside) is
made for it and runsc is given ``--pod-init-config`` naming that socket. runsc (on the host)
connects, does the sink's handshake, and hands the connected socket to the Sentry, which
then sends a protobuf message per trace point: every ``execve`` (``sentry/execve``: argv,
binary, pid, uid, cwd) and every change to the file system. With cpuos's runsc (patch level
2, ``deps/runsc/patches``) those are cpuos's points: opens that may write (open, openat,
creat, openat2; filtered in the Sentry, with the path of the file really opened), truncate,
mknod, mkdir, rmdir, unlink, link, symlink and rename, with paths resolved in the Sentry
from what the syscall used; its sink batches points (one message of records every few
milliseconds) and coalesces repeats (one point with a count). With another runsc, gVisor's
own open points (every open is sent; those that do not write are dropped here). The Sentry
is the sandbox's kernel: code inside cannot skip, forge or silence these points, and
nothing of the recording lives inside (killing or replacing the agent changes nothing).

The trace session is set up when the Sentry boots, so a restore (resume, fork, a create
from a template snapshot, the warm pool) passes the config again and the new Sentry
connects again; a daemon restarted while sandboxes run re-attaches with ``runsc trace
create --force``. Template boots are not traced (no one's sandbox).

Bounded: the Sentry never waits for us (its writes are non-blocking; what does not fit it
keeps for its next round, bounded, then drops and counts, and the count comes in the header
of the next message that fits); one thread reads every sandbox's socket (a selector: nothing
wakes it while no sandbox sends anything), at most RATE points a second per sandbox (a
burst of BURST), and otherwise does not read that socket, so a flood inside costs the
daemon at most that; rows go to the audit's bounded queue. Every loss ends up in a counted
``dropped`` row, at most one a second (the Sentry's last count only once another message
gets through).

Off the sandbox's way: a sandbox that keeps sending (a build writing files) is read at most
every READ_EVERY, and what is read is kept as it came (SPOOL_BYTES at most) and parsed once
the sandbox quiets down (DEFER_MAX at the latest), or at once when someone reads the audit
(``Traced.drain``, which ``AuditLog.catch_up`` calls): see READ_EVERY below.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import heapq
import itertools
import json
import logging
import os
import posixpath
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..backends.base import Backend, Capabilities, SandboxSpec
from . import seccheck_pb2 as _pb
from .audit import AuditLog

log = logging.getLogger("cpuosd.trace")
# the generated module makes its classes at import (protoc's form): no static types
pb: Any = _pb

HEADER = struct.Struct("<HHI")  # header size, message type, dropped count (wire.Header)
COUNT = struct.Struct("<I")  # cpuos's header extension (size >= 12): points this stands for
LENGTH = struct.Struct("<I")  # a record's length in a batch
MSG_BATCH = 0x7C01  # cpuos's sink: a message of records (u32 length, header, point)
MAX_MESSAGE = 256 << 10  # a bigger one (a huge argv) is cut by the socket: counted, not read
RATE = 5000.0  # points parsed per second per sandbox (beyond: counted as dropped)
BURST = 20000.0
BATCH = 64  # messages read from one socket before the others get their turn
# A sandbox busy writing files sends a batch every few milliseconds. Reading and parsing
# them while it works costs it on this virtualized host, most when the host is loaded (git
# clone of 5000 files took 1.4-1.8x as long with the audit on, as much with the daemon's
# threads at nice 19 or SCHED_IDLE; a loop making and removing 5000 files, 1.56-1.77x audit
# off before this, 1.4x with it); on a quiet host the Sentry's own work per point is most
# of what is left, whoever reads (README, speed: stop 42). So a busy
# sandbox's messages (BUSY_BYTES or more sent with no pause of BUSY_GAP between sends) are
# read at most every READ_EVERY seconds, kept as they came (SPOOL_BYTES at most), and parsed
# once it quiets down (a look that finds nothing), at the latest DEFER_MAX after the first
# of them, or when someone reads the audit (Traced.drain). A few points (a command run,
# even a few in quick succession) are parsed at once: their rows come before the API's
# row of the command, written when it ends.
READ_EVERY = 0.05
BUSY_GAP = 0.1
BUSY_BYTES = 16 << 10
SPOOL_BYTES = 4 << 20
DEFER_MAX = 5.0
COALESCE = "1s"  # the Sentry's window for repeated points (cpuos's runsc, level 2)
EXEC_CONTEXT = ["time", "group_id", "parent_thread_group_id", "credentials", "cwd",
                "process_name"]
# file points carry the path resolved in the Sentry: no cwd (computing it costs a walk)
FILE_CONTEXT = ["time", "group_id", "parent_thread_group_id", "credentials", "process_name"]
CONTEXT = EXEC_CONTEXT  # (gVisor's own open points, where the cwd resolves relative paths)
O_ACCMODE, O_WRONLY, O_RDWR = 0o3, 0o1, 0o2
O_CREAT, O_TRUNC, O_APPEND = 0o100, 0o1000, 0o2000
FLAG_NAMES = ((O_CREAT, "O_CREAT"), (O_TRUNC, "O_TRUNC"), (O_APPEND, "O_APPEND"),
              (0o200, "O_EXCL"), (0o20000000, "O_TMPFILE"))
MSG_EXEC = pb.MESSAGE_SENTRY_EXEC
MSG_OPEN = pb.MESSAGE_SYSCALL_OPEN
# cpuos's file-system points (deps/runsc/patches: level 2), by syscall number: the op a
# row names, and what the message's pathname holds beside the path (fd_path)
FS_OPS: dict[int, tuple[str, str, str | None]] = {
    # sysno: (point name, op, pathname's meaning)
    76: ("truncate", "truncate", None), 82: ("rename", "rename", "from"),
    83: ("mkdir", "mkdir", None), 84: ("rmdir", "rmdir", None),
    86: ("link", "link", "from"), 87: ("unlink", "unlink", None),
    88: ("symlink", "symlink", "target"), 133: ("mknod", "mknod", None),
    258: ("mkdirat", "mkdir", None), 259: ("mknodat", "mknod", None),
    263: ("unlinkat", "unlink", None), 264: ("renameat", "rename", "from"),
    265: ("linkat", "link", "from"), 266: ("symlinkat", "symlink", "target"),
    316: ("renameat2", "rename", "from"),
}
AT_REMOVEDIR, RENAME_EXCHANGE = 0x200, 0x2
# what the agent itself does in every exec (its per-exec cgroups, cpuos_agent.cgroups):
# not the sandbox user's doing, and only root there may write
AGENT_PATHS = ("/run/cpuos-exec/", "/run/cpuos-mem/")


def session_config(endpoint: Path, cpuos_points: bool = True) -> dict[str, Any]:
    """runsc's --pod-init-config: the one trace session, its points and our sink.
    ``cpuos_points``: the runsc has cpuos's points (patch level 2): file-system changes,
    opens filtered to writes in the Sentry, coalescing in its sink; else gVisor's own open
    points (every open is sent; reads are dropped here)."""
    execve = {"name": "sentry/execve", "context_fields": EXEC_CONTEXT}
    if not cpuos_points:
        opens = [{"name": f"syscall/{s}/exit", "context_fields": CONTEXT,
                  **({"optional_fields": ["fd_path"]} if s != "open" else {})}
                 for s in ("open", "openat", "creat")]
        sink: dict[str, Any] = {"endpoint": str(endpoint), "retries": 0}
        return {"trace_session": {"name": "Default", "points": [execve, *opens],
                                  "sinks": [{"name": "remote", "config": sink}]}}
    points = [execve,
              *[{"name": f"syscall/{s}/exit", "context_fields": FILE_CONTEXT,
                 "optional_fields": ["cpuos_writes"]} for s in ("open", "openat", "creat")],
              *[{"name": f"syscall/{name}/exit", "context_fields": FILE_CONTEXT}
                for name in ["openat2", *(v[0] for v in FS_OPS.values())]]]
    sink = {"endpoint": str(endpoint), "retries": 0, "cpuos_coalesce": COALESCE}
    return {"trace_session": {"name": "Default", "points": points,
                              "sinks": [{"name": "remote", "config": sink}]}}


def flag_names(flags: int) -> list[str]:
    """open(2)'s flags by name (a new list: the row's own)."""
    return list(_flag_names(flags))


@functools.lru_cache(maxsize=1024)  # (a program uses a handful of distinct flag sets)
def _flag_names(flags: int) -> tuple[str, ...]:
    acc = flags & O_ACCMODE
    return ("O_WRONLY" if acc == O_WRONLY else "O_RDWR" if acc == O_RDWR else "O_RDONLY",
            *[n for bit, n in FLAG_NAMES if flags & bit == bit])


# opened for writing all the time and never a file's content: not kept
DEVICES = frozenset({"/dev/null", "/dev/tty", "/dev/urandom", "/dev/random", "/dev/zero",
                     "/dev/full", "/dev/ptmx"})


def is_write(flags: int) -> bool:
    return bool(flags & O_ACCMODE in (O_WRONLY, O_RDWR) or flags & (O_CREAT | O_TRUNC))


def _ctx(c: Any, out: dict[str, Any]) -> dict[str, Any]:
    """The point's context into ``out`` (the row's detail), which it returns."""
    out["pid"] = c.thread_group_id
    out["ppid"] = c.parent_thread_group_id
    cred = c.credentials
    out["uid"] = cred.real_uid
    out["euid"] = cred.effective_uid
    name = c.process_name
    if name:
        out["process"] = name
    out["time_ns"] = c.time_ns
    return out


def decode(mtype: int, payload: bytes, count: int = 1, cpuos_points: bool = True
           ) -> tuple[str, dict[str, Any]] | None:
    """One trace message as (kind, detail), or None for one not kept (an open for reading
    or one that failed; the agent's own cgroups). ``count`` > 1: the message stands for
    that many identical points (coalesced by the Sentry). ``cpuos_points``: the session
    has cpuos's points (session_config). Raises on a malformed message (the caller counts
    it)."""
    got = _decode(mtype, payload, cpuos_points)
    if got is not None and count > 1:
        got[1]["count"] = count
    return got


def _decode(mtype: int, payload: bytes, cpuos_points: bool
            ) -> tuple[str, dict[str, Any]] | None:
    if mtype == MSG_EXEC:
        m = pb.ExecveInfo.FromString(payload)
        c = m.context_data
        return "command", _ctx(c, {
            "source": "runtime", "argv": list(m.argv), "binary": m.binary_path or m.execfn,
            "cwd": c.cwd, "env": sorted({e.partition("=")[0] for e in m.env})[:256]})
    if mtype != MSG_OPEN:
        return None
    o = pb.Open.FromString(payload)
    if o.HasField("exit") and o.exit.result < 0:
        return None
    c = o.context_data
    fs = FS_OPS.get(o.sysno)
    if fs is not None:  # cpuos's points: the path resolved in the Sentry
        _, op, other = fs
        path = o.fd_path
        if op == "unlink" and o.flags & AT_REMOVEDIR:
            op = "rmdir"
        if path.startswith(AGENT_PATHS) and c.credentials.real_uid == 0:
            return None
        detail: dict[str, Any] = {"source": "runtime", "op": op, "path": path}
        if other is not None:
            detail[other] = o.pathname
        if op == "rename" and o.flags & RENAME_EXCHANGE:
            detail["exchange"] = True
        if op in ("mkdir", "mknod"):
            detail["mode"] = oct(o.mode)
        return "file_write", _ctx(c, detail)
    if not is_write(o.flags):
        return None
    if cpuos_points and o.fd_path.startswith("/"):
        path = o.fd_path  # the file opened, resolved in the Sentry from its new fd
    else:  # gVisor's own points: the name as given, joined to the dirfd's path or the cwd
        path = o.pathname
        if path and not path.startswith("/"):
            base = o.fd_path if o.fd_path.startswith("/") else c.cwd
            path = posixpath.normpath(posixpath.join(base or "/", path))
    if path in DEVICES or path.startswith("/dev/pts/") or (
            path.startswith(AGENT_PATHS) and c.credentials.real_uid == 0):
        return None
    detail = {"source": "runtime", "op": "open", "path": path, "flags": flag_names(o.flags),
              "fd": o.exit.result}
    if o.sysno == 437:
        detail["syscall"] = "openat2"
    if o.pathname and o.pathname != path:
        detail["name"] = o.pathname  # how the process named it (a link, /proc/self/fd/N...)
    return "file_write", _ctx(c, detail)


class _Hub:
    """One thread that reads every sandbox's trace socket (a selector over all of them): no
    thread per sandbox, and no wakeup while nothing arrives (a quiet sandbox costs the
    daemon nothing). Sinks hand it work with ``call``; it runs timers (a sink over its
    rate, a loss to note) in the same thread."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self.sel.register(self._r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="trace-sinks", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn in the hub's thread (soon)."""
        with self._lock:
            self._calls.append(fn)
        with contextlib.suppress(BlockingIOError, OSError):
            self._w.send(b"x")

    def call_wait(self, fn: Callable[[], None], timeout: float) -> bool:
        """Run fn in the hub's thread and wait for it (from another thread); False if it
        had not run within timeout."""
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self.call(run)
        return done.wait(timeout)

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """(In the hub's thread) run fn after delay seconds."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn))

    def _run(self) -> None:
        while True:
            wait = None if not self._timers else max(0.0,
                                                     self._timers[0][0] - time.monotonic())
            for key, _ in self.sel.select(wait):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        while self._r.recv(4096):
                            pass
                    continue
                self._guard(key.data)
            while True:
                with self._lock:
                    if not self._calls:
                        break
                    fn = self._calls.popleft()
                self._guard(fn)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                self._guard(heapq.heappop(self._timers)[2])

    @staticmethod
    def _guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("trace sink")


_hub: _Hub | None = None
_hub_lock = threading.Lock()


def hub() -> _Hub:
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = _Hub()
        return _hub


class Sink:
    """One sandbox's listener and its trace session (read by the shared hub thread)."""

    def __init__(self, sid: str, path: Path, audit: AuditLog, cpuos_points: bool = True
                 ) -> None:
        self.sid, self.path, self.audit = sid, path, audit
        self.cpuos_points = cpuos_points
        self.connections = 0  # Sentries that connected (a restore is a new one)
        self.messages = 0  # messages read (a batch is one)
        self.points = 0  # points recorded (a coalesced one counts as many as it stands for)
        self.wakeups = 0  # times the hub read this socket (several messages each)
        self._hub = hub()
        self._stopped = False
        self._done = threading.Event()
        self._conn: socket.socket | None = None
        self._hello_deadline = 0.0
        # the session's reading state (set at its handshake)
        self._tokens, self._last = BURST, 0.0
        self._seen_dropped = 0  # the Sentry's count in the last header read
        self._lost = self._malformed = 0  # not yet in a dropped row (one a second at most)
        self._noted = 0.0
        self._note_due = False
        # messages read, not yet parsed (a busy sandbox's: READ_EVERY above)
        self._spool: collections.deque[bytes] = collections.deque()
        self._spooled = 0  # their bytes
        self._spool_since = 0.0  # when the first of them was read
        self._watched = False  # the socket is in the hub's selector (else a timer is due)
        self._timer = False  # a _resume is due
        self._last_got = 0.0  # when a read last found something
        self._burst = 0  # bytes read since the last pause of BUSY_GAP between sends
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lsock.bind(str(path))
        os.chmod(path, 0o600)
        self._lsock.listen(4)
        self._lsock.setblocking(False)
        self._hub.call(self._listen)

    def close(self, wait: float = 0.0) -> None:
        """Stop listening and reading (promptly, in the hub's thread; the event loop never
        waits for it unless ``wait``)."""
        self._hub.call(self._shutdown)
        with contextlib.suppress(OSError):
            self.path.unlink()
        if wait:
            self._done.wait(wait)

    # ---- in the hub's thread -----------------------------------------------------------
    def _listen(self) -> None:
        if not self._stopped:
            self._hub.sel.register(self._lsock, selectors.EVENT_READ, self._accept)

    def _shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._conn is not None and not self._hello_deadline:
                # what the Sentry sent before it stopped (its last batch, a quieting
                # sandbox's spool) is on record before the session ends
                for _ in range(4):  # (bounded: a Sentry still sending does not hold the hub)
                    self._parse(everything=True)
                    # (a read that meets the socket's end ends the session)
                    if self._conn is None or not self._read(drain=True, final=True):
                        break
                self._parse(everything=True)
        finally:
            if self._conn is not None:
                self._end()
            with contextlib.suppress(KeyError, ValueError):
                self._hub.sel.unregister(self._lsock)
            self._lsock.close()
            self._done.set()

    def _accept(self) -> None:
        try:
            conn, _ = self._lsock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._shutdown()
            return
        # one session at a time (another Sentry waits in the backlog until it ends)
        self._hub.sel.unregister(self._lsock)
        conn.setblocking(False)
        self._conn = conn
        self._hello_deadline = time.monotonic() + 10.0
        self._hub.sel.register(conn, selectors.EVENT_READ, self._hello)
        self._hub.later(10.0, functools.partial(self._hello_timeout, conn))

    def _hello_timeout(self, conn: socket.socket) -> None:
        if self._conn is conn and self._hello_deadline:
            log.warning("trace sink of %s: no handshake within 10s", self.sid)
            self._end(session=False)

    def _hello(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            hello = conn.recv(10240)  # runsc's Handshake (the version it speaks)
            if not hello:
                raise ConnectionError("closed before its handshake")
            theirs = pb.Handshake.FromString(hello)
            conn.send(pb.Handshake(version=1).SerializeToString())
        except BlockingIOError:
            return
        except Exception as e:
            log.warning("trace sink of %s: handshake failed: %s", self.sid, e)
            self._end(session=False)
            return
        self._hello_deadline = 0.0
        self.connections += 1
        log.info("trace session of %s connected (sink version %d)", self.sid, theirs.version)
        self._tokens, self._last = BURST, time.monotonic()
        self._seen_dropped = self._lost = self._malformed = 0
        self._noted, self._note_due = time.monotonic(), False
        self._spool.clear()
        self._spooled, self._watched, self._timer = 0, True, False
        self._hub.sel.modify(conn, selectors.EVENT_READ, self._read)

    def _read(self, drain: bool = False, final: bool = False) -> int:
        """What arrived, up to a batch (the others' turn comes next), into the spool; then
        parse it if the sandbox is quiet (or ``drain``: everything there is, now), else look
        again in READ_EVERY. At most RATE points a second are parsed: over it, what is read
        waits in the spool, and once the spool is full the socket is not read (its buffer
        fills and the Sentry drops and counts what does not fit, at no cost to the daemon).
        ``final``: the session is ending: read a spool's worth whatever the rate. The bytes
        read."""
        conn = self._conn
        assert conn is not None
        self.wakeups += 1
        self._refill()
        got = 0
        for _ in range(BATCH if not drain else 1 << 30):
            if self._spooled >= SPOOL_BYTES or (self._spool and self._tokens < 1
                                                 and not final):
                break
            try:
                data, _, flags, _ = conn.recvmsg(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # the Sentry is gone (sandbox stopped, checkpointed, killed)
                self._parse(everything=True)
                self._end()
                return got
            if flags & socket.MSG_TRUNC:  # (cut by the socket: counted, not kept)
                self.messages += 1
                self._malformed += 1
                continue
            if not self._spool:
                self._spool_since = time.monotonic()
            self._spool.append(data)
            self._spooled += len(data)
            got += len(data)
        now = time.monotonic()
        if got:
            if now - self._last_got >= BUSY_GAP:
                self._burst = 0
            self._burst += got
            self._last_got = now
        busy = (got > 0 and self._burst >= BUSY_BYTES and not drain
                and self._spooled < SPOOL_BYTES and now - self._spool_since < DEFER_MAX)
        if not busy:
            self._parse()
        self._maybe_note()
        if busy or self._spool:  # look again later (the spool's rest: when tokens come)
            if self._watched:
                self._watched = False
                self._hub.sel.unregister(conn)
            if not self._timer:
                self._timer = True
                wait = READ_EVERY if busy else min(0.2, max(READ_EVERY,
                                                            (1 - self._tokens) / RATE))
                self._hub.later(wait, functools.partial(self._resume, conn))
        elif not self._watched:
            self._watched = True
            self._hub.sel.register(conn, selectors.EVENT_READ, self._read)
        return got

    def _resume(self, conn: socket.socket) -> None:
        """A while later: read what came meanwhile (none: the sandbox has quieted, and the
        spool is parsed)."""
        if self._conn is conn:
            self._timer = False
            if not self._stopped:
                self._read()

    def drain(self) -> None:
        """(In the hub's thread) read what the socket holds and parse it all now (within
        RATE): an audit query sees what happened up to now."""
        if self._conn is not None and not self._stopped and not self._hello_deadline:
            self._read(drain=True)

    def _parse(self, everything: bool = False) -> None:
        """The spool's messages, oldest first, while tokens last (``everything``: all of
        them: the session is ending)."""
        self._refill()
        while self._spool and (everything or self._tokens >= 1):
            data = self._spool.popleft()
            self._spooled -= len(data)
            self._tokens -= self._handle(data)

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(BURST, self._tokens + (now - self._last) * RATE)
        self._last = now

    def _maybe_note(self) -> None:
        """Losses go into a dropped row at most once a second (a timer, if none comes)."""
        if not (self._lost or self._malformed):
            return
        now = time.monotonic()
        if now - self._noted >= 1.0:
            self._note()
            self._noted = now
        elif not self._note_due:
            self._note_due = True
            conn = self._conn

            def due() -> None:
                self._note_due = False
                if self._conn is conn and conn is not None:
                    self._maybe_note()

            self._hub.later(1.0 - (now - self._noted), due)

    def _end(self, session: bool = True) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._hub.sel.unregister(conn)
            conn.close()
        if session:
            self._note()
            log.info("trace session of %s ended (%d reads, %d messages, %d points)", self.sid,
                     self.wakeups, self.messages, self.points)
        if not self._stopped:
            self._listen()

    def _handle(self, data: bytes) -> int:
        """One message from the socket (a batch of records, cpuos's sink, or one point);
        how many points it held."""
        self.messages += 1
        if len(data) < HEADER.size:
            self._malformed += 1
            return 1
        hsize, mtype, dropped = HEADER.unpack_from(data)
        if mtype != MSG_BATCH:
            self._point(data)
            return 1
        n, off = 0, hsize
        while off + LENGTH.size <= len(data):
            (size,) = LENGTH.unpack_from(data, off)
            off += LENGTH.size
            if size > len(data) - off:
                self._malformed += 1
                break
            self._point(data[off:off + size])
            off += size
            n += 1
        self._losses(dropped)
        return max(1, n)

    def _losses(self, dropped: int) -> None:
        """The Sentry's count of points it dropped, as a header carries it (it wraps at
        2^32; records of one batch may carry it slightly out of order: only a rise
        counts)."""
        diff = (dropped - self._seen_dropped) % (1 << 32)
        if 0 < diff < (1 << 31):
            self._lost += diff
            self._seen_dropped = dropped

    def _point(self, data: bytes) -> None:
        """One point: header (with the count of cpuos's extension) and message."""
        if len(data) < HEADER.size:
            self._malformed += 1
            return
        hsize, mtype, dropped = HEADER.unpack_from(data)
        self._losses(dropped)
        count = 1
        if hsize >= HEADER.size + COUNT.size and len(data) >= hsize:
            count = max(1, COUNT.unpack_from(data, HEADER.size)[0])
        try:
            got = decode(mtype, data[hsize:], count, self.cpuos_points) \
                if hsize >= HEADER.size else None
        except Exception:
            self._malformed += 1
            return
        if got is not None:
            self.points += count
            self.audit.record(self.sid, got[0], got[1])

    def _note(self) -> None:
        lost, malformed = self._lost, self._malformed
        self._lost = self._malformed = 0
        self.audit.note_dropped(self.sid, lost, "gVisor's sink (the socket's buffer was full)")
        self.audit.note_dropped(self.sid, malformed, "malformed or too large")


class Traced:
    """Wraps a gVisor backend: every sandbox it starts or restores is traced into ``audit``
    (the lifecycle calls the same methods as before)."""

    def __init__(self, inner: Backend, audit: AuditLog, sandboxes_dir: Path) -> None:
        self.inner, self.audit, self.sandboxes_dir = inner, audit, sandboxes_dir
        self.capabilities: Capabilities = dataclasses.replace(inner.capabilities)
        self.image_kind = inner.image_kind
        self.sinks: dict[str, Sink] = {}
        self._adopted = False
        info = getattr(inner, "info", None)  # the gVisor backend's Runsc
        self.cpuos_points = bool(getattr(info, "audit_points", False))
        audit.drain = self.drain

    def drain(self, timeout: float = 2.0) -> bool:
        """Every sandbox's points sent up to now parsed into the audit (what an audit query
        does first: a busy sandbox's are parsed once it quiets down); False if the hub's
        thread did not get to it within timeout."""
        sinks = list(self.sinks.values())
        if not sinks:
            return True

        def run() -> None:
            for sink in sinks:
                sink.drain()

        return hub().call_wait(run, timeout)

    def __getattr__(self, name: str) -> Any:  # what the wrapper does not change
        return getattr(self.inner, name)

    def runtime(self) -> dict[str, str]:
        return {**self.inner.runtime(), "audit": "runtime monitoring (seccheck)"}

    def _config_path(self, sid: str) -> Path:
        return self.sandboxes_dir / sid / "trace.json"

    def _prepare(self, spec: SandboxSpec) -> None:
        if spec.template_boot:
            return
        spec.dir.mkdir(parents=True, exist_ok=True)
        old = self.sinks.pop(spec.id, None)
        if old is not None:
            old.close()
        sock = spec.dir / "trace.sock"
        self.sinks[spec.id] = Sink(spec.id, sock, self.audit, self.cpuos_points)
        cfg = self._config_path(spec.id)
        cfg.write_text(json.dumps(session_config(sock, self.cpuos_points)))
        spec.trace_config = cfg

    def _drop(self, sid: str) -> None:
        sink = self.sinks.pop(sid, None)
        if sink is not None:
            sink.close()

    async def start(self, spec: SandboxSpec) -> None:
        self._prepare(spec)
        try:
            await self.inner.start(spec)
        except BaseException:
            self._drop(spec.id)
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        self._prepare(spec)
        try:
            await self.inner.restore(spec, image_dir)
        except BaseException:
            self._drop(spec.id)
            raise

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        try:
            await self.inner.checkpoint(sandbox_id, image_dir)
        finally:  # the Sentry has stopped; a restore makes a new listener
            self._drop(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        try:
            await self.inner.kill(sandbox_id)
        finally:
            self._drop(sandbox_id)

    async def running(self) -> dict[str, str]:
        live = await self.inner.running()
        if not self._adopted:  # a restarted daemon: sessions of running sandboxes re-attach
            self._adopted = True
            for sid, status in live.items():
                if status == "running" and self._config_path(sid).exists():
                    await self._reattach(sid)
        return live

    async def _reattach(self, sid: str) -> None:
        from .. import procs

        d = self.sandboxes_dir / sid
        sock = d / "trace.sock"
        self._drop(sid)
        self.sinks[sid] = Sink(sid, sock, self.audit,
                               "cpuos_coalesce" in self._config_path(sid).read_text())
        flags = getattr(self.inner, "_global_flags", None)
        if flags is None:
            return
        try:
            rc, _, err = await procs.run([*flags(), "trace", "create", "--force",
                                          f"--config={self._config_path(sid)}", sid],
                                         timeout=30)
        except TimeoutError:
            rc, err = -1, b"timed out"
        if rc != 0:
            log.warning("trace session of %s not re-attached: %s", sid,
                        err.decode(errors="replace")[-300:])
        else:
            log.info("trace session of %s re-attached", sid)

    async def close(self) -> None:
        for sid in list(self.sinks):
            self._drop(sid)
        await self.inner.close()
