"""Wall-clock deadlines: each expired sandbox is killed (or paused) in a task of its
own, so one slow or stuck kill never holds up another."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Protocol


from ..agentconn import TransportError
from ..errors import ApiError
from ..store import SandboxRow, Store
from .common import Spawn, _now

log = logging.getLogger("cpuosd.lifecycle")


class Pause(Protocol):  # Manager.snapshots.pause
    def __call__(self, workspace_id: str, sid: str, reason: str = ...
                 ) -> Awaitable[SandboxRow]: ...


class Kill(Protocol):  # Manager.kill
    def __call__(self, sid: str, reason: str = ...) -> Awaitable[None]: ...


class Deadlines:
    """The Manager's deadline watch, given what it uses: the store (which sandboxes of
    ``node_id`` are past their deadline), how to start a task the Manager owns (``spawn``),
    and the Manager's ``pause`` and ``kill``."""

    def __init__(self, store: Store, interval: float, node_id: str | None,
                 spawn: Spawn, pause: Pause,
                 kill: Kill) -> None:
        self.store, self.interval, self.node_id = store, interval, node_id
        self._spawn, self._pause, self._kill = spawn, pause, kill

    async def run(self) -> None:
        """Deadlines: each expired sandbox is handled in a task of its own, so one slow or
        stuck kill never holds up another workspace's deadlines."""
        expiring: set[str] = set()
        while True:
            await asyncio.sleep(self.interval)
            for sid, on_timeout in self.store.expired(_now(), node_id=self.node_id):
                if sid in expiring:
                    continue
                expiring.add(sid)
                self._spawn(self._expire(sid, on_timeout, expiring))

    async def _expire(self, sid: str, on_timeout: str, expiring: set[str]) -> None:
        log.info("sandbox %s reached its deadline (%s)", sid, on_timeout)
        try:
            if on_timeout == "pause":
                row = self.store.get_sandbox(sid)
                if row is not None:
                    try:
                        await self._pause(row.workspace_id, sid, reason="timeout")
                        self.store.update_sandbox(sid, remaining=row.spec.timeout)
                        return
                    except (ApiError, TransportError) as e:
                        log.warning("auto-pause of %s failed (%s); killing", sid, e)
            await self._kill(sid, reason="timeout")
        except Exception:
            log.exception("deadline handling failed on %s", sid)
        finally:
            expiring.discard(sid)
