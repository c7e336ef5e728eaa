"""The daemon's own log: one JSON object a line, rotated by size, and rate-limited.

Much of what the daemon logs can be triggered from inside a sandbox (a refused agent
connection, a protocol error, a failed exec): code inside must not be able to grow the log
without bound. ``RateLimit`` lets through at most ``burst`` records of one kind (logger and
message template) per ``window`` seconds and then says how many it dropped; the file
(``CPUOS_LOG_FILE``) rotates at ``CPUOS_LOG_MAX_BYTES`` keeping ``CPUOS_LOG_BACKUPS`` old
files. Without ``CPUOS_LOG_FILE`` the log goes to stderr (for a supervisor that rotates).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import threading
import time

from .config import LogsConfig


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class RateLimit(logging.Filter):
    """At most ``burst`` records per (logger, message template) per ``window`` seconds;
    the first record after a window with drops carries how many were dropped."""

    def __init__(self, burst: int = 20, window: float = 10.0, max_kinds: int = 4096) -> None:
        super().__init__()
        self.burst, self.window, self.max_kinds = burst, window, max_kinds
        self._lock = threading.Lock()
        self._kinds: dict[tuple[str, str], list[float]] = {}  # kind -> [start, n, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            st = self._kinds.get(kind)
            if st is None or now - st[0] >= self.window:
                dropped = int(st[2]) if st else 0
                if len(self._kinds) >= self.max_kinds:
                    self._kinds.clear()  # many kinds: forget them all rather than grow
                self._kinds[kind] = [now, 1, 0]
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar message(s) dropped]"
                return True
            if st[1] < self.burst:
                st[1] += 1
                return True
            st[2] += 1
            return False


def setup(level: str | None = None, path: str | None = None,
          cfg: LogsConfig | None = None) -> logging.Handler:
    """Configure the root logger once (``cfg``: CPUOS_LOG_*; ``level`` and ``path`` win
    over its level and file); returns its handler."""
    cfg = cfg or LogsConfig()
    path = path if path is not None else cfg.file
    handler: logging.Handler
    if path:
        handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=cfg.max_bytes, backupCount=cfg.backups)
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level or cfg.level)
    return handler
