"""``sbx.files.watch(path, on_event)``: changes under a directory inside the sandbox, as
they happen (inotify inside, coalesced per path over 50 ms), until ``stop()``."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from cpuos_agent.protocol import CONTENT_TYPE, FrameDecoder, ProtocolError

from .._errors import CpuosError, ServerError, Unavailable, error_from
from .._models import FileEvent
from .._pumps import AsyncBeside

if TYPE_CHECKING:
    from .sandbox import _AsyncHTTP

EventCallback = Callable[[FileEvent], Any]


class AsyncWatchHandle:
    """A running watch: ``on_event`` gets each change; ``stop()`` ends it; ``error`` is
    what ended it otherwise (``Unavailable`` if the sandbox stopped answering)."""

    def __init__(self, http: _AsyncHTTP, path: str, on_event: EventCallback) -> None:
        self._http, self.path, self.on_event = http, path, on_event
        self.error: CpuosError | None = None
        self.watches = 0
        self.ended = False
        self._stopped = False
        self._dec = FrameDecoder()
        self._runner: AsyncBeside | None = None

    async def _start(self, sid: str, recursive: bool) -> None:
        self._chunks: AsyncIterator[bytes] = self._http.stream(
            "GET", f"/sandboxes/{sid}/files/watch",
            params={"path": self.path, "recursive": str(recursive).lower()},
            headers={"Accept": CONTENT_TYPE})
        while True:  # until the watch is in place: what changes after this is seen
            chunk = await self._chunks.__anext__()
            frames = self._dec.feed(chunk)
            if frames:
                h = frames[0][0]
                if h.get("t") == "watching":
                    self.watches = int(h.get("watches") or 0)
                    await self._handle(frames[1:])
                    break
                raise ServerError(f"watching {self.path}: unexpected {h.get('t')!r}")
        self._runner = AsyncBeside(self._run)

    async def _handle(self, frames: list[tuple[dict[str, Any], bytes]]) -> None:
        for h, payload in frames:
            t = h.get("t")
            if t == "events":
                evs = json.loads(payload) if payload else []
                if h.get("overflow"):
                    await self._emit(FileEvent("overflow", self.path, True))
                for e in evs:
                    await self._emit(FileEvent(e["type"], e["path"], bool(e.get("dir")),
                                               e.get("from")))
            elif t == "eof":
                self.ended = True
            elif t == "error":
                self.error = error_from(None, h.get("code"), str(h.get("message")),
                                        {"path": self.path})

    async def _emit(self, ev: FileEvent) -> None:
        r = self.on_event(ev)
        if inspect.isawaitable(r):
            await r

    async def _run(self) -> None:
        try:
            async for chunk in self._chunks:
                await self._handle(self._dec.feed(chunk))
        except ProtocolError as e:
            self.error = ServerError(f"watching {self.path}: malformed stream: {e}")
        except CpuosError as e:
            if not self._stopped:
                self.error = e
        if not (self.ended or self.error or self._stopped):
            self.error = Unavailable(f"watching {self.path}: the stream ended")

    async def stop(self) -> None:
        self._stopped = True
        await self._http.close()  # its own connection: the reader ends
        if self._runner is not None:
            await self._runner.cancel()

    async def wait(self) -> None:
        """Until the watch ends (its directory is gone, or an error: raised)."""
        if self._runner is not None:
            await self._runner.join()
        if self.error is not None:
            raise self.error
