"""Sandbox events: every state transition the Manager makes is published here. Audit,
usage, metrics and the network attach as subscribers, never as branches inside the
lifecycle code."""

from __future__ import annotations

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


class EventBus:
    def __init__(self) -> None:
        self._subs: list[Subscriber] = []

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Adds fn; returns the function that removes it again."""
        self._subs.append(fn)
        return lambda: self._subs.remove(fn)

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
