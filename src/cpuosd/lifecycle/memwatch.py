"""The host's half of the agent's OOM guard (gVisor: ``cpuos_agent.memguard``).

gVisor offers the agent nothing to wait on for memory inside the sandbox, so the agent
would have to look every 50 ms for as long as any process runs there: a server left
running, the code interpreter's kernel. The host kernel does offer it: the sandbox's host
cgroup signals an eventfd when its usage crosses a threshold (cgroup v1). The daemon
watches that (half the sandbox's memory limit: the sandbox's memory, which the agent
holds to its limit, is part of its host usage) and tells the agent, on every connection,
``{"t": "memory", "watched": true, "high": ...}``; the agent then looks only while the
sandbox is above it or a command of the host's runs, and sleeps otherwise. Where the host
has no threshold events (cgroup v2) nothing is sent and the agent looks while anything
runs, as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from ..agentconn import AgentChannel, AgentGone
from ..backends.base import Backend
from ..errors import ApiError

log = logging.getLogger("cpuosd.lifecycle")


def threshold_for(memory_mib: int) -> int:
    """Host usage from which the agent's guard looks continuously: half the limit."""
    return (memory_mib << 20) // 2


class MemoryWatch:
    """One sandbox's watch: ``efd`` (the backend's eventfd, owned from here on) and
    ``usage()``, its host cgroup's memory now."""

    def __init__(self, chan: AgentChannel, efd: int, threshold: int,
                 usage: Callable[[], int | None]) -> None:
        self.chan, self.efd, self.threshold, self.usage = chan, efd, threshold, usage
        self.high = self._is_high()
        self.events = 0
        self._loop = asyncio.get_running_loop()
        self._sending: set[asyncio.Task[None]] = set()
        self._loop.add_reader(efd, self._event)
        chan.on_connect.append(self.announce)
        self.announce()

    def _is_high(self) -> bool:
        return (self.usage() or 0) >= self.threshold

    def _event(self) -> None:
        try:
            os.eventfd_read(self.efd)
        except (BlockingIOError, OSError):
            return
        self.events += 1
        high = self._is_high()
        if high != self.high:
            self.high = high
            self.announce()

    def announce(self) -> None:
        """Tell the connected agent (again: each connection starts it unwatched)."""
        t = self._loop.create_task(self._send(self.high))
        self._sending.add(t)
        t.add_done_callback(self._sending.discard)

    async def _send(self, high: bool) -> None:
        with contextlib.suppress(AgentGone, ApiError):
            await self.chan.send({"t": "memory", "id": 0, "watched": True, "high": high})

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.chan.on_connect.remove(self.announce)
        self._loop.remove_reader(self.efd)
        os.close(self.efd)
        for t in self._sending:
            t.cancel()


def start(chan: AgentChannel, sandbox_id: str, memory_mib: int, backend: Backend
          ) -> MemoryWatch | None:
    """A watch on the sandbox's host memory, if the backend offers one (gVisor on a cgroup
    v1 host)."""
    threshold = threshold_for(memory_mib)
    efd = backend.memory_watch(sandbox_id, threshold)
    if efd is None:
        return None
    w = MemoryWatch(chan, efd, threshold, lambda: backend.memory_usage(sandbox_id))
    log.debug("%s: host memory watch at %d MiB (high: %s)", sandbox_id, threshold >> 20,
              w.high)
    return w
