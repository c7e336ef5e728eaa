"""How the agent reaches its host: a unix socket it connects out to (gVisor), or a
character device (a microVM's virtio-serial port).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import errno
import os
import select
import socket
import stat as stat_mod
import threading
import time
from typing import Any, BinaryIO, Protocol


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
    sees every session end (the socket closes).

    After a quiesce the host checkpoints the sandbox and, on resume, listens again before
    it restores it: the agent retries every RETRY for FAST_FOR seconds (frozen in the
    snapshot mid-way, the restored agent is back within RETRY). Otherwise (a daemon that is
    down or restarting) it backs off to MAX_RETRY: a hundred sandboxes whose daemon is
    down must not load the host."""

    RETRY = 0.005
    MAX_RETRY = 1.0
    FAST_FOR = 60.0  # s after a quiesce: longer than a checkpoint takes on a loaded host

    def __init__(self, path: str) -> None:
        self.path = path
        self._fast_until = 0.0

    def connect(self) -> Link:
        delay = self.RETRY
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.path)
            except OSError:
                s.close()
                if time.monotonic() < self._fast_until:
                    time.sleep(self.RETRY)
                    continue
                time.sleep(delay)
                delay = min(self.MAX_RETRY, delay * 1.5)
                continue
            self._fast_until = 0.0
            return SocketLink(s)

    def after_session(self, link: Link, quiesced: bool) -> None:
        if quiesced:  # the host removed the socket first; it is back once restored
            self._fast_until = time.monotonic() + self.FAST_FOR


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
            try:  # the host hanging up wakes it (POLLHUP): no timeout needed
                events = self._rpoll.poll()
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
