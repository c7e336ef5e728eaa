"""Issue 11, findings 1 and 4: nothing a sandbox writes reaches a host file without a bound.

The host paths a gVisor sandbox's bytes can reach, each attacked from inside and measured on
the host:
- the agent's stdio (fds 0-2 of PID 1, reachable through /proc/1/fd): /dev/null, not a host
  file (it was runsc.log, which grew by 300 MB);
- runsc's own log (runsc.log in the sandbox's host directory): runsc writes it, not the
  sandbox; unimplemented syscalls and other noise do not grow it;
- the writable root layer: in sandbox memory (--overlay2=root:memory), so the template's
  tree on the host is unchanged and the host's disk is not touched;
- /run/cpuos, the one read-write bind mount (the agent's socket directory): not writable by
  the commands' uid;
- the daemon's log: what code inside can trigger (agent-channel knocks) is rate-limited;
- the database: an exec's recorded output is capped (CPUOS_OUTPUT_CAP).
Pause images are bounded by the sandbox's memory limit and the free-space check before a
pause (tests/e2e/test_snapshots.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuos import Sandbox
from support.daemon import TEMPLATES, Daemon

pytestmark = pytest.mark.e2e
MiB = 1 << 20

ATTACK = r"""
set +e
for fd in 0 1 2; do head -c 100000000 /dev/zero >> /proc/1/fd/$fd 2>/dev/null; done
head -c 300000000 /dev/zero > /work/big 2>/dev/null     # the root layer
head -c 300000000 /dev/zero > /dev/shm/big 2>/dev/null  # a tmpfs
touch /run/cpuos/x 2>/dev/null && echo WROTE-RUN-CPUOS
echo pwned > /etc/cpuos-attack 2>/dev/null
python3 - <<'EOF'
import ctypes, socket
libc = ctypes.CDLL(None)
for i in range(100000):  # unimplemented and odd syscalls: the sentry's log must not grow
    libc.syscall(246, 0, 0, 0, 0)  # kexec_load
    libc.syscall(400 + i % 50)
for i in range(2000):  # malformed frames at the agent's socket
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("/run/cpuos/agent.sock")
        s.sendall(b"\xff" * 64)
    except OSError:
        pass
    s.close()
EOF
echo attack-done
"""


def tree_bytes(p: Path) -> int:
    total = 0
    for d, _, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total


@pytest.fixture
def victim(daemon: Daemon) -> Iterator[Sandbox]:
    s = Sandbox.create(template="python", timeout="10m", memory_mib=2048, **daemon.sdk_kwargs())
    yield s
    s.kill()
    s.close()


def test_sandbox_bytes_reach_no_host_file_unbounded(daemon: Daemon, victim: Sandbox) -> None:
    sdir = daemon.home / "sandboxes" / victim.id
    before_sdir, before_log = tree_bytes(sdir), daemon.log.stat().st_size
    before_db = sum(p.stat().st_size for p in daemon.home.glob("cpuos.db*"))
    run = victim.exec(ATTACK, timeout="5m")
    assert "attack-done" in run.stdout, run.stderr[-2000:]
    assert "WROTE-RUN-CPUOS" not in run.stdout
    # the writes inside happened (the root layer took 300 MB) ...
    assert victim.exec("stat -c %s /work/big").stdout.strip() == "300000000"
    # ... and none reached the host beyond a small bound
    grown = tree_bytes(sdir) - before_sdir
    assert grown < 1 * MiB, f"the sandbox's host directory grew by {grown} bytes"
    assert not (sdir / "sock" / "x").exists()
    log_grown = daemon.log.stat().st_size - before_log
    assert log_grown < 256 * 1024, f"the daemon's log grew by {log_grown} bytes"
    db_grown = sum(p.stat().st_size for p in daemon.home.glob("cpuos.db*")) - before_db
    assert db_grown < 8 * MiB, f"the database grew by {db_grown} bytes"
    assert not list(TEMPLATES.glob("python-*/rootfs/work/big"))
    assert not list(TEMPLATES.glob("python-*/rootfs/etc/cpuos-attack"))
    # the sandbox is still usable
    assert victim.exec("echo ok").stdout == "ok\n"
