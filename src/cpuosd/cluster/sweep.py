"""The snapshot store's sweep, run by API processes (``--role=api`` with
CPUOS_SNAPSHOT_STORE): what a node killed mid-upload left there (an unfinished put: the
store's ``sweep``: ``.incoming-*`` directories, S3 versions no manifest names) and fork images
whose fork never released them (``fork-*``: an API process that died mid-fork), once older
than CPUOS_SNAPSHOT_SWEEP_AFTER (default 1 h, far above any transfer's bound).

One process sweeps at a time: with CPUOS_MEMBERSHIP=kubernetes the elected leader; without
it whichever holds the store's lease ``snapshot-sweep`` (Store.take_lease, one statement:
processes racing, one wins; a holder that dies lets it expire). A sweep runs every quarter
of the bound (at least every 10 min, at most every s), in a thread; a failed one is retried
at the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable
from typing import Any

from ..store import Store

log = logging.getLogger("cpuosd.cluster")

LEASE = "snapshot-sweep"


class Sweeper:
    def __init__(self, store: Store, snapstore: Any, after: float,
                 leading: Callable[[], bool | None]) -> None:
        """``snapstore``: a store with ``sweep(older_than)`` (directory or S3);
        ``leading``: whether this process leads (None: no election: the lease decides)."""
        self.store, self.snapstore, self.after, self.leading = store, snapstore, after, leading
        self.every = min(600.0, max(1.0, after / 4))
        self.holder = f"{socket.gethostname()}-{secrets.token_hex(4)}"
        self.swept: list[str] = []  # (what the last sweep removed: logs and tests)

    def _may(self) -> bool:
        lead = self.leading()
        if lead is not None:
            return lead
        return self.store.take_lease(LEASE, self.holder, 2 * self.every + 30)

    def sweep_once(self) -> list[str] | None:
        """One sweep if this process may; what it removed (None: another process sweeps)."""
        if not self._may():
            return None
        gone: list[str] = self.snapstore.sweep(self.after)
        if gone:
            log.info("snapshot store sweep: %d leftover(s) removed: %s", len(gone),
                     ", ".join(gone[:20]))
        self.swept = gone
        return gone

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sweep_once)
            except Exception as e:
                log.warning("snapshot store sweep failed: %s", e)
            await asyncio.sleep(self.every)
