"""The API's HTTP listener: uvicorn's protocol with the bounds it lacks (issue 25).

uvicorn holds a connection that sends nothing for ever (its keep-alive timeout starts only
after a first response), lets a request head grow without bound (httptools has no limit),
and ``limit_concurrency`` answers 503 only once a request has arrived, the connection
already held. Here:

- at most ``CPUOS_API_MAX_CONNECTIONS`` connections (WebSockets included) at once, and at
  most a quarter of the descriptors the daemon keeps for itself (``cpuosd.fdbudget``: what
  sandboxes and preview visitors hold never counts here, so they cannot shut the API out):
  past that a new connection is closed at once;
- a request head must arrive whole within ``CPUOS_API_HEAD_TIMEOUT`` s of its first byte and
  be at most ``MAX_HEAD`` bytes, else the connection is closed;
- between requests, and before its first byte, a connection is kept ``CPUOS_API_KEEPALIVE``
  s (310: longer than the clients' own pools keep one, E2B's SDK 300 s, so a client never
  reuses a connection the daemon is closing; a browser opens connections ahead of its
  requests and may use one ~10 s later, so a deadline from the connect would cut a request
  sent just then, which a browser does not resend); when the cap is reached, such an idle
  connection (kept alive, or silent since it was made) is closed to make room for a new one,
  so connections that send nothing never keep a client out.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..config import ApiConfig
from ..fdbudget import BUDGET

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base  # type: ignore[assignment]

log = logging.getLogger("cpuosd.api")

MAX_HEAD = 64 * 1024
HEAD_SLICE = 8 * 1024
LOG_INTERVAL = 10.0

class Refusals:
    """Connections a listener refused or cut, logged at most once per LOG_INTERVAL (one per
    listener: ``guarded_http``)."""

    def __init__(self) -> None:
        self.count = 0
        self._logged = -LOG_INTERVAL

    def note(self, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged >= LOG_INTERVAL:
            self._logged = now
            log.warning("API connection closed: %s (%d so far)", why, self.count)


class GuardedHTTP(_Base):
    """uvicorn's HTTP protocol with a connection cap, a head deadline, a head size and a
    deadline for a connection that never sends (``guarded_http`` sets the cap and the
    deadlines from the configuration)."""

    max_connections: int = ApiConfig.max_connections
    head_timeout: float = ApiConfig.head_timeout
    keepalive: float = ApiConfig.keepalive
    refusals: Refusals  # (set by guarded_http)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # every API connection: HTTP, and WebSockets once upgraded (uvicorn keeps both in
        # this one set)
        conns = self.connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._silent_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        cap = min(self.max_connections, max(16, BUDGET.reserve // 4))
        if len(conns) >= cap:
            idle = next((c for c in conns if isinstance(c, GuardedHTTP) and c._idle()), None)
            if idle is None:
                self.refusals.note(f"{len(conns)} connections open (at most {cap})")
                transport.abort()
                return
            idle.transport.close()  # an idle one makes way (between requests, or silent)
            idle._end_silence()
            conns.discard(idle)
        super().connection_made(transport)
        # nothing sent yet: kept as long as an idle kept-alive connection (uvicorn's own
        # keep-alive timer starts only after a first response); the head's deadline starts
        # with its first byte (data_received)
        self._silent_timer = self.loop.call_later(self.keepalive, self._silent_timeout)

    def _idle(self) -> bool:
        """Between requests (its last answer sent, no new request begun) or silent since it
        was made."""
        if self.transport.is_closing():
            return False
        if self._silent_timer is not None:
            return True
        cycle = getattr(self, "cycle", None)
        return cycle is not None and cycle.response_complete and self._head_timer is None

    def _end_silence(self) -> None:
        if self._silent_timer is not None:
            self._silent_timer.cancel()
            self._silent_timer = None

    def _silent_timeout(self) -> None:
        self._silent_timer = None
        self.transport.close()

    def _start_head(self) -> None:
        self._head_bytes = 0
        if self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timeout)

    def _end_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        self.refusals.note(f"no whole request head within {self.head_timeout:.0f}s")
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self._end_silence()
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self._head_timer is None:
            self._start_head()  # the first bytes of the next request on this connection
        if self._head_timer is None:  # a body, or a WebSocket's frames: as they come
            super().data_received(data)
            return
        # in a head: fed in slices, each counted while the head goes on (httptools keeps
        # an unfinished header inside itself, where no callback shows it)
        view = memoryview(data)
        for i in range(0, len(data), HEAD_SLICE):
            before = self.cycle
            super().data_received(bytes(view[i:i + HEAD_SLICE]))
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                self._end_head()
                return
            if self._head_timer is None or self.cycle is not before:
                self._end_head()  # the head is whole: the rest as it is
                if len(data) > i + HEAD_SLICE:
                    super().data_received(bytes(view[i + HEAD_SLICE:]))
                return
            self._head_bytes += min(HEAD_SLICE, len(data) - i)
            if self._head_bytes > MAX_HEAD:
                self._end_head()
                self.refusals.note(f"request head over {MAX_HEAD} bytes")
                self.transport.abort()
                return

    # httptools' callbacks (h11, the fallback, has none and bounds a head itself): a head
    # begins (also one pipelined behind a request in progress) and ends
    def on_message_begin(self) -> None:
        self._start_head()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._end_head()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        self._end_silence()
        if getattr(self, "transport", None) is None:
            return  # refused in connection_made
        super().connection_lost(exc)


def guarded_http(cfg: ApiConfig) -> type[GuardedHTTP]:
    """The protocol class for uvicorn (``http=``), with ``cfg``'s cap and deadlines."""
    return type("GuardedHTTP", (GuardedHTTP,), {"max_connections": cfg.max_connections,
                                               "head_timeout": cfg.head_timeout,
                                               "keepalive": cfg.keepalive,
                                               "refusals": Refusals()})
