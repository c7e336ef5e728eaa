"""QEMU, with the real command line from qemu.py, under our jailer: comes up jailed and
answers QMP. ``-S``: no guest code runs (a guest cannot boot on this kind of host, see
probe.py). KVM when QEMU can initialise it, else ``-accel tcg`` (this test only). The last
two boot the guest under TCG: to /init, and all the way to the agent (they need the guest
artifacts, and the second a built ``python`` template).

Needs root and qemu-system-x86_64 (apt-get install qemu-system-x86).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import cpuos_agent
from cpuos_agent import protocol as P
from cpuos_agent.protocol import Kind
from cpuosd.agentconn import AgentChannel
from cpuosd.backends.base import SandboxSpec
from cpuosd.backends.microvm import guest_artifacts, jailer, ram
from cpuosd.backends.microvm.backend import MicroVMBackend
from cpuosd.backends.microvm.qemu import (
    QMP,
    Accel,
    VMConfig,
    kernel_cmdline,
    qemu_argv,
    support_files,
)

QEMU_BIN = "/usr/bin/qemu-system-x86_64"
UID = 300_911

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the jailer needs root"),
    pytest.mark.skipif(not os.path.exists(QEMU_BIN),
                       reason="qemu-system-x86_64 not installed (apt-get install qemu-system-x86)"),
]


@dataclasses.dataclass
class Jailed:
    id: str
    base: Path
    proc: subprocess.Popen[bytes]
    paths: jailer.JailPaths
    accel: Accel
    agent_listener: socket.socket
    log: Path

    @property
    def vmm_pid(self) -> int:
        return int(self.paths.pid_file.read_text())


def _start(sid: str, base: Path, work: Path, accel: Accel, *, incoming: bool = False,
           agent: socket.socket | None = None, ram_fd: int | None = None,
           shared: bool = True) -> Jailed:
    images = work / "images"
    images.mkdir(exist_ok=True)
    for name in ("root.ext4", "overlay.ext4"):
        with open(images / name, "wb") as f:
            f.truncate(1 << 20)
        os.chown(images / name, UID, UID)
    agent_dir = work / "agent"
    agent_dir.mkdir(exist_ok=True)
    if agent is None:
        agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # a KVM attempt that failed (slowly, on a loaded host) left its socket: TCG rebinds
        (agent_dir / "agent.sock").unlink(missing_ok=True)
        agent.bind(str(agent_dir / "agent.sock"))
        os.chmod(agent_dir / "agent.sock", 0o666)
        agent.listen(4)
    vm = VMConfig(qmp_socket="/run/qmp.sock", vcpus=1, memory_mib=128,
                  rootfs_image="/disk/root.ext4", overlay_image="/disk/overlay.ext4",
                  agent_socket="/agent/agent.sock", accel=accel, start_paused=True,
                  incoming=incoming, qemu=QEMU_BIN,
                  memory_file=None if ram_fd is None else ram.jail_path(ram_fd),
                  memory_shared=shared)
    keep = () if ram_fd is None else (ram_fd,)
    argv = jailer.jailer_argv(
        sandbox_id=sid, exec_file=QEMU_BIN, exec_dest=QEMU_BIN, uid=UID, gid=UID,
        chroot_base=base, args=qemu_argv(vm)[1:], files=support_files(QEMU_BIN, accel),
        binds=[(str(images / "root.ext4"), "/disk/root.ext4", True),
               (str(images / "overlay.ext4"), "/disk/overlay.ext4", False),
               (str(agent_dir), "/agent", True)], keep_fds=keep, mount_proc=bool(keep),
        cgroups=jailer.cgroup_limits(jailer.cgroup_version(), cpus=1,
                                     memory_bytes=512 << 20, pids=128),
        rlimits={"nofile": 1024, "fsize": 1 << 20})
    log = work / f"{sid}.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                pass_fds=keep)
    return Jailed(sid, base, proc, jailer.jail_paths(sid, QEMU_BIN, base, QEMU_BIN), accel,
                  agent, log)


async def _connect(j: Jailed) -> QMP:
    q = QMP(j.paths.host_path("/run/qmp.sock"))
    deadline = time.monotonic() + 10
    while True:
        if j.proc.poll() is not None:
            raise RuntimeError(f"QEMU exited {j.proc.returncode}: {j.log.read_text()[-500:]}")
        try:
            await q.connect(0.2)
            return q
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "jails").mkdir()
    return tmp_path.resolve()


@pytest.fixture
def ids(work: Path) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for sid in made:
        jailer.cleanup(sid, work / "jails")
        assert not (work / "jails" / "qemu-system-x86_64" / sid).exists()
        assert not [d for d in jailer.cgroup_dirs(sid) if d.exists()], "cgroup left behind"


async def _start_any_accel(sid: str, work: Path, **kw: object) -> tuple[Jailed, QMP]:
    """KVM first; if QEMU cannot initialise it here, TCG (for this test only)."""
    errors = []
    for accel in ("kvm", "tcg"):
        j = _start(sid, work / "jails", work, accel, **kw)  # type: ignore[arg-type]
        try:
            return j, await _connect(j)
        except Exception as e:
            errors.append(f"{accel}: {e}")
            j.proc.kill()
            j.proc.wait()
            jailer.cleanup(sid, work / "jails")
    pytest.fail("QEMU did not come up jailed: " + " | ".join(errors))


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def test_qemu_comes_up_jailed_and_answers_qmp(work: Path, ids: list[str]) -> None:
    sid = f"qj-{os.getpid()}"
    ids.append(sid)
    asyncio.run(_jailed_and_answers(sid, work))


async def _jailed_and_answers(sid: str, work: Path) -> None:
    j, q = await _start_any_accel(sid, work)
    vmm = j.vmm_pid
    st = _status(vmm)
    assert st["Uid"].split() == [str(UID)] * 4
    assert st["Gid"].split() == [str(UID)] * 4
    assert st["Groups"] == ""
    assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0000000000000000"
    assert st["NoNewPrivs"] == "1"
    assert st["Seccomp"] == "2"  # QEMU's own -sandbox filter
    assert st["NSpid"].split()[-1] == "1"  # PID 1 of its own pid namespace
    for ns in ("mnt", "pid"):
        assert os.readlink(f"/proc/{vmm}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
    assert os.readlink(f"/proc/{vmm}/root") == "/"  # pivot_root: its root is the jail
    assert not os.path.exists(f"/proc/{vmm}/root/etc/hostname")
    fds = {int(x) for x in os.listdir(f"/proc/{vmm}/fd")}
    assert {0, 1, 2} <= fds  # (the rest are QEMU's own)
    print(f"accelerator: {j.accel}")
    # the agent channel's chardev connected out of the jail to the daemon-side socket
    j.agent_listener.settimeout(5)
    conn, _ = j.agent_listener.accept()
    conn.close()
    assert await q.query_status() == "prelaunch"
    await q.quit()
    assert j.proc.wait(10) == 0, j.log.read_text()[-500:]
    j.agent_listener.close()


async def _save_state(q: QMP, state: Path, ignore_shared: bool = False) -> None:
    """stop, migrate to a host file passed as an fd, quit (as backend.save_state)."""
    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        await q.stop()
        await q.set_ignore_shared(ignore_shared)
        await q.migrate_fd(fd)
    finally:
        os.close(fd)
    await q.wait_migration(30)
    await q.quit()


async def _load_state(q: QMP, state: Path, ignore_shared: bool = False) -> str:
    """migrate-incoming from the file; the status once it has loaded."""
    await q.set_ignore_shared(ignore_shared)
    fd = os.open(state, os.O_RDONLY)
    try:
        await q.migrate_incoming_fd(fd)
    finally:
        os.close(fd)
    status = "inmigrate"
    for _ in range(500):
        status = await q.query_status()
        if status != "inmigrate":
            break
        await asyncio.sleep(0.01)
    return status


def test_state_migrates_through_an_fd_into_a_jailed_clone(work: Path, ids: list[str]) -> None:
    """checkpoint/restore plumbing without a guest: migrate a -S VM's state to a host file
    passed in over QMP (no process spawned in the jail), then into a jailed
    ``-incoming defer`` QEMU."""
    src_id, dst_id = f"qm-{os.getpid()}-a", f"qm-{os.getpid()}-b"
    ids += [src_id, dst_id]
    state = work / "state"

    async def save() -> Jailed:
        src, q = await _start_any_accel(src_id, work)
        await _save_state(q, state)
        return src

    src = asyncio.run(save())
    assert src.proc.wait(10) == 0
    assert state.stat().st_size > 0
    dst = _start(dst_id, work / "jails", work, src.accel, incoming=True,
                 agent=src.agent_listener)

    async def load() -> str:
        q2 = await _connect(dst)
        try:
            assert await q2.query_status() == "inmigrate"
            return await _load_state(q2, state)
        finally:
            await q2.quit()

    assert asyncio.run(load()) in ("paused", "prelaunch", "postmigrate")
    assert dst.proc.wait(10) == 0, dst.log.read_text()[-500:]
    src.agent_listener.close()
    shutil.rmtree(work / "images", ignore_errors=True)


def _ram_mapping(pid: int) -> str:
    """The permissions of the guest-RAM memfd's mapping in a QEMU ('rw-s': shared)."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "memfd:cpuos-test" in line:
                return line.split()[1]
    raise AssertionError("no mapping of the template RAM memfd")


