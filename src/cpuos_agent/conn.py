"""One host session: framing, per-stream credit-based flow control, one writer at a time.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import threading
from typing import Any

from . import protocol as P
from .transport import Closed, Link

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
                self._credit_cv.wait()  # credit, close_stream and shutdown notify
            if self.closed:
                raise Closed()
            self._credit[sid] -= len(data)
        self.send(header, data)

    def shutdown(self) -> None:
        self.closed = True
        with self._credit_cv:
            self._credit_cv.notify_all()
        self.link.close()
