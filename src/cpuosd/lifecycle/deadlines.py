"""Wall-clock deadlines: each expired sandbox is killed (or paused) in a task of its
own, so one slow or stuck kill never holds up another."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING


from ..agentconn import TransportError
from ..errors import ApiError
from .common import (_now)

if TYPE_CHECKING:
    from .manager import Manager

log = logging.getLogger("cpuosd.lifecycle")


class Deadlines:
    async def _reaper(self: Manager) -> None:
        """Deadlines: each expired sandbox is handled in a task of its own, so one slow or
        stuck kill never holds up another workspace's deadlines."""
        expiring: set[str] = set()
        while True:
            await asyncio.sleep(self.cfg.sandbox.reaper_interval)
            for sid, on_timeout in self.store.expired(_now(), node_id=self.node_id):
                if sid in expiring:
                    continue
                expiring.add(sid)
                self._spawn(self._expire(sid, on_timeout, expiring))

    async def _expire(self: Manager, sid: str, on_timeout: str, expiring: set[str]) -> None:
        log.info("sandbox %s reached its deadline (%s)", sid, on_timeout)
        try:
            if on_timeout == "pause":
                row = self.store.get_sandbox(sid)
                if row is not None:
                    try:
                        await self.pause(row.workspace_id, sid, reason="timeout")
                        self.store.update_sandbox(sid, remaining=row.spec.timeout)
                        return
                    except (ApiError, TransportError) as e:
                        log.warning("auto-pause of %s failed (%s); killing", sid, e)
            await self.kill(sid, reason="timeout")
        except Exception:
            log.exception("deadline handling failed on %s", sid)
        finally:
            expiring.discard(sid)
