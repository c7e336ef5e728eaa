"""Sandbox events: every state transition the Manager makes is published here. Audit,
usage, metrics and the network attach as subscribers, never as branches inside the
lifecycle code."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("cpuosd.events")


@dataclass(frozen=True)
class SandboxEvent:
    kind: str  # the new state (creating, running, paused, killed, ...)
    sandbox: str
    workspace: str
    previous: str | None
    time: float = field(default_factory=time.time)
    fields: dict[str, Any] = field(default_factory=dict)


Subscriber = Callable[[SandboxEvent], None]
Settler = Callable[[float], bool]  # (timeout s) -> everything given to it is on record
SETTLE_TIMEOUT = 10.0  # s


class EventBus:
    def __init__(self) -> None:
        self._subs: list[Subscriber] = []
        self._settlers: list[Settler] = []

    def subscribe(self, fn: Subscriber, settle: Settler | None = None) -> Callable[[], None]:
        """Adds fn; returns the function that removes it again. ``settle``: for a
        subscriber that records events later than it is given them (the audit's writer
        thread), a blocking wait until what it was given is written (``settle`` below)."""
        self._subs.append(fn)
        if settle is not None:
            self._settlers.append(settle)

        def remove() -> None:
            self._subs.remove(fn)
            if settle is not None:
                self._settlers.remove(settle)
        return remove

    async def settle(self, timeout: float = SETTLE_TIMEOUT) -> bool:
        """Wait (off the event loop, at most ``timeout`` s) until every event emitted before
        the call is on record with every subscriber that records later. A node that hands
        a sandbox to the shared store calls it before it answers, so the rows of what it
        did are in the shared audit chain even if the node dies the moment after. False
        (and a warning): a recorder that did not finish in time (the caller goes on)."""
        ok = True
        for fn in list(self._settlers):
            if not await asyncio.to_thread(fn, timeout):
                log.warning("events: %r did not settle within %.0f s", fn, timeout)
                ok = False
        return ok

    def emit(self, ev: SandboxEvent) -> None:
        for fn in list(self._subs):
            try:
                fn(ev)
            except Exception:  # a subscriber's bug never breaks the lifecycle
                log.exception("event subscriber %r failed on %s", fn, ev)


# events that are not state transitions (connections, port activity, API commands and file
# writes, limit hits, a sandbox found idle before its pause: the audit trail records them)
NOT_TRANSITIONS = frozenset({"connection", "port", "network", "command", "file_write", "limit",
                             "oom", "idle"})


def log_event(ev: SandboxEvent) -> None:
    """The first subscriber: one structured log line per transition."""
    if ev.kind in NOT_TRANSITIONS:
        return
    log.info("sandbox %s: %s -> %s%s", ev.sandbox, ev.previous, ev.kind,
             f" ({ev.fields['reason']})" if ev.fields.get("reason") else "")
