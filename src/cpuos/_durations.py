"""Durations: ``"15m"``, ``"2m30s"``, ``"1h"``, ``"90s"``, ``"250ms"`` or a number of seconds.
The grammar is part of the API schema shared with the daemon (cpuos_agent.protocol)."""

from __future__ import annotations

from cpuos_agent.protocol import parse_duration

__all__ = ["parse_duration"]