async def _peek(q: QMP, addr: int, n: int) -> bytes:
    """n bytes of guest-physical memory, read by QEMU (HMP ``xp``)."""
    text = await q.execute("human-monitor-command", {"command-line": f"xp /{n}xb {addr:#x}"})
    return bytes(int(x, 16) for line in text.splitlines() for x in line.split(":")[1].split())


def test_template_ram_is_a_sealed_memfd_that_jailed_clones_map_private(
        work: Path, ids: list[str]) -> None:
    """The template-clone memory layout of backend.py/ram.py, without running guest code: a
    jailed template QEMU maps the RAM memfd shared (the host sees what the guest's RAM
    holds), its device state migrates with ``x-ignore-shared`` (no RAM in the stream); the
    memfd is sealed, after which nobody, root included, can write it; a jailed clone
    (unprivileged uid) opens it, maps it private and, once the state is loaded, reads the
    template's pages through it."""
    src_id, dst_id = f"qr-{os.getpid()}-a", f"qr-{os.getpid()}-b"
    ids += [src_id, dst_id]
    state = work / "state"
    fd = ram.new("cpuos-test", 128 << 20)
    page = b"cpuos template page " * 8
    addr = 0x300000

    async def template() -> Jailed:
        src, q = await _start_any_accel(src_id, work, ram_fd=fd, shared=True)
        assert _ram_mapping(src.vmm_pid) == "rw-s"
        os.pwrite(fd, page, addr)  # as if the guest had written it
        assert await _peek(q, addr, len(page)) == page
        await _save_state(q, state, ignore_shared=True)
        return src

    try:
        src = asyncio.run(template())
        assert src.proc.wait(10) == 0
        assert 0 < state.stat().st_size < 1 << 20, "RAM went into the stream"
        ram.seal(fd)
        assert ram.sealed(fd)
        for attempt in (lambda: os.pwrite(fd, b"x", addr), lambda: os.ftruncate(fd, 1 << 20)):
            with pytest.raises(PermissionError):
                attempt()
        dst = _start(dst_id, work / "jails", work, src.accel, incoming=True,
                     agent=src.agent_listener, ram_fd=fd, shared=False)

        async def clone() -> None:
            q = await _connect(dst)
            try:
                assert _status(dst.vmm_pid)["Uid"].split()[0] == str(UID)
                assert _ram_mapping(dst.vmm_pid) == "rw-p"  # MAP_PRIVATE: copy on write
                # the clone's own view of the file is no way to write it either
                with open(f"/proc/{dst.vmm_pid}/fd/{fd}", "r+b") as f, \
                        pytest.raises(PermissionError):
                    os.pwrite(f.fileno(), b"x", addr)
                status = await _load_state(q, state, ignore_shared=True)  # as the template
                assert status in ("paused", "prelaunch", "postmigrate"), status
                assert await _peek(q, addr, len(page)) == page
            finally:
                await q.quit()

        asyncio.run(clone())
        assert dst.proc.wait(10) == 0, dst.log.read_text()[-500:]
        assert os.pread(fd, len(page), addr) == page
        src.agent_listener.close()
    finally:
        os.close(fd)


