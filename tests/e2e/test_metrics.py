"""GET /sandboxes/{id}/metrics (sbx.metrics()): what the host measures of a sandbox, checked
against load made inside it (CPU burnt, memory held, processes started)."""

from __future__ import annotations

from typing import Any

import pytest

from cpuos import Sandbox
from support.daemon import Daemon, wait_until

pytestmark = pytest.mark.e2e

HOLD = ("import subprocess, time\n"
        "x = bytearray(200 << 20)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "ps = [subprocess.Popen(['sleep', '300']) for _ in range(20)]\n"
        "t = time.time()\n"
        "while time.time() - t < 1.5: pass\n"
        "open('/tmp/held', 'w').close()\n"
        "time.sleep(300)\n")


def test_metrics_follow_the_load(daemon: Daemon) -> None:
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        idle = s.metrics()
        assert idle["state"] == "running" and idle["pids_limit"] == 512
        assert idle["memory_limit_bytes"] == 2048 << 20
        for k in ("cpu_seconds", "memory_bytes", "pids"):
            assert idle[k] >= 0, k
        s.files.write("/work/hold.py", HOLD)
        s.exec("nohup python3 /work/hold.py >/dev/null 2>&1 &")
        wait_until(lambda: s.files.exists("/tmp/held"), "the load to be in place", 60)
        busy: dict[str, Any] = s.metrics()
        assert busy["cpu_seconds"] >= idle["cpu_seconds"] + 1.0, (idle, busy)
        assert busy["memory_bytes"] >= idle["memory_bytes"] + (150 << 20), (idle, busy)
        assert busy["pids"] > idle["pids"], (idle, busy)
        assert 0 < busy["cpu_percent_avg"]
        s.pause()
        paused = s.metrics()
        assert paused["state"] == "paused" and paused["snapshot_bytes"] > 0
        assert "cpu_seconds" not in paused
    finally:
        s.kill()
