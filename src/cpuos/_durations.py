"""Durations: ``"15m"``, ``"2m30s"``, ``"1h"``, ``"90s"``, ``"250ms"`` or a number of seconds;
sizes: ``"1GiB"``, ``"512MiB"`` or a number of MiB. The grammar is part of the API schema
shared with the daemon (cpuos_agent.protocol)."""

from __future__ import annotations

from cpuos_agent.protocol import parse_duration, parse_size_mib

__all__ = ["parse_duration", "parse_size_mib"]
