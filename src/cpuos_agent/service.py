"""What the agent's services (one module each: ``control``, ``exec``, ``bg``, ``terminal``,
``files``, ``watch``, ``dial``) share: the error code an OS error maps to, and answering a
request from a thread of its own.

A handler (``agent.Handler``; each service lists its own in ``HANDLERS``) gets the agent
(the state that outlives one request: commands, transfers, readers...), the connection,
the stream id and the request (header and payload). It answers on the connection itself,
now or later (from a thread); an exception it raises is answered ``err`` by the
dispatcher (``Agent._serve``).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .protocol import ErrorCode, Kind
from .transport import Closed

if TYPE_CHECKING:
    from .conn import Conn

_ERRNO_CODES = {
    errno.ENOENT: ErrorCode.NOT_FOUND,
    errno.EACCES: ErrorCode.PERMISSION,
    errno.EPERM: ErrorCode.PERMISSION,
    errno.EROFS: ErrorCode.PERMISSION,
    errno.EEXIST: ErrorCode.EXISTS,
    errno.EISDIR: ErrorCode.IS_DIR,
    errno.ENOTDIR: ErrorCode.NOT_DIR,
    errno.ENOSPC: ErrorCode.NO_SPACE,
    errno.EDQUOT: ErrorCode.NO_SPACE,
    errno.ENAMETOOLONG: ErrorCode.INVALID,
    errno.ELOOP: ErrorCode.INVALID,
    errno.EINVAL: ErrorCode.INVALID,
    errno.ENXIO: ErrorCode.INVALID,
    errno.ENOTEMPTY: ErrorCode.EXISTS,
}


def errcode(e: OSError) -> ErrorCode:
    return _ERRNO_CODES.get(e.errno or 0, ErrorCode.INTERNAL)


def send_oserror(conn: Conn, sid: int, e: OSError, prefix: str = "") -> None:
    """Answer ``err`` for an OS error (on a connection already gone: nothing to tell)."""
    with contextlib.suppress(Closed):
        conn.send({"t": Kind.ERR, "id": sid, "code": errcode(e),
                   "message": f"{prefix}{e.strerror or e}"})


def in_thread(conn: Conn, sid: int, fn: Callable[[], Any]) -> None:
    """Answer a request from a thread of its own (it may take long: a big tree): ``ok``
    with what fn returns (fields, or fields and a payload), or ``err``."""
    def run() -> None:
        try:
            out = fn()
            fields, payload = out if isinstance(out, tuple) else (out or {}, b"")
            conn.send({"t": Kind.OK, "id": sid, **fields}, payload)
        except Closed:
            pass
        except OSError as e:
            send_oserror(conn, sid, e)
        except Exception as e:
            with contextlib.suppress(Closed):
                conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.INTERNAL,
                           "message": f"{type(e).__name__}: {e}"})
    threading.Thread(target=run, daemon=True).start()
