"""Terminals: a command started with ``pty`` ({cols, rows}: exec.py) runs on a pty's slave;
``bg_resize`` sets the size of a running one (a background command, by pid).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import fcntl
import struct
import termios
from typing import TYPE_CHECKING

from . import protocol as P
from .bg import lookup
from .protocol import ErrorCode, Kind

if TYPE_CHECKING:
    from .agent import Agent, Handler
    from .conn import Conn


def set_winsize(fd: int, cols: object, rows: object) -> None:
    """A terminal's size (its foreground process group gets SIGWINCH); bounded."""
    c = cols if isinstance(cols, int) and 1 <= cols <= 1000 else 80
    r = rows if isinstance(rows, int) and 1 <= rows <= 1000 else 24
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", r, c, 0, 0))


def bg_resize(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    bg = lookup(agent, conn, sid, h)
    if bg is None:
        return
    fd = bg.ex.pty_fd
    if fd is None or bg.result is not None:
        conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.INVALID,
                   "message": f"{bg.pid} is not a running terminal"})
    else:
        set_winsize(fd, h.get("cols"), h.get("rows"))
        conn.send({"t": Kind.OK, "id": sid})


HANDLERS: dict[Kind, Handler] = {
    Kind.BG_RESIZE: bg_resize,
}
