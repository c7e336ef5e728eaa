"""cpuos-agent: the process inside every sandbox (PID 1, unprivileged).

Stdlib only. It reaches the host through ``CPUOS_AGENT_SOCKET``: a unix socket it
connects out to (gVisor: a host directory bind-mounted at /run/cpuos), or a character
device (microVM: the guest side of a virtio-serial port). On each host connection it says
hello, then serves requests multiplexed on that one connection: exec (streamed output,
exit status, timeout, kill of the whole process tree) and file operations. If the
connection drops it kills the commands it was running for it and reconnects.

The host never trusts anything this program sends.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import select
import selectors
import shutil
import signal
import socket
import stat as stat_mod
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Protocol

from . import protocol as P

SOCKET_PATH = os.environ.get("CPUOS_AGENT_SOCKET", "/run/cpuos/agent.sock")
EXEC_MARK = "CPUOS_EXEC_ID"
DRAIN_AFTER_EXIT = 0.25  # seconds to wait for pipe EOF once the main process exited
MAX_LIST = 10000
F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20

# A shell line made only of these, whose first word is not a shell builtin, runs without
# bash (saves a bash start, ~6 ms under gVisor); if the program is not found, bash runs it.
SIMPLE = re.compile(r"^[A-Za-z0-9_./,:+@%-]+( +[A-Za-z0-9_./,:=+@%-]+)*$")
SHELL_WORDS = {"cd", "export", "source", ".", "exit", "set", "unset", "alias", "exec", "eval",
               "read", "ulimit", "umask", "wait", "trap", "shopt", "type", "hash", "command",
               "builtin", "declare", "local", "let", "times", "jobs", "fg", "bg", "history"}


def _argv_for(h: P.Header) -> tuple[list[str], list[str] | None]:
    """(argv to try first, fallback argv) for an exec request."""
    shell = h.get("shell")
    if isinstance(shell, str):
        full = ["/bin/bash", "-c", shell]
        if SIMPLE.fullmatch(shell) and shell.split()[0] not in SHELL_WORDS:
            return shell.split(), full
        return full, None
    argv = h.get("argv")
    if isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv):
        return argv, None
    raise ValueError("exec needs 'shell' (a string) or 'argv' (a non-empty list of strings)")


def _errcode(e: OSError) -> str:
    return {
        errno.ENOENT: P.E_NOT_FOUND,
        errno.EACCES: P.E_PERMISSION,
        errno.EPERM: P.E_PERMISSION,
        errno.EROFS: P.E_PERMISSION,
        errno.EEXIST: P.E_EXISTS,
        errno.EISDIR: P.E_IS_DIR,
        errno.ENOTDIR: P.E_NOT_DIR,
        errno.ENOSPC: P.E_NO_SPACE,
        errno.EDQUOT: P.E_NO_SPACE,
        errno.ENAMETOOLONG: P.E_INVALID,
        errno.ELOOP: P.E_INVALID,
        errno.ENOTEMPTY: P.E_EXISTS,
    }.get(e.errno or 0, P.E_INTERNAL)


class Closed(Exception):
    pass


class Quiesce(Exception):
    """The host is about to checkpoint: drop the connection (a checkpoint cannot carry a
    host connection) and reconnect when a socket is there again (after the restore)."""


class Link(Protocol):
    """One host connection (a session) of a ``Transport``.

    ``rfile.read(n)`` returns up to n bytes, b"" once the session is over (the serving
    thread is its only reader); ``sendall`` (any thread) raises OSError once it is over;
    ``close`` (the serving thread, idempotent) ends it, and a writer blocked in
    ``sendall`` then gives up."""

    @property
    def rfile(self) -> Any: ...

    def sendall(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Transport:
    """How the agent reaches its host: ``connect`` blocks until a host is there and returns
    a new session; ``after_session`` runs once a session is over (and closed). ``kind``
    goes to the host in the hello: a ``device`` agent cannot hang up its host."""

    kind = "socket"

    def connect(self) -> Link:
        raise NotImplementedError

    def after_session(self, link: Link, quiesced: bool) -> None:
        pass


class SocketLink:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile: BinaryIO = sock.makefile("rb", buffering=1 << 20)  # type: ignore[assignment]

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.rfile.close()  # makefile() holds a reference: the fd closes only with both
        self.sock.close()


class UnixSocketTransport(Transport):
    """Connect out to a unix socket the host listens on; retry until it is there. The host
    sees every session end (the socket closes)."""

    RETRY = 0.005  # the host is waiting for us after a restore: come back quickly
    MAX_RETRY = 1.0

    def __init__(self, path: str) -> None:
        self.path = path

    def connect(self) -> Link:
        # quickly at first (the host is waiting for us after a restore), then backing off to
        # MAX_RETRY: a hundred sandboxes whose daemon is down must not load the host
        delay = self.RETRY
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.path)
            except OSError:
                s.close()
                time.sleep(delay)
                delay = min(self.MAX_RETRY, delay * 1.5)
                continue
            return SocketLink(s)

    def after_session(self, link: Link, quiesced: bool) -> None:
        if quiesced:
            time.sleep(self.RETRY)  # the host removed the socket first; retry until restored


_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL
# read/write errors that mean the device is hung up (EIO: a pty whose master closed;
# ENODEV: a hot-unplugged virtio port)
_HANGUP_ERRNOS = (errno.EIO, errno.ENODEV, errno.EPIPE, errno.ENXIO)


class DeviceLink:
    """One host session over a character device (opened non-blocking by the transport).

    virtio-serial semantics (drivers/char/virtio_console.c): while the host end is not
    connected, poll() reports POLLHUP (and POLLIN), read() returns 0 once the buffered
    input is consumed and write() would block; what the guest writes meanwhile is dropped
    by QEMU. So POLLHUP, a 0-byte read or EIO/ENODEV end the session, on either side."""

    CHUNK = 1 << 16
    WAIT = 0.2  # s: longest a blocked writer takes to notice close()

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.hungup = False
        self.closed = False
        self._buf = bytearray()
        self._rpoll = select.poll()
        self._rpoll.register(fd, select.POLLIN)
        self._wpoll = select.poll()
        self._wpoll.register(fd, select.POLLOUT)
        self._wlock = threading.Lock()  # one writer at a time; close() waits for it
        self.rfile = self

    def read(self, n: int) -> bytes:
        """Up to n bytes (at least one), b"" at the end of the session. The serving thread
        is the only reader (and the one that closes the link)."""
        while not self._buf:
            if self.closed or self.hungup:
                return b""
            try:
                events = self._rpoll.poll(1000)
            except InterruptedError:
                continue
            if not events:
                continue
            ev = events[0][1]
            if ev & _HANGUP:
                self.hungup = True
                return b""
            try:
                data = os.read(self.fd, max(n, self.CHUNK))
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno in _HANGUP_ERRNOS:
                    self.hungup = True
                    return b""
                raise
            if not data:
                self.hungup = True
                return b""
            self._buf += data
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        with self._wlock:
            while view:
                if self.closed or self.hungup:
                    raise BrokenPipeError(errno.EPIPE, "host session is over")
                try:
                    n = os.write(self.fd, view[: self.CHUNK])
                except BlockingIOError:
                    try:
                        events = self._wpoll.poll(int(self.WAIT * 1000))
                    except InterruptedError:
                        continue
                    if events and events[0][1] & _HANGUP:
                        self.hungup = True
                    continue
                except OSError as e:
                    if e.errno in _HANGUP_ERRNOS:
                        self.hungup = True
                    raise
                view = view[n:]

    def close(self) -> None:
        self.closed = True
        with self._wlock:  # no writer is inside os.write() on this fd any more
            if self.fd >= 0:
                try:
                    os.close(self.fd)
                finally:
                    self.fd = -1


class CharDeviceTransport(Transport):
    """The guest side of a virtio-serial port (``/dev/vportNpM``,
    ``/dev/virtio-ports/<name>``); QEMU connects to the host's socket and reconnects.

    Every session opens the device afresh (opening discards input left over from the
    previous host; a device that stays hung up, e.g. a pty or a re-plugged port, is
    reopened too), waits until the host end is connected (no POLLHUP) and the agent then
    sends a fresh hello: the host sees a new connection where a new session begins. The
    agent cannot close the host's end: after a quiesce it waits (a bounded time) for the
    host to hang up, so the next session starts on a new host connection."""

    kind = "device"
    POLL = 0.05  # s between checks while the host is away
    FAST_POLL = 0.003  # s between checks for the first FAST_FOR seconds (a restore, a clone)
    FAST_FOR = 1.0
    REOPEN = 1.0  # s of hang-up after which the device is reopened
    # s: after a quiesce, how long to wait for the host to hang up. The daemon hangs up at
    # once; a snapshot taken before we saw that is restored "connected", so this is also
    # what such a restored or cloned agent loses before its hello
    HANGUP_WAIT = 1.0

    def __init__(self, path: str) -> None:
        self.path = path

    def _try_open(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:  # not there (yet), busy, or a hung-up pty
            return None

    def _open(self) -> int:
        while True:
            fd = self._try_open()
            if fd is not None:
                return fd
            time.sleep(self.POLL)

    @staticmethod
    def _host_connected(fd: int) -> bool:
        p = select.poll()
        p.register(fd, select.POLLIN | select.POLLOUT)
        try:
            events = p.poll(0)
        except InterruptedError:
            return False
        return not (events and events[0][1] & _HANGUP)

    def connect(self) -> Link:
        fd = self._open()
        since = first = time.monotonic()
        while not self._host_connected(fd):
            # the host comes back quickly after a quiesce (a restored or cloned VM): check
            # often at first, then settle to POLL (a host that is away costs little)
            time.sleep(self.FAST_POLL if time.monotonic() - first < self.FAST_FOR
                       else self.POLL)
            if time.monotonic() - since >= self.REOPEN:
                os.close(fd)
                fd = self._open()
                since = time.monotonic()
        return DeviceLink(fd)

    def after_session(self, link: Link, quiesced: bool) -> None:
        if not isinstance(link, DeviceLink) or link.hungup:
            return
        # we ended the session (quiesce, or a protocol error): the host may still be
        # connected; give it time to hang up, else the next hello goes to the same host
        fd = self._try_open()
        if fd is None:
            return
        try:
            deadline = time.monotonic() + self.HANGUP_WAIT
            while self._host_connected(fd) and time.monotonic() < deadline:
                time.sleep(self.FAST_POLL)
        finally:
            os.close(fd)


def transport_for(path: str) -> Transport:
    """A character device (or a path under /dev, which may not be there yet): the
    virtio-serial transport; anything else: a unix socket."""
    try:
        if stat_mod.S_ISCHR(os.stat(path).st_mode):
            return CharDeviceTransport(path)
    except OSError:
        pass
    if path.startswith("/dev/"):
        return CharDeviceTransport(path)
    return UnixSocketTransport(path)


class Conn:
    """One connection to the host: a locked sender and per-stream send credits."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.rfile: Any = link.rfile
        self._send_lock = threading.Lock()
        self._credit_cv = threading.Condition()
        self._credit: dict[int, int] = {}
        self.closed = False

    def send(self, header: P.Header, payload: bytes = b"") -> None:
        data = P.encode(header, payload)
        with self._send_lock:
            if self.closed:
                raise Closed()
            try:
                self.link.sendall(data)
            except OSError:
                self.closed = True
                raise Closed() from None

    # flow control for agent -> host stream data
    def open_stream(self, sid: int) -> None:
        with self._credit_cv:
            self._credit[sid] = P.WINDOW

    def close_stream(self, sid: int) -> None:
        with self._credit_cv:
            self._credit.pop(sid, None)
            self._credit_cv.notify_all()

    def add_credit(self, sid: int, n: int) -> None:
        with self._credit_cv:
            if sid in self._credit:
                self._credit[sid] += n
                self._credit_cv.notify_all()

    def send_data(self, sid: int, header: P.Header, data: bytes) -> None:
        with self._credit_cv:
            while not self.closed and self._credit.get(sid, 0) <= 0:
                if sid not in self._credit:
                    raise Closed()
                self._credit_cv.wait(1.0)
            if self.closed:
                raise Closed()
            self._credit[sid] -= len(data)
        self.send(header, data)

    def shutdown(self) -> None:
        self.closed = True
        with self._credit_cv:
            self._credit_cv.notify_all()
        self.link.close()


