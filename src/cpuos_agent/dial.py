"""``dial``: a byte stream between the host and a unix socket inside the sandbox (the code
interpreter's driver, ``cpuos_agent.interp_driver``).

The host sends ``{"t": "dial", "path": P}`` with the request's bytes as the payload; the
agent connects (as the sandbox user: its effective ids), sends them, answers ``ok``, then
forwards what the socket sends as ``data`` frames (under the stream's credits) and ends
with ``eof`` (or ``err``). A ``kill`` on the stream closes the socket. One connection per
request: nothing is sent after the payload.

Stdlib only: it runs inside every sandbox.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
from typing import TYPE_CHECKING

from . import protocol as P
from .conn import Conn
from .protocol import ErrorCode, Kind
from .service import errcode
from .transport import Closed

if TYPE_CHECKING:
    from .agent import Agent, Handler

CONNECT_TIMEOUT = 5.0


class Dial:
    def __init__(self, agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes
                 ) -> None:
        self.agent, self.conn, self.sid, self.payload = agent, conn, sid, payload
        self.path = h.get("path")
        self.sock: socket.socket | None = None
        self.closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        p = self.path
        if not isinstance(p, str) or not p.startswith("/") or "\x00" in p or len(p) > 107:
            self.conn.send({"t": Kind.ERR, "id": self.sid, "code": ErrorCode.INVALID,
                            "message": "dial needs an absolute socket path"})
            return
        self.agent.dials[self.sid] = self
        threading.Thread(target=self._main, name=f"dial-{self.sid}", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            s = self.sock
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _main(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                if self.closed:
                    return
                self.sock = s
            s.settimeout(CONNECT_TIMEOUT)
            try:
                s.connect(str(self.path))
                s.sendall(self.payload)
            except OSError as e:
                code = ErrorCode.NOT_FOUND if e.errno in (errno.ENOENT, errno.ECONNREFUSED) \
                    else errcode(e)
                self.conn.send({"t": Kind.ERR, "id": self.sid, "code": code,
                                "message": f"{self.path}: {e.strerror or e}"})
                return
            s.settimeout(None)
            self.conn.open_stream(self.sid)
            try:
                self.conn.send({"t": Kind.OK, "id": self.sid})
                while True:
                    try:
                        data = s.recv(P.CHUNK)
                    except OSError:
                        data = b""
                    if not data or self.closed:
                        break
                    self.conn.send_data(self.sid, {"t": Kind.DATA, "id": self.sid}, data)
                # no longer ours before the host hears of its end: a quiesce (pause, fork)
                # it sends once it has the EOF finds no dial still running
                self.agent.dials.pop(self.sid, None)
                self.conn.send({"t": Kind.EOF, "id": self.sid})
            finally:
                self.conn.close_stream(self.sid)
        except Closed:
            pass
        finally:
            self.agent.dials.pop(self.sid, None)
            s.close()


def dial(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    Dial(agent, conn, sid, h, payload).start()


HANDLERS: dict[Kind, Handler] = {
    Kind.DIAL: dial,
}
