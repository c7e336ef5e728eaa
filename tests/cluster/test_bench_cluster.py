"""bench/cluster.py in smoke mode (tiny N), so that it cannot rot: two nodes, an API
process, Postgres and S3 on loopback; every figure it prints is made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import testbed
from support.daemon import e2e_unavailable

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


def test_cluster_bench_smoke() -> None:
    why = e2e_unavailable() or testbed.postgres_unavailable() or testbed.s3_unavailable()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, str(REPO / "bench" / "cluster.py"), "--smoke"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "overhead" in r.stdout and "A -> B (S3)" in r.stdout, r.stdout
    out = json.loads((REPO / ".cache" / "bench" / "cluster-smoke.json").read_text())
    for k in ("exec_api_s", "exec_node_s", "stream_api_MBps", "stream_node_MBps", "stream_ratio",
              "preview_api_s", "preview_node_s", "pause_upload_s", "resume_download_s",
              "pause_local_s", "resume_local_s"):
        assert out[k] and all(v > 0 for v in out[k]), k
