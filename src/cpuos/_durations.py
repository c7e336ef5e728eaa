"""Durations: ``"15m"``, ``"2m30s"``, ``"1h"``, ``"90s"``, ``"250ms"`` or a number of seconds."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, what: str = "duration") -> float:
    """Seconds as a float; ValueError with a readable message on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a duration like '15m' or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        s = value.strip().lower().replace(" ", "")
        try:
            seconds = float(s)
        except ValueError:
            pos, seconds = 0, 0.0
            for m in _PART.finditer(s):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _UNITS[m.group(2)]
                pos = m.end()
            if pos != len(s) or not s:
                raise ValueError(
                    f"{what}: bad duration {value!r}; use e.g. '15m', '2m30s', '1h' or seconds"
                ) from None
    else:
        raise ValueError(f"{what}: expected a duration like '15m' or seconds, got {value!r}")
    if seconds != seconds or seconds <= 0 or seconds == float("inf"):
        raise ValueError(f"{what}: must be a positive duration, got {value!r}")
    return seconds