class Reaper:
    """PID 1 duty: reap every child, hand exit statuses of our own spawns to their waiters.

    A child may exit before its waiter registers; such statuses are kept briefly with the
    time they were reaped, and a waiter accepts one only if it was reaped after its spawn
    began (so a recycled pid never hands over a stale status).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, tuple[threading.Event, list[int]]] = {}
        self._early: dict[int, tuple[float, int]] = {}
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def register(self, pid: int, spawned_at: float) -> tuple[threading.Event, list[int]]:
        ev = threading.Event()
        box: list[int] = []
        with self._lock:
            early = self._early.pop(pid, None)
            if early is not None and early[0] >= spawned_at:
                box.append(early[1])
                ev.set()
            else:
                self._waiters[pid] = (ev, box)
        self._wake.set()
        return ev, box

    def _run(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            except InterruptedError:
                continue
            now = time.monotonic()
            with self._lock:
                w = self._waiters.pop(pid, None)
                if w is None:  # an orphan, or one of ours not yet registered
                    self._early[pid] = (now, status)
                    if len(self._early) > 256:
                        self._early = {p: v for p, v in self._early.items() if now - v[0] < 60}
                    continue
            w[1].append(status)
            w[0].set()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parens
        rest = data[data.rfind(b")") + 2 :].split()
        if len(rest) < 2:
            continue
        kids.setdefault(int(rest[1]), []).append(int(name))
    return kids


def _session_and_group(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[4]), int(rest[3])  # session, pgrp
    except (OSError, IndexError, ValueError):
        return None


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def _members(root: int, mark: bytes) -> set[int]:
    """Every process of one exec: the root's descendants, its session and process group,
    and anything carrying the exec's environment mark (how a setsid-and-orphaned grandchild,
    reparented to PID 1, is still found)."""
    kids = _children_map()
    me = os.getpid()
    found = {root}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in (me, root):
            continue
        sg = _session_and_group(pid)
        if (sg is not None and root in sg) or _has_mark(pid, mark):
            found.add(pid)
    todo = list(found)
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in found and c != me:
                found.add(c)
                todo.append(c)
    return found


def kill_tree(root: int, mark: bytes) -> None:
    """Stop every process of the exec (stopped processes cannot fork), until no new one
    appears; then SIGKILL them all."""
    seen: set[int] = set()
    for _ in range(50):
        new = _members(root, mark) - seen
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        seen |= new
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


class Exec:
    def __init__(self, agent: Agent, conn: Conn, sid: int, h: P.Header) -> None:
        self.agent, self.conn, self.sid, self.h = agent, conn, sid, h
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed_reason: str | None = None
        self._stdin_buf: list[bytes | None] = []
        self._stdin_cv = threading.Condition()

    def start(self) -> None:
        h = self.h
        try:
            argv, fallback = _argv_for(h)
        except ValueError as e:
            self.conn.send({"t": "err", "id": self.sid, "code": P.E_INVALID, "message": str(e)})
            return
        env = {k: v for k, v in (h.get("env") or {}).items()
               if isinstance(k, str) and isinstance(v, str)}
        self.mark = f"{EXEC_MARK}={self.sid}-{time.monotonic_ns()}"
        env[EXEC_MARK] = self.mark.split("=", 1)[1]
        cwd = h.get("cwd") or "/work"
        use_stdin = bool(h.get("stdin"))
        spawned_at = time.monotonic()
        while True:
            try:
                self.proc = subprocess.Popen(
                    argv, cwd=cwd, env=env,
                    stdin=subprocess.PIPE if use_stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, bufsize=0,
                )
                break
            except OSError as e:
                if fallback is not None and not os.path.isdir(cwd):
                    fallback = None
                if fallback is not None:
                    argv, fallback = fallback, None
                    continue
                self.conn.send({"t": "err", "id": self.sid, "code": _errcode(e),
                                "message": f"cannot start {argv[0]!r} in {cwd!r}: {e.strerror}"})
                return
        for f in (self.proc.stdout, self.proc.stderr):
            try:  # bigger pipes: fewer, larger reads and frames for chatty commands
                fcntl.fcntl(f.fileno(), F_SETPIPE_SZ, PIPE_SIZE)  # type: ignore[union-attr]
            except OSError:
                pass
        self.started = time.monotonic()
        self.done_ev, self.status_box = self.agent.reaper.register(self.proc.pid, spawned_at)
        self.conn.open_stream(self.sid)
        self.agent.execs[self.sid] = self
        self.conn.send({"t": "started", "id": self.sid, "pid": self.proc.pid})
        if use_stdin:
            threading.Thread(target=self._stdin_pump, daemon=True).start()
        threading.Thread(target=self._run, name=f"exec-{self.sid}", daemon=True).start()

    # stdin frames arrive on the reader thread; a pump thread writes them (a full pipe must
    # never block the reader).
    def feed_stdin(self, data: bytes | None) -> None:
        with self._stdin_cv:
            self._stdin_buf.append(data)
            self._stdin_cv.notify()

    def _stdin_pump(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        while True:
            with self._stdin_cv:
                while not self._stdin_buf:
                    self._stdin_cv.wait()
                data = self._stdin_buf.pop(0)
            try:
                if data is None:
                    self.proc.stdin.close()
                    return
                self.proc.stdin.write(data)
            except OSError:
                return

    def kill(self, reason: str) -> None:
        if self.proc is None or self.done_ev.is_set():
            return
        if self.killed_reason is None:
            self.killed_reason = reason
        kill_tree(self.proc.pid, self.mark.encode())

    def _run(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        timeout = self.h.get("timeout")
        deadline = self.started + float(timeout) if timeout else None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 1)
        sel.register(proc.stderr, selectors.EVENT_READ, 2)
        open_fds = 2
        exited_at: float | None = None
        try:
            while open_fds:
                now = time.monotonic()
                if exited_at is None and self.done_ev.is_set():
                    exited_at = now
                if exited_at is not None and now - exited_at > DRAIN_AFTER_EXIT:
                    break  # background processes keep the pipes; the command itself is done
                if deadline is not None and exited_at is None and now >= deadline:
                    self.kill("timeout")
                    deadline = None
                wait = 0.05
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - now))
                for key, _ in sel.select(wait):
                    f = key.fileobj
                    try:
                        data = os.read(f.fileno(), PIPE_SIZE)  # type: ignore[union-attr]
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(f)
                        open_fds -= 1
                        continue
                    self.conn.send_data(self.sid, {"t": "out", "id": self.sid, "fd": key.data},
                                        data)
            if not self.done_ev.wait(timeout=None if deadline is None else
                                     max(0.0, deadline - time.monotonic())):
                self.kill("timeout")
                self.done_ev.wait()
            status = self.status_box[0]
            code = os.waitstatus_to_exitcode(status)
            sig = -code if code < 0 else None
            # done before the host hears of it: a quiesce right after must not see it
            self.agent.execs.pop(self.sid, None)
            self.conn.send({
                "t": "exit", "id": self.sid,
                "exit_code": 128 + sig if sig else code, "signal": sig,
                "timed_out": self.killed_reason == "timeout",
                "killed": self.killed_reason is not None,
                "duration": time.monotonic() - self.started,
            })
        except Closed:
            self.kill("disconnected")
        finally:
            sel.close()
            for f in (proc.stdout, proc.stderr):
                f.close()
            self.conn.close_stream(self.sid)
            self.agent.execs.pop(self.sid, None)


class Agent:
    def __init__(self, key: str | None = None) -> None:
        self.key = key if key is not None else read_key()
        self.reaper = Reaper()
        self.execs: dict[int, Exec] = {}
        self.writes: dict[int, tuple[BinaryIO, str, str]] = {}

    # ---- connection lifecycle -------------------------------------------------------
    def serve_forever(self, transport: Transport | None = None) -> None:
        transport = transport or transport_for(SOCKET_PATH)
        while True:
            conn = Conn(transport.connect())
            quiesced = False
            try:
                conn.send({"t": "hello", "version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                           "uid": os.getuid(), "transport": transport.kind,
                           "key": self.key})
                self._serve(conn)
            except Quiesce:
                quiesced = True
            except (Closed, P.ProtocolError, OSError):
                pass
            finally:
                conn.shutdown()
                for ex in list(self.execs.values()):
                    ex.kill("disconnected")
                for f, tmp, _ in self.writes.values():
                    f.close()
                    _unlink_quiet(tmp)
                self.writes.clear()
            transport.after_session(conn.link, quiesced)

    def _serve(self, conn: Conn) -> None:
        while True:
            fr = P.read_frame_sync(conn.rfile)
            if fr is None:
                return
            h, payload = fr
            t = h["t"]
            sid = h.get("id")
            if not isinstance(sid, int):
                sid = 0
            try:
                self._dispatch(conn, t, sid, h, payload)
            except (Closed, Quiesce):
                raise
            except OSError as e:
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{e.strerror or e}"})
            except Exception as e:  # a bad request must never take the agent down
                conn.send({"t": "err", "id": sid, "code": P.E_INTERNAL,
                           "message": f"{type(e).__name__}: {e}"})

    def _dispatch(self, conn: Conn, t: str, sid: int, h: P.Header, payload: bytes) -> None:
        if t == "ping":
            conn.send({"t": "pong", "id": sid, "time": time.time()})
        elif t == "identity":
            conn.send({"t": "identity_ok", "id": sid, "applied": apply_identity(h)})
        elif t == "quiesce":
            if self.execs or self.writes:
                conn.send({"t": "err", "id": sid, "code": P.E_EXISTS,
                           "message": "commands or file transfers are still running"})
                return
            conn.send({"t": "ok", "id": sid})
            raise Quiesce()
        elif t == "exec":
            Exec(self, conn, sid, h).start()
        elif t == "stdin":
            ex = self.execs.get(sid)
            if ex is not None:
                ex.feed_stdin(payload if payload else None)
        elif t == "kill":
            ex = self.execs.get(sid)
            if ex is not None:
                ex.kill(str(h.get("reason") or "killed"))
        elif t == "credit":
            conn.add_credit(sid, int(h.get("n", 0)))
        elif t == "write":
            self._write_open(conn, sid, h)
        elif t == "data":
            w = self.writes.get(sid)
            if w is not None:
                try:
                    w[0].write(payload)
                except OSError as e:
                    self.writes.pop(sid)
                    w[0].close()
                    _unlink_quiet(w[1])
                    conn.send({"t": "err", "id": sid, "code": _errcode(e),
                               "message": f"writing {w[2]}: {e.strerror}"})
        elif t == "eof":
            self._write_close(conn, sid, abort=bool(h.get("abort")))
        elif t == "read":
            threading.Thread(target=self._read, args=(conn, sid, h["path"]), daemon=True).start()
        elif t == "stat":
            conn.send({"t": "ok", "id": sid, "stat": _stat(h["path"])})
        elif t == "list":
            conn.send({"t": "ok", "id": sid, "entries": _list(h["path"])})
        elif t == "remove":
            _remove(h["path"], bool(h.get("recursive", True)))
            conn.send({"t": "ok", "id": sid})
        elif t == "mkdir":
            os.makedirs(h["path"], mode=0o755, exist_ok=True)
            conn.send({"t": "ok", "id": sid, "stat": _stat(h["path"])})
        else:
            conn.send({"t": "err", "id": sid, "code": P.E_INVALID, "message": f"unknown {t!r}"})

    # ---- files ----------------------------------------------------------------------
    def _write_open(self, conn: Conn, sid: int, h: P.Header) -> None:
        path: str = h["path"]
        parent = os.path.dirname(path) or "/"
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.cpuos-{sid}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.writes[sid] = (os.fdopen(fd, "wb", buffering=1 << 20), tmp, path)

    def _write_close(self, conn: Conn, sid: int, abort: bool) -> None:
        w = self.writes.pop(sid, None)
        if w is None:
            return
        f, tmp, path = w
        try:
            f.close()
            if abort:
                _unlink_quiet(tmp)
                return
            mode = None
            try:
                mode = stat_mod.S_IMODE(os.stat(path).st_mode)
            except OSError:
                pass
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quiet(tmp)
            conn.send({"t": "err", "id": sid, "code": _errcode(e), "message": f"{e.strerror}"})
            return
        conn.send({"t": "ok", "id": sid, "stat": _stat(path)})

    def _read(self, conn: Conn, sid: int, path: str) -> None:
        try:
            try:
                f = open(path, "rb", buffering=0)
            except OSError as e:
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{path}: {e.strerror}"})
                return
            with f:
                st = os.fstat(f.fileno())
                if stat_mod.S_ISDIR(st.st_mode):
                    conn.send({"t": "err", "id": sid, "code": P.E_IS_DIR,
                               "message": f"{path}: is a directory"})
                    return
                conn.open_stream(sid)
                conn.send({"t": "ok", "id": sid, "size": st.st_size})
                try:
                    while True:
                        data = f.read(P.CHUNK)
                        if not data:
                            break
                        conn.send_data(sid, {"t": "data", "id": sid}, data)
                    conn.send({"t": "eof", "id": sid})
                finally:
                    conn.close_stream(sid)
        except Closed:
            pass
        except OSError as e:
            try:
                conn.send({"t": "err", "id": sid, "code": _errcode(e), "message": str(e)})
            except Closed:
                pass


MACHINE_ID_PATH = "/run/cpuos/machine-id"  # /etc/machine-id links here (templates)
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
CLOCK_SLACK = 0.05  # s: a guest clock this close to the host's is left alone


def apply_identity(h: P.Header) -> list[str]:
    """What a sandbox gets new after every boot, restore and clone, sent by the host right
    after the hello: its hostname, its machine-id, fresh randomness (every clone of one
    snapshot would otherwise share the kernel RNG's state) and the time (a restored VM's
    clock stands where the snapshot stopped it). Applied as far as this agent may (gVisor:
    the sentry keeps the time and randomness; the host serves machine-id); returns what
    changed."""
    applied = []
    name = h.get("hostname")
    if isinstance(name, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", name):
        if name != os.uname().nodename:
            try:
                socket.sethostname(name)
                applied.append("hostname")
            except OSError:
                pass
    mid = h.get("machine_id")
    if isinstance(mid, str) and re.fullmatch(r"[0-9a-f]{32}", mid):
        try:
            with open(MACHINE_ID_PATH) as f:
                current = f.read().strip()
        except OSError:
            current = ""
        if current != mid:
            tmp = f"{MACHINE_ID_PATH}.{os.getpid()}"
            try:
                with open(tmp, "w") as f:
                    f.write(mid + "\n")
                os.chmod(tmp, 0o444)
                os.replace(tmp, MACHINE_ID_PATH)
                applied.append("machine-id")
            except OSError:
                _unlink_quiet(tmp)
    seed = h.get("seed")
    if isinstance(seed, str) and re.fullmatch(r"(?:[0-9a-f]{2}){16,256}", seed):
        data = bytes.fromhex(seed)
        try:
            fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                os.write(fd, data)  # mixed in, not credited: anyone may
                applied.append("rng")
                try:  # credited and reseeded now (CAP_SYS_ADMIN)
                    info = struct.pack("ii", len(data) * 8, len(data)) + data
                    fcntl.ioctl(fd, RNDADDENTROPY, info)
                    fcntl.ioctl(fd, RNDRESEEDCRNG)
                    applied.append("rng-reseed")
                except OSError:
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
    now = h.get("time")
    if isinstance(now, (int, float)) and abs(time.time() - now) > CLOCK_SLACK:
        try:
            time.clock_settime(time.CLOCK_REALTIME, float(now))
            applied.append("clock")
        except (OSError, OverflowError):
            pass
    return applied


def read_key(path: str = P.KEY_PATH) -> str:
    """The key the host left for this agent ("" if none: a microVM's agent, whose channel
    is a device only it can open)."""
    try:
        with open(path) as f:
            key = f.read(128).strip()
    except OSError:
        return ""
    return key if re.fullmatch(P.KEY_RE, key) else ""


def not_dumpable() -> None:
    """No process of the commands' uid may read this one's memory, fds or environment
    (/proc/1/mem, /proc/1/fd, ptrace): the agent key lives there."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def drop_inheritable_caps() -> None:
    """The microVM's /init hands the agent CAP_SYS_ADMIN and CAP_SYS_TIME (hostname,
    RNG reseed, clock) as ambient capabilities; keep them for the agent alone: clear the
    ambient and inheritable sets, so nothing it runs gets them back."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if libc.capget(hdr, data) != 0:
        return
    data[2] = data[5] = 0  # inheritable (both 32-bit halves)
    libc.capset(hdr, data)


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def _kind(mode: int) -> str:
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def _stat(path: str) -> dict[str, Any]:
    st = os.lstat(path)
    d: dict[str, Any] = {"path": path, "name": os.path.basename(path) or "/",
                         "type": _kind(st.st_mode), "size": st.st_size,
                         "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime}
    if d["type"] == "symlink":
        d["target"] = os.readlink(path)
    return d


def _list(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with os.scandir(path) as it:
        for e in it:
            if len(out) >= MAX_LIST:
                break
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append({"name": e.name, "path": os.path.join(path, e.name),
                        "type": _kind(st.st_mode), "size": st.st_size,
                        "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime})
    out.sort(key=lambda d: d["name"])
    return out


def _remove(path: str, recursive: bool) -> None:
    st = os.lstat(path)
    if stat_mod.S_ISDIR(st.st_mode):
        if recursive:
            shutil.rmtree(path)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.umask(0o022)
    sys.stdout = sys.stderr  # nothing of ours goes to a guest-visible stdout
    not_dumpable()
    drop_inheritable_caps()
    Agent().serve_forever()


if __name__ == "__main__":
    main()