def test_guest_kernel_boots_to_init_under_tcg_jailed(work: Path, ids: list[str]) -> None:
    """The guest artifacts (vmlinux, initramfs, virtio modules, /init) boot, jailed. Under
    TCG: a KVM guest cannot boot on this kind of host (see probe.py), an emulated one can."""
    art = guest_artifacts.current_artifacts()
    if art is None:
        pytest.skip(f"guest artifacts not built in {guest_artifacts.cache_dir()} "
                    "(scripts/build-microvm-kernel.sh)")
    sid = f"qb-{os.getpid()}"
    ids.append(sid)
    vm = VMConfig(qmp_socket="/run/qmp.sock", kernel="/boot/vmlinux", initrd="/boot/initrd",
                  cmdline=kernel_cmdline(console=True, accel="tcg", extra=["cpuos.probe=1"]),
                  vcpus=1,
                  memory_mib=256, serial_log="/run/serial.log", accel="tcg", qemu=QEMU_BIN)
    argv = jailer.jailer_argv(
        sandbox_id=sid, exec_file=QEMU_BIN, exec_dest=QEMU_BIN, uid=UID, gid=UID,
        chroot_base=work / "jails", args=qemu_argv(vm)[1:], files=support_files(QEMU_BIN, "tcg"),
        binds=[(art.vmlinux, "/boot/vmlinux", True), (art.initrd, "/boot/initrd", True)],
        cgroups=jailer.cgroup_limits(jailer.cgroup_version(), cpus=1, memory_bytes=768 << 20,
                                     pids=128),
        rlimits={"nofile": 1024, "fsize": 4 << 20})
    serial = jailer.jail_paths(sid, QEMU_BIN, work / "jails", QEMU_BIN).host_path(
        "/run/serial.log")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        text = ""
        while time.monotonic() - t0 < 40 and proc.poll() is None:
            with contextlib.suppress(OSError):
                text = serial.read_text(errors="replace")
            if guest_artifacts.PROBE_MARKER in text:
                break
            time.sleep(0.05)
        with contextlib.suppress(OSError):  # QEMU may have exited (poweroff) meanwhile
            text = serial.read_text(errors="replace")
        print(f"guest reached the marker after {time.monotonic() - t0:.1f}s")
        assert "CPUOS-INIT-START" in text, text[-1500:]
        assert guest_artifacts.PROBE_MARKER in text, text[-1500:]
        assert "CPUOS-INIT-FAILED" not in text
        # /init powers the VM off after the marker; -no-reboot: QEMU exits by itself
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_guest_boots_to_the_agent_under_tcg_jailed(work: Path) -> None:
    """The whole microVM path, jailed, under TCG: MicroVMBackend boots the template, /init
    runs the real agent on the virtio-serial port, the agent says hello to the daemon-side
    ``AgentChannel`` (through QEMU's chardev), runs a command, says hello again after the
    host reconnects, and is killed with the VM."""
    art = guest_artifacts.current_artifacts()
    if art is None:
        pytest.skip(f"guest artifacts not built in {guest_artifacts.cache_dir()} "
                    "(scripts/build-microvm-kernel.sh)")
    info = Path(os.environ.get("CPUOS_TEMPLATES_DIR", "/var/lib/cpuos/templates")) / "python.json"
    if not info.exists():
        pytest.skip(f"python template not built ({info})")
    rootfs = Path(json.loads(info.read_text())["rootfs"])
    agent_dir = work / "agent-pkg"
    (agent_dir / "cpuos_agent").mkdir(parents=True)
    for f in Path(cpuos_agent.__file__).parent.glob("*.py"):
        shutil.copy2(f, agent_dir / "cpuos_agent" / f.name)
    sid = f"qa-{os.getpid()}"
    spec = SandboxSpec(id=sid, rootfs=rootfs, dir=work / "sandboxes" / sid, agent_dir=agent_dir,
                       vcpus=1, memory_mib=512, hostname=sid)
    # the template's ext4 image is content-keyed: cached beside the artifacts
    backend = MicroVMBackend(work / "home", accel="tcg", artifacts=art,
                             images=guest_artifacts.cache_dir() / "images")

    async def run(chan: AgentChannel, argv: list[str]) -> tuple[list[str], P.Header, bytes]:
        st = chan.open()
        try:
            await st.send({"t": Kind.EXEC, "argv": argv, "cwd": "/", "stdin": False,
                           "env": {"PATH": "/usr/bin:/bin"}, "timeout": 60})
            kinds, out = [], b""
            while True:
                h, payload = await st.get(120)
                kinds.append(h["t"])
                out += payload if h["t"] == "out" else b""
                if h["t"] in ("exit", "err"):
                    return kinds, h, out
        finally:
            st.close()

    async def body() -> None:
        spec.sock_dir.mkdir(parents=True)
        os.chmod(spec.sock_dir, 0o755)
        chan = AgentChannel(spec.sock_path)
        await chan.listen()
        t0 = time.monotonic()
        try:
            await backend.start(spec)
            await chan.wait_connected(180)
            print(f"agent hello after {time.monotonic() - t0:.1f}s: {chan.hello}")
            assert chan.hello is not None
            assert chan.hello["pid"] == 1 and chan.hello["uid"] == guest_artifacts.AGENT_UID
            assert (await chan.call({"t": Kind.PING}, timeout=60))["t"] == "pong"
            kinds, h, out = await run(chan, ["echo", "hi"])
            assert kinds == ["started", "out", "exit"], (kinds, h)
            assert h["exit_code"] == 0 and out == b"hi\n"
            kinds, h, out = await run(chan, ["/bin/sh", "-c", "echo $(hostname) $(id -u)"])
            assert out == f"{sid} {guest_artifacts.AGENT_UID}\n".encode()
            # host hang-up and reconnect (a daemon restart): a fresh hello, commands run
            await chan.close()
            chan = AgentChannel(spec.sock_path)
            await chan.listen()
            await chan.wait_connected(60)
            kinds, h, out = await run(chan, ["echo", "again"])
            assert h["exit_code"] == 0 and out == b"again\n"
        finally:
            await chan.close()
            await backend.kill(sid)
        assert sid not in await backend.running()
        assert not [d for d in jailer.cgroup_dirs(sid) if d.exists()]

    asyncio.run(body())
