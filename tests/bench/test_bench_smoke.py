"""Every benchmark case runs in smoke mode in the default test run, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpuosd.testing import e2e_unavailable

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_runtimes_case_smoke() -> None:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, str(REPO / "bench/cases/runtimes.py"), "--smoke",
                        "--runtimes", "pinned"], capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((REPO / ".cache/bench/runtimes-smoke.json").read_text())
    pinned = res["runtimes"]["pinned"]
    assert set(pinned["workloads"]) == {"import", "fork100", "pass20"}
    assert pinned["health"]["backend"] == "gvisor"
    for k in ("exec_s", "spawn_floor_s", "pause_s", "resume_s", "create_exec_s"):
        assert pinned[k] and all(x > 0 for x in pinned[k]), k
    assert "host memory per idle sandbox" in r.stdout


@pytest.mark.e2e
def test_bench_run_quick_every_section() -> None:
    """bench/run.py --quick runs every section (the microVM rows say when the KVM probe
    fails); a crash like the one the image renaming caused fails here."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, str(REPO / "bench/run.py"), "--quick"],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for row in ("create from snapshot", "exec 'true' round trip", "pause, 100 MiB heap",
                "create from warm pool"):
        assert row in r.stdout, row
