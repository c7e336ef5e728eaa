"""Issue 23: E2B's own JS SDKs (npm ``e2b``, ``@e2b/code-interpreter``, pinned in
tests/e2b/js/package.json) against the session's real daemon: ``npm ci`` then node's test
runner on tests/e2b/js/test/, configured only by E2B's environment variables."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from support.daemon import Daemon

pytestmark = [pytest.mark.e2e]

JS = Path(__file__).parent / "js"


def _node_major() -> int:
    try:
        out = subprocess.run(["node", "-p", "process.versions.node.split('.')[0]"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def test_e2b_js_sdk(daemon: Daemon) -> None:
    if _node_major() < 20 or shutil.which("npm") is None:
        pytest.skip("E2B's JS SDK tests need node >= 20 and npm")
    lock = JS / "package-lock.json"
    stamp = JS / "node_modules" / ".cpuos-lock"
    if not stamp.exists() or stamp.read_bytes() != lock.read_bytes():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=JS, check=True,
                       timeout=600)
        stamp.write_bytes(lock.read_bytes())
    r = httpx.post(daemon.url + "/e2b/keys", headers={"X-API-Key": daemon.key})
    assert r.status_code == 201
    env = {**os.environ, "E2B_API_URL": daemon.url + "/e2b",
           "E2B_SANDBOX_URL": daemon.url + "/e2b", "E2B_API_KEY": r.json()["key"]}
    p = subprocess.run(["npm", "test"], cwd=JS, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    # node's runner's summary: every test ran and passed (none skipped)
    counts = dict(line[2:].split(" ", 1) for line in p.stdout.splitlines()
                  if line.startswith(("# pass ", "# fail ", "# skipped ", "# tests ")))
    assert counts.get("fail") == "0" and counts.get("skipped") == "0", p.stdout[-3000:]
    assert int(counts.get("pass", "0")) >= 7 and counts.get("pass") == counts.get("tests")
