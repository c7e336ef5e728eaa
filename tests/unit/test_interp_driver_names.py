"""The code interpreter's driver was ``cpuos_agent.kernel`` and is ``cpuos_agent.interp_driver``
(issue 26). Both directions of the rename keep working: a template build made before it still
starts the driver by its old name (the agent keeps an alias), and the daemon starts the
driver by the old name in a sandbox whose agent copy predates the rename (paused before)."""

from __future__ import annotations

import os
import runpy
import stat
import subprocess
import time
from pathlib import Path

import pytest

import cpuos_agent.interp_driver
from cpuosd.lifecycle.interpreter import START_DRIVER


def test_the_old_module_name_runs_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[bool] = []
    monkeypatch.setattr(cpuos_agent.interp_driver, "main", lambda: ran.append(True))
    runpy.run_module("cpuos_agent.kernel", run_name="__main__")
    assert ran == [True]
    runpy.run_module("cpuos_agent.kernel")  # imported, not run: nothing happens
    assert ran == [True]


def _started_module(tmp_path: Path, files: list[str]) -> str:
    """The module START_DRIVER runs with an agent copy holding ``files`` (a fake python3 on
    PATH notes its arguments; /opt/cpuos is a directory of the test's)."""
    agent = tmp_path / "opt" / "cpuos_agent"
    agent.mkdir(parents=True)
    for f in files:
        (agent / f).write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "argv"
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "$@" > {seen}.tmp\n'
                    f"mv {seen}.tmp {seen}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cmd = START_DRIVER.replace("/opt/cpuos", str(tmp_path / "opt")).replace(
        "/tmp/cpuos-kernel.log", str(tmp_path / "driver.log"))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["sh", "-c", cmd], env=env, cwd=tmp_path, timeout=30, check=False)
    assert r.returncode == 0
    for _ in range(500):  # the driver is started in the background
        if seen.exists():
            return seen.read_text().split()[-1]
        time.sleep(0.01)
    raise AssertionError("START_DRIVER started nothing")


def test_the_driver_is_started_by_the_name_the_agent_copy_has(tmp_path: Path) -> None:
    assert _started_module(tmp_path / "new", ["interp_driver.py", "kernel.py"]) == \
        "cpuos_agent.interp_driver"
    assert _started_module(tmp_path / "old", ["kernel.py"]) == "cpuos_agent.kernel"
