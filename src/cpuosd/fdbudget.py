"""The daemon's descriptors: what connections others open may hold, and the reserve kept for
the daemon itself.

Every listener the daemon opens for sandboxes and their visitors (the preview proxy, each
sandbox's agent socket, the egress proxy) takes a descriptor from one budget per connection
it accepts (and the proxies one more per connection they open onward), gives it back when
the connection closes, and closes a connection at once when the budget is spent. The
budget is half of the process's RLIMIT_NOFILE (``raise_nofile`` lifts its soft limit to the
hard one at start): the other half is the reserve for what the daemon needs for itself —
SQLite, the audit writer, runsc and its pipes, the sandboxes' own sockets, and the API
(whose connections have a cap of their own within the reserve, ``cpuosd.api.listener``) —
so that no sandbox or client can bring the daemon to EMFILE or shut its API out (issue 25).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable

log = logging.getLogger("cpuosd.fds")

# what the daemon asks for at start where it may (root raises its hard limit too)
WANT_NOFILE = 65536
LOG_INTERVAL = 10.0


def raise_nofile(want: int = WANT_NOFILE, conn_fds: int | None = None) -> int:
    """The soft RLIMIT_NOFILE raised to ``want`` if the hard limit allows or can be raised
    (root), else to the hard limit; returns the soft limit in force. ``conn_fds``
    (CPUOS_CONN_FDS): the budget, instead of half of it."""
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != inf and hard < want:
        try:  # root may raise the hard limit too (up to fs.nr_open)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != inf else max(soft, want)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    BUDGET.resize(soft, conn_fds)
    return soft


class Budget:
    """Descriptors connections opened by others may hold (half the soft RLIMIT_NOFILE;
    ``CPUOS_CONN_FDS``, ``conn_fds``, overrides it)."""

    def __init__(self, nofile: int) -> None:
        self.limit = self.nofile = 0
        self.in_use = 0
        self.refused = 0
        self._logged = -LOG_INTERVAL
        self._sources: list[Callable[[], int]] = []
        self.resize(nofile)

    def resize(self, nofile: int, conn_fds: int | None = None) -> None:
        self.nofile = nofile
        self.limit = conn_fds if conn_fds is not None else max(64, nofile // 2)

    @property
    def reserve(self) -> int:
        """Descriptors kept for the daemon itself (its API's connections among them)."""
        return max(0, self.nofile - self.limit)

    def count(self, source: Callable[[], int]) -> None:
        """Also count what ``source`` says is held (a listener that keeps its own count)."""
        self._sources.append(source)

    def used(self) -> int:
        return self.in_use + sum(f() for f in self._sources)

    def room(self, n: int = 1) -> bool:
        """Whether n more descriptors fit (a refusal is counted and logged, rate-limited)."""
        used = self.used()
        if used + n <= self.limit:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._logged >= LOG_INTERVAL:
            self._logged = now
            log.warning("connection refused: %d of %d descriptors for connections in use "
                        "(%d refused so far)", used, self.limit, self.refused)
        return False

    def take(self, n: int = 1) -> bool:
        if not self.room(n):
            return False
        self.in_use += n
        return True

    def give(self, n: int = 1) -> None:
        self.in_use = max(0, self.in_use - n)


BUDGET = Budget(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
