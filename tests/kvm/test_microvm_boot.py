"""A real microVM: boot to the real agent (``python3 -m cpuos_agent`` on the virtio-serial
port, no relay), run a command through the agent channel, survive a host reconnect.

Runs only where the KVM boot probe passes (a guest actually boots to a marker within its
timeout); elsewhere every test here is skipped with the probe's reason. Needs root, the
guest artifacts (scripts/build-microvm-kernel.sh) and a built ``python`` template. The
same path under TCG: tests/security/test_qemu_jail.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import cpuos_agent
from cpuos_agent.protocol import Kind
from cpuosd.agentconn import AgentChannel
from cpuosd.backends.base import SandboxSpec
from cpuosd.backends.microvm import guest_artifacts, jailer
from cpuosd.backends.microvm.backend import MicroVMBackend
from cpuosd.backends.microvm.probe import kvm_boot_probe

pytestmark = pytest.mark.kvm

TEMPLATES = Path(os.environ.get("CPUOS_TEMPLATES_DIR", "/var/lib/cpuos/templates"))


@pytest.fixture(scope="module", autouse=True)
def kvm_probe() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (/dev/kvm, jailer)")
    t0 = time.monotonic()
    ok, reason = kvm_boot_probe(timeout=5)
    print(f"\nKVM boot probe ({time.monotonic() - t0:.1f}s): {'ok' if ok else 'no'}: {reason}")
    if not ok:
        pytest.skip(f"KVM boot probe failed: {reason}")


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    h = tmp_path / "home"
    (h / "microvm").mkdir(parents=True)
    art = guest_artifacts.current_artifacts()
    assert art is not None  # the probe passed, so they exist
    yield h


def _template_rootfs() -> Path:
    info = TEMPLATES / "python.json"
    if not info.exists():
        pytest.skip(f"python template not built in {TEMPLATES}")
    import json

    return Path(json.loads(info.read_text())["rootfs"])


def _agent_dir(where: Path) -> Path:
    d = where / "agent"
    (d / "cpuos_agent").mkdir(parents=True)
    for f in Path(cpuos_agent.__file__).parent.glob("*.py"):
        shutil.copy2(f, d / "cpuos_agent" / f.name)
    return d


async def _exec(chan: AgentChannel, argv: list[str]) -> tuple[int, bytes]:
    st = chan.open()
    try:
        await st.send({"t": Kind.EXEC, "argv": argv, "env": {"PATH": "/usr/bin:/bin"},
                       "cwd": "/", "timeout": 30, "stdin": False})
        out = b""
        while True:
            h, payload = await st.get(60)
            if h["t"] == "out":
                out += payload
            elif h["t"] == "exit":
                return int(h["exit_code"]), out
            elif h["t"] == "err":
                raise AssertionError(f"agent error: {h}")
    finally:
        st.close()


def test_boot_to_agent_and_exec(home: Path, tmp_path: Path) -> None:
    rootfs = _template_rootfs()
    sid = f"kvm-{os.getpid()}"
    spec = SandboxSpec(id=sid, rootfs=rootfs, dir=home / "sandboxes" / sid,
                       agent_dir=_agent_dir(tmp_path), vcpus=1, memory_mib=512, hostname=sid)
    backend = MicroVMBackend(home, artifacts=guest_artifacts.current_artifacts())

    async def body() -> None:
        spec.sock_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(spec.sock_dir, 0o755)
        chan = AgentChannel(spec.sock_path)
        await chan.listen()
        t0 = time.monotonic()
        try:
            await backend.start(spec)
            assert (await backend.running()).get(sid) == "running"
            await chan.wait_connected(60)
            print(f"agent connected after {time.monotonic() - t0:.2f}s")
            assert chan.hello is not None
            assert chan.hello["pid"] == 1 and chan.hello["uid"] == guest_artifacts.AGENT_UID
            code, out = await _exec(chan, ["/bin/sh", "-c", "echo hello from $(hostname)"])
            assert code == 0
            assert out.strip() == f"hello from {sid}".encode()
            # the daemon goes away and comes back: QEMU reconnects, the agent says hello
            # again on the new connection
            await chan.close()
            chan = AgentChannel(spec.sock_path)
            await chan.listen()
            await chan.wait_connected(30)
            code, out = await _exec(chan, ["echo", "hi"])
            assert (code, out) == (0, b"hi\n")
        finally:
            await chan.close()
            await backend.kill(sid)
        assert sid not in await backend.running()
        assert not [d for d in jailer.cgroup_dirs(sid) if d.exists()]

    asyncio.run(body())
