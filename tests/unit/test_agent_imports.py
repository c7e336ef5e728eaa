"""The agent is resident in every sandbox: what it imports at start is memory every idle
sandbox holds (issue 22). Modules only some requests need (tarfile and the archive code,
subprocess, a microVM's ipaddress) are imported when asked, not at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ON_DEMAND = ["tarfile", "cpuos_agent.tarx", "subprocess", "hashlib", "secrets", "platform",
             "ipaddress"]


def test_the_agent_loads_archive_and_process_modules_only_when_asked() -> None:
    code = ("import sys, cpuos_agent.agent; "
            f"print(sorted(m for m in {ON_DEMAND!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-s", "-c", code], capture_output=True, text=True,
                       check=True, env={"PYTHONPATH": str(SRC)})
    assert r.stdout.strip() == "[]", r.stdout
