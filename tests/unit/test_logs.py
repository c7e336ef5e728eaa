"""The daemon's log: rate-limited by kind, rotated by size, one JSON object a line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cpuosd import logs
from cpuosd.config import Config


@pytest.fixture
def restore_root() -> object:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in saved:
        root.addHandler(h)
    root.setLevel(level)


def test_rate_limit_by_kind(restore_root: object, tmp_path: Path) -> None:
    cfg = Config.from_env({"CPUOS_LOG_MAX_BYTES": str(64 * 1024), "CPUOS_LOG_BACKUPS": "2"})
    path = tmp_path / "cpuosd.log"
    handler = logs.setup("INFO", str(path), cfg.logs)
    limit = next(f for f in handler.filters if isinstance(f, logs.RateLimit))
    log = logging.getLogger("cpuosd.test")
    for i in range(10_000):  # a flood of one kind, as code in a sandbox could cause
        log.warning("agent channel %s refused: %s", "/x", "x" * 200 + str(i))
    log.info('another kind "quoted"')
    lines = path.read_text().splitlines()
    assert len(lines) == limit.burst + 1
    assert json.loads(lines[-1])["msg"] == 'another kind "quoted"'
    limit.window = 0.0  # the window has passed: the next record says what was dropped
    log.warning("agent channel %s refused: %s", "/x", "y")
    last = json.loads(path.read_text().splitlines()[-1])
    assert f"[{10_000 - limit.burst} similar message(s) dropped]" in last["msg"]


def test_rotation_bounds_the_files(restore_root: object, tmp_path: Path) -> None:
    cfg = Config.from_env({"CPUOS_LOG_MAX_BYTES": str(16 * 1024), "CPUOS_LOG_BACKUPS": "2"})
    path = tmp_path / "cpuosd.log"
    logs.setup("INFO", str(path), cfg.logs)
    log = logging.getLogger("cpuosd.test")
    for i in range(2000):  # distinct kinds: not rate-limited, so rotation must bound them
        log.info(f"line {i} " + "z" * 100)
    files = sorted(tmp_path.iterdir())
    assert [p.name for p in files] == ["cpuosd.log", "cpuosd.log.1", "cpuosd.log.2"]
    assert sum(p.stat().st_size for p in files) <= 3 * 17 * 1024
