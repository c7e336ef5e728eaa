"""The sandbox's OOM killer, for gVisor: its sentry has none, so a sandbox that outgrew its
host cgroup would lose everything at once (the host kernel kills the sentry). Instead the
agent watches what gVisor charges to the sandbox (the root of its memory cgroup
hierarchy) and, at the sandbox's memory limit, ends the exec holding the most memory (its
whole cgroup), which then exits 137 with ``oom`` set — or the left-over processes of an
ended one (``nohup ... &``), if they hold more. The host's cgroup stays a little above
that limit, as the backstop for what this misses (cpuosd.backends.gvisor).

gVisor's memory cgroup offers no event to wait on (no ``cgroup.event_control``, no
``memory.events``, no inotify on its files), so the guard looks every INTERVAL, and only
while it must; otherwise it sleeps on an event (no periodic wakeup):

* while the host watches the sandbox's memory for it (``{"t": "memory", "watched": true,
  "high": ...}``, on each connection: cpuosd.lifecycle.memwatch, from the host cgroup's
  threshold events), while the host says the sandbox is high, or a command of the host's
  (a foreground exec) runs;
* otherwise (no host watch: a cgroup v2 host, a session without it) while anything
  besides the agent runs: an exec, a background command, or processes an ended exec left
  behind. Memory only grows while something runs.

In a microVM the guest kernel has its own OOM killer; this guard does not run there.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from .cgroups import Cgroup

if TYPE_CHECKING:
    from .cgroups import Cgroups

INTERVAL = 0.05  # s between looks while a command runs


def one_arena() -> None:
    """One malloc arena for all of the agent's threads (glibc gives each new thread one of
    its own, up to 8 per core, each holding its own free memory; the GIL serialises the
    agent's allocations anyway): an idle sandbox held ~1 MiB less of host memory after a
    few commands and file transfers. Called at the agent's start, before any thread (the
    spawner, forked before, keeps glibc's way: it has two threads and exits when idle)."""
    try:
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    except (AttributeError, OSError):  # (not glibc)
        pass


def give_back() -> None:
    """What the agent holds and no longer uses goes back: its cyclic garbage, then glibc's
    free heap (``malloc_trim``, which gVisor turns into pages released on the host). Called
    as the sandbox goes idle (its spawner's idle exit): after a few commands and file
    transfers an idle sandbox held ~1.8 MiB less of host memory for it. A few ms, never on
    a command's path. (Not before a checkpoint: a pause took ~5 ms more, and a sandbox
    restored from a trimmed image faults those pages in again at its first command.)"""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # (not glibc)
        pass


class Killable(Protocol):
    cgroup: Cgroup | None

    def kill(self, reason: str) -> None: ...


class MemGuard:
    """``execs()``: every command running (what it may end); ``foreground()``: whether an
    exec of the host's (not a background command) runs; ``cgroups`` holds the cgroups of
    ended execs that still have processes (the guard removes those that emptied)."""

    def __init__(self, cgroups: Cgroups, execs: Callable[[], Iterable[Killable]],
                 foreground: Callable[[], bool] = lambda: False) -> None:
        self.cgroups = cgroups
        self.execs = execs
        self.foreground = foreground
        self.host_watched = False  # the host tells us when memory is high (this session)
        self.host_high = False
        self.limit: int | None = None  # bytes (the identity message sets it)
        self.kills = 0
        self.looks = 0  # how many times it looked (tests: an idle sandbox's stays put)
        self._urgent = False  # look now (not INTERVAL after the start of a command)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memguard", daemon=True)
        self._thread.start()

    def set_limit(self, limit: int | None) -> None:
        self.limit = limit if limit and limit > 0 else None
        self._urgent = True
        self._wake.set()

    def wake(self) -> None:
        """A command started or ended: see whether to look."""
        self._wake.set()

    def host(self, watched: bool, high: bool) -> None:
        """What the host says (``watched`` False: the session ended; look for ourselves)."""
        self.host_watched, self.host_high = watched, watched and high
        self._urgent = self._urgent or self.host_high
        self._wake.set()

    def _busy(self) -> bool:
        if self.limit is None:
            return False
        if self.host_watched:
            if self.host_high or self.foreground():
                self.cgroups.gc()
                return True
            return False
        if any(True for _ in self.execs()):
            return True
        self.cgroups.gc()
        return self.cgroups.has_leftovers()

    def _run(self) -> None:
        # The first look comes INTERVAL after something starts running, not at once: a
        # command's start and end are the exec's critical moments, and a look (a read of
        # the memory cgroup, ~0.3 ms in the Sentry, and the GIL handed back and forth with
        # the exec's thread) then delayed every exec; a short command ends unlooked at,
        # which changes nothing (the host's cgroup, a little above the limit, is the
        # backstop). A wake while busy (a command started or ended) does not bring the
        # next look forward; ``_urgent`` (a new limit, the host saying memory is high) does.
        due: float | None = None
        while True:
            try:
                busy = self._busy()
            except Exception:  # never let the guard die of a read error
                busy = True
            if not busy and not self._urgent:
                # nothing runs: sleep until a command starts (or the limit changes)
                due = None
                self._wake.wait()
                self._wake.clear()
                continue
            now = time.monotonic()
            if due is None:
                due = now + INTERVAL
            if now < due and not self._urgent:
                self._wake.wait(due - now)
                self._wake.clear()
                continue
            self._urgent = False
            due = now + INTERVAL
            try:
                self.looks += 1
                self.check()
            except Exception:
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
