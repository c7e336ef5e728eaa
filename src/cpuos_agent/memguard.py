"""The sandbox's OOM killer, for gVisor: its sentry has none, so a sandbox that outgrew its
host cgroup would lose everything at once (the host kernel kills the sentry). Instead the
agent watches what gVisor charges to the sandbox (the root of its memory cgroup
hierarchy) and, at the sandbox's memory limit, ends the exec holding the most memory (its
whole cgroup), which then exits 137 with ``oom`` set — or the left-over processes of an
ended one (``nohup ... &``), if they hold more. The host's cgroup stays a little above
that limit, as the backstop for what this misses (cpuosd.backends.gvisor).

In a microVM the guest kernel has its own OOM killer; this guard does not run there.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from .cgroups import Cgroup

if TYPE_CHECKING:
    from .cgroups import Cgroups

INTERVAL = 0.05  # s between looks while a command runs


class Killable(Protocol):
    cgroup: Cgroup | None

    def kill(self, reason: str) -> None: ...


class MemGuard:
    def __init__(self, cgroups: Cgroups, execs: Callable[[], Iterable[Killable]]) -> None:
        self.cgroups = cgroups
        self.execs = execs
        self.limit: int | None = None  # bytes (the identity message sets it)
        self.kills = 0
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memguard", daemon=True)
        self._thread.start()

    def set_limit(self, limit: int | None) -> None:
        self.limit = limit if limit and limit > 0 else None
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(INTERVAL)
            self._wake.clear()
            try:
                self.check()
            except Exception:  # never let the guard die of a read error
                pass

    def check(self) -> bool:
        """One look: True if an exec was ended."""
        limit = self.limit
        if limit is None:
            return False
        used = self.cgroups.memory_usage()
        if used is None or used < limit:
            return False
        biggest: Killable | Cgroup | None = None
        most = 0
        for e in self.execs():
            u = self.cgroups.memory_usage(e.cgroup) if e.cgroup is not None else None
            if u is not None and u > most:
                biggest, most = e, u
        for cg in self.cgroups.leftovers():
            u = self.cgroups.memory_usage(cg)
            if u is not None and u > most:
                biggest, most = cg, u
        if biggest is None:
            return False
        self.kills += 1
        if isinstance(biggest, Cgroup):
            self.cgroups.kill(biggest)  # an ended exec's left-over processes
        else:
            biggest.kill("oom")
        return True
