"""The daemon runs the runsc the project builds, on the platform it says it does."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from cpuos import Sandbox
from cpuosd.backends.runsc import PINNED_VERSION, pinned_path
from support.daemon import Daemon

pytestmark = pytest.mark.e2e


def _health(daemon: Daemon) -> dict[str, str]:
    """/health as the admin sees it (the runtime is the host's business: without the admin
    key only ok, version and backend)."""
    bare = httpx.get(daemon.url + "/health", timeout=10).json()
    assert set(bare) == {"ok", "version", "backend"}
    h = httpx.get(daemon.url + "/health", timeout=10,
                  headers={"Authorization": f"Bearer {daemon.key}"}).json()
    assert isinstance(h, dict)
    return h


def test_health_names_runsc_and_platform(daemon: Daemon) -> None:
    h = _health(daemon)
    assert h["backend"] == "gvisor"
    want_platform = os.environ.get("CPUOS_RUNSC_PLATFORM") or "systrap"
    assert h["platform"] == want_platform
    out = subprocess.run([h["runsc"], "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert f"runsc version {h['runsc_version']}" in out
    if not os.environ.get("CPUOS_RUNSC") and pinned_path().exists():
        # the project's own build wins over Debian's whenever it is installed
        assert (h["runsc"], h["runsc_version"], h["runsc_source"]) == (
            str(pinned_path()), PINNED_VERSION, "pinned")


def test_sandbox_runs_on_that_runsc(daemon: Daemon, sbx: Sandbox) -> None:
    h = _health(daemon)
    # the host side: the sandbox process is that binary, on that platform
    st = subprocess.run([h["runsc"], "--root", str(daemon.home / "runsc"), "state", sbx.id],
                        capture_output=True, text=True, check=True)
    pid = json.loads(st.stdout)["pid"]
    assert os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(h["runsc"])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert f"--platform={h['platform']}".encode() in cmdline
    # the guest side: the kernel it reports is the one that runsc reports for any sandbox
    want = subprocess.run([h["runsc"], "--network=none", f"--platform={h['platform']}",
                           "--gofer-network-namespace=new", "do", "cat", "/proc/version"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    got = sbx.exec("cat /proc/version").stdout.strip()
    assert got == want
    assert re.match(r"Linux version \S+", got)
    dmesg = sbx.exec("dmesg").stdout
    assert "Starting gVisor" in dmesg


def test_stat_and_ls_work_without_a_shim(sbx: Sandbox) -> None:
    """coreutils 9 calls statx(AT_NO_AUTOMOUNT), which Debian's 2022 runsc refused (a
    preloaded shim dropped the flag); the current runsc answers it."""
    r = sbx.exec("cat /etc/ld.so.preload 2>/dev/null; stat -c '%U %s' /etc/hostname && "
                 "ls -l / >/dev/null && cp -a /etc/hostname /tmp/h && echo ok")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "ok"
    assert "statx" not in r.stdout
