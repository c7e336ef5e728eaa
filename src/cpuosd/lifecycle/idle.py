"""Auto-pause on idle: a running sandbox with an ``idle_timeout`` is paused (state
``paused``, reason ``idle``) once it has been idle that long; a call that needs the machine
wakes it again (``Manager.ready``), and so does a preview request. This module decides
when; lifecycle.wake (the Manager's side) pauses and wakes.

Idle means all of: no API call touched it (``touch``: every call that reaches the sandbox),
no stream open to its agent (exec output, a background command or terminal followed, a
file transfer, a watch), no preview connection open, and its CPU use (the host cgroup's,
averaged over the window since the last look) at most ``CPUOS_IDLE_CPU`` cores (a build
running is not idle).

Cost: nothing per sandbox between looks. One daemon-wide tick pops the sandboxes whose next
look is due from a heap (O(due)); a look reads one cgroup counter. A quiet sandbox is looked
at every ``step`` (a quarter of its timeout, 1 s to 60 s) until its timeout has passed, then
paused; a touch costs a dict update. So a sandbox is paused between ``idle_timeout`` and
``idle_timeout + step`` after its last activity, never before.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import IdleConfig

TICK = 1.0  # s between the daemon's looks at the heap
MAX_STEP = 60.0


def step_of(timeout: float) -> float:
    """How long a look's window is for a sandbox of this idle timeout."""
    return min(MAX_STEP, max(TICK, timeout / 4))


@dataclass
class _Watch:
    timeout: float
    since: float  # (monotonic) idle since then, as far as anything showed
    cpu: float | None  # CPU seconds at ``mark``
    mark: float
    gen: int
    active: bool = False  # a stream or connection was open at the last look


class IdleWatch:
    """Which running sandboxes have been idle for their timeout. No I/O of its own: ``cpu``
    reads a sandbox's CPU seconds (None: unknown), ``in_use`` says whether anything is open
    to it (streams, preview connections)."""

    def __init__(self, cpu: Callable[[str], float | None], in_use: Callable[[str], bool],
                 threshold: float = IdleConfig.cpu,  # cores: more (on average) is busy
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpu, self.in_use, self.threshold, self.clock = cpu, in_use, threshold, clock
        self.watches: dict[str, _Watch] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._gen = 0

    def _push(self, sid: str, w: _Watch, when: float) -> None:
        heapq.heappush(self._heap, (when, w.gen, sid))

    def arm(self, sid: str, timeout: float) -> None:
        """sid is running now; ``timeout`` 0 (or less): never paused for idleness."""
        self.watches.pop(sid, None)
        if timeout <= 0:
            return
        now = self.clock()
        self._gen += 1
        w = _Watch(timeout, now, self.cpu(sid), now, self._gen)
        self.watches[sid] = w
        self._push(sid, w, now + min(timeout, step_of(timeout)))

    def disarm(self, sid: str) -> None:
        self.watches.pop(sid, None)  # (its heap entry is skipped when it comes up)

    def touch(self, sid: str) -> None:
        w = self.watches.get(sid)
        if w is not None:
            w.since = self.clock()

    def idle_for(self, sid: str) -> float | None:
        """Seconds since the last activity seen (None: not watched)."""
        w = self.watches.get(sid)
        return None if w is None else self.clock() - w.since

    def timeout(self, sid: str) -> float | None:
        w = self.watches.get(sid)
        return None if w is None else w.timeout

    def rewatch(self, sid: str) -> None:
        """Look at sid again after a step (it was due, and not paused after all)."""
        w = self.watches.get(sid)
        if w is not None:
            self._gen += 1
            w.gen = self._gen
            self._push(sid, w, self.clock() + step_of(w.timeout))

    def due(self) -> list[tuple[str, float]]:
        """The sandboxes idle for their timeout as of now: (sid, CPU cores used over the
        last window). They stay watched but are not looked at again until ``rewatch``
        (the pause did not happen) or ``disarm`` (it did). Every other sandbox whose look
        was due is looked at and rescheduled."""
        now = self.clock()
        out: list[tuple[str, float]] = []
        while self._heap and self._heap[0][0] <= now:
            _, gen, sid = heapq.heappop(self._heap)
            w = self.watches.get(sid)
            if w is None or w.gen != gen:
                continue  # disarmed or re-armed since
            active = self.in_use(sid)
            cpu = self.cpu(sid)
            rate = 0.0
            if cpu is not None and w.cpu is not None and now > w.mark:
                rate = max(0.0, cpu - w.cpu) / (now - w.mark)
            busy = rate > self.threshold
            if busy or active or w.active:
                # (a stream seen open at the last look may have ended any time since)
                w.since = now
            w.cpu, w.mark, w.active = cpu, now, active
            if now - w.since >= w.timeout:
                out.append((sid, rate))
                continue
            self._push(sid, w, min(w.since + w.timeout, now + step_of(w.timeout)))
        return out

