"""File watching: inotify inside the sandbox (gVisor implements it, also on the overlay
root), events coalesced per path over a short window and sent in batches under the
stream's send credits. Bounded: watches per stream, entries per batch; an inotify queue
that overflowed (a host that reads slowly, a storm of changes) is reported as
``overflow`` (the client rescans), never hidden.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .protocol import ErrorCode, Kind
from .service import errcode
from .transport import Closed

if TYPE_CHECKING:
    from .agent import Agent, Handler
    from .conn import Conn

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_ISDIR = 0x01000000, 0x02000000, 0x40000000
MASK = (IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
        | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW)
EVENT = struct.Struct("iIII")

MAX_WATCHES = 8192
MAX_BATCH = 1000  # entries per frame
WINDOW = 0.05  # s: events of one path within this are one
_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class Watch:
    def __init__(self, conn: Conn, sid: int, path: str, recursive: bool,
                 registry: dict[int, Watch]) -> None:
        self.conn, self.sid, self.root, self.recursive = conn, sid, path, recursive
        self.cancelled = False
        self.registry = registry
        registry[sid] = self
        self.fd = -1
        self.wds: dict[int, str] = {}
        self.overflow = False
        self.pending: dict[str, dict[str, Any]] = {}
        self.done: list[dict[str, Any]] = []  # earlier events of a path, sent before pending
        self.moves: dict[int, str] = {}
        # written by cancel(): the loop sleeps on inotify and on this, nothing periodic
        self._cancel_r, self._cancel_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._cancel_lock = threading.Lock()

    def cancel(self) -> None:
        self.cancelled = True
        with self._cancel_lock:
            if self._cancel_w >= 0:
                os.write(self._cancel_w, b"c")

    def _add(self, path: str) -> bool:
        if len(self.wds) >= MAX_WATCHES:
            self.overflow = True
            return False
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), MASK)
        if wd < 0:
            return False
        self.wds[wd] = path
        return True

    def _add_tree(self, top: str, report: bool) -> None:
        """Watch the directories under top; ``report``: entries found there are new (a
        directory created and filled before its watch was in place)."""
        for root, dirs, files in os.walk(top):
            if self.cancelled:
                return
            for d in dirs:
                full = os.path.join(root, d)
                if os.path.islink(full):
                    continue
                self._add(full)
                if report:
                    self._note("create", full, True)
            if report:
                for f in files:
                    self._note("create", os.path.join(root, f), False)
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]

    def _note(self, kind: str, path: str, is_dir: bool, src: str | None = None) -> None:
        prev = self.pending.get(path)
        if prev is not None:
            if prev["type"] == "create" and kind == "modify":
                return
            if prev["type"] == "create" and kind == "delete":
                del self.pending[path]
                return
        ev: dict[str, Any] = {"type": kind, "path": path, "dir": is_dir}
        if src is not None:
            ev["from"] = src
        self.pending.pop(path, None)  # re-inserted: the batch keeps the order of last change
        self.pending[path] = ev

    def _flush(self) -> None:
        items = self.done + list(self.pending.values())
        self.done = []
        self.pending.clear()
        overflow, self.overflow = self.overflow, False
        if not items and not overflow:
            return
        for i in range(0, max(1, len(items)), MAX_BATCH):
            part = items[i:i + MAX_BATCH]
            data = json.dumps(part, separators=(",", ":")).encode()
            self.conn.send_data(self.sid, {"t": Kind.EVENTS, "id": self.sid, "n": len(part),
                                           "overflow": overflow}, data)
            overflow = False

    def _events(self, data: bytes) -> None:
        off = 0
        while off + EVENT.size <= len(data):
            wd, mask, cookie, ln = EVENT.unpack_from(data, off)
            name = os.fsdecode(data[off + EVENT.size: off + EVENT.size + ln].rstrip(b"\0"))
            off += EVENT.size + ln
            if mask & IN_Q_OVERFLOW:
                self.overflow = True
                continue
            base = self.wds.get(wd)
            if mask & IN_IGNORED:
                self.wds.pop(wd, None)
                continue
            if base is None:
                continue
            path = os.path.join(base, name) if name else base
            is_dir = bool(mask & IN_ISDIR)
            if mask & IN_CREATE:
                self._note("create", path, is_dir)
                if is_dir and self.recursive and self._add(path):
                    self._add_tree(path, True)
            elif mask & (IN_MODIFY | IN_CLOSE_WRITE):
                self._note("modify", path, is_dir)
            elif mask & IN_DELETE:
                prev = self.pending.get(path)
                if prev is not None and prev["type"] in ("create", "rename"):
                    # made or renamed in, then deleted, within the window: both are told
                    # (a write of cpuos's is a rename from its temporary name; that name's
                    # own create and move away are not)
                    self.done.append(self.pending.pop(path))
                self._note("delete", path, is_dir)
            elif mask & IN_MOVED_FROM:
                self.moves[cookie] = path
                if len(self.moves) > 1024:
                    self.moves.clear()
                self._note("delete", path, is_dir)
            elif mask & IN_MOVED_TO:
                src = self.moves.pop(cookie, None)
                if src is not None:
                    self.pending.pop(src, None)
                self._note("rename" if src else "create", path, is_dir, src)
                if is_dir and self.recursive and self._add(path):
                    self._add_tree(path, src is None)
            elif mask & (IN_DELETE_SELF | IN_MOVE_SELF) and path == self.root:
                self._note("delete", path, True)

    def run(self) -> None:
        try:
            fd = _lib().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            self.fd = fd
            wd = _lib().inotify_add_watch(fd, os.fsencode(self.root), MASK)
            if wd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), self.root)
            self.wds[wd] = self.root
            if self.recursive:
                self._add_tree(self.root, False)
            self.conn.open_stream(self.sid)
            self.conn.send({"t": Kind.OK, "id": self.sid, "watches": len(self.wds)})
            first: float | None = None
            while not self.cancelled and not self.conn.closed:
                wait = None if first is None else max(0.0, first + WINDOW - time.monotonic())
                ready, _, _ = select.select([fd, self._cancel_r], [], [], wait)
                if fd in ready:
                    try:
                        self._events(os.read(fd, 1 << 16))
                    except BlockingIOError:
                        pass
                    if first is None and (self.pending or self.overflow):
                        first = time.monotonic()
                if first is not None and time.monotonic() >= first + WINDOW:
                    self._flush()
                    first = None
                if not self.wds:  # the root is gone
                    self._flush()
                    self.conn.send({"t": Kind.EOF, "id": self.sid})
                    return
        except Closed:
            pass
        except OSError as e:
            try:
                self.conn.send({"t": Kind.ERR, "id": self.sid, "code": errcode(e),
                                "message": f"watching {self.root}: {e.strerror or e}"})
            except Closed:
                pass
        finally:
            if self.fd >= 0:
                os.close(self.fd)
            with self._cancel_lock:
                os.close(self._cancel_r)
                os.close(self._cancel_w)
                self._cancel_r = self._cancel_w = -1
            self.conn.close_stream(self.sid)
            if self.registry.get(self.sid) is self:
                self.registry.pop(self.sid, None)


def watch(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    path = h.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.INVALID, "message": "bad path"})
        return
    w = Watch(conn, sid, path, h.get("recursive") is not False, agent.watches)
    threading.Thread(target=w.run, name=f"watch-{sid}", daemon=True).start()


HANDLERS: dict[Kind, Handler] = {
    Kind.WATCH: watch,
}
