"""microVM backend: one QEMU ``-M microvm`` (KVM) per sandbox, run by our jailer.

Per sandbox: a uid/gid of its own (``uid_base + slot``), a jail
``<CPUOS_HOME>/microvm/jail/qemu-system-x86_64/<id>/root`` holding QEMU, its libraries and
firmware, and, bind-mounted (read-only unless noted):

* ``/boot/vmlinux``, ``/boot/initrd``: the guest kernel and initramfs (``kernel.py``);
* ``/disk/root.ext4``: the template's tree as an ext4 image, built once per template;
* ``/disk/overlay.ext4`` (read-write, owned by the sandbox uid): the writable layer, a
  sparse copy of a blank image that carries the agent package;
* ``/agent``: the daemon's per-sandbox socket directory; QEMU's virtio-serial chardev
  connects to ``/agent/agent.sock`` (where ``AgentChannel`` listens) and reconnects.

In the guest, /init (``kernel.py``) runs the agent itself (``python3 -m cpuos_agent``, uid
1000) with ``CPUOS_AGENT_SOCKET`` set to the port's device (``/dev/vportNpM``): the agent's
character-device transport waits until QEMU is connected to the daemon, says hello, and
says it again on every reconnect (a daemon restart, a restore), so ``AgentChannel`` sees
an ordinary agent connection. The agent cannot close QEMU's connection: after a
``quiesce`` the host side must hang up (close the accepted connection) for the next hello
to come on a new connection; otherwise the agent resumes on the same one after 5 s.

QEMU's QMP socket is ``/run/qmp.sock`` in the jail (``<jail>/root/run/qmp.sock`` on the
host). Limits: cgroup cpu quota = vCPUs, memory = guest RAM + ``MEM_OVERHEAD_MIB``, pids;
RLIMIT_FSIZE = the overlay's size. Only used where ``probe.kvm_boot_probe()`` passes.

Checkpoint/restore: not supported yet. ``checkpoint`` and ``restore`` (the ``Backend``
contract) raise ``ApiError("conflict")`` and ``capabilities.checkpoint`` is False: the
Manager's template snapshot falls back to a cold boot; pause and fork fail. The plumbing
they will use is here, not wired to the contract: ``save_state`` (QMP ``stop`` + migration
of the device state, and RAM unless the VM's RAM lives in a shared template file and
``x-ignore-shared`` is on, to a host file passed to QEMU as an fd, plus a sparse copy of
the writable layer) and ``load_state`` (a jailed QEMU with ``-incoming defer`` fed the
state the same way). No process is spawned in the jail (``-sandbox spawn=deny``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ApiError
from ..base import Capabilities, SandboxSpec
from . import jailer, kernel
from .qemu import QMP, Accel, QMPFailure, VMConfig, kernel_cmdline, qemu_argv, support_files

log = logging.getLogger("cpuosd.microvm")

QEMU_BIN = "/usr/bin/qemu-system-x86_64"
UID_BASE = 300000
UID_COUNT = 10000
MEM_OVERHEAD_MIB = 256
PIDS_MAX = 512
OVERLAY_MIB = 4096
JAIL_KERNEL = "/boot/vmlinux"
JAIL_INITRD = "/boot/initrd"
JAIL_ROOT_IMG = "/disk/root.ext4"
JAIL_OVERLAY_IMG = "/disk/overlay.ext4"
JAIL_AGENT_DIR = "/agent"
JAIL_QMP = "/run/qmp.sock"
SNAPSHOTS_UNSUPPORTED = "snapshots are not supported by the microvm backend yet"


@dataclass
class VM:
    id: str
    uid: int
    paths: jailer.JailPaths
    proc: asyncio.subprocess.Process | None
    overlay: Path
    rootfs_image: Path
    vm: VMConfig


class MicroVMBackend:
    capabilities = Capabilities(name="microvm", checkpoint=False, network=False)

    def __init__(self, home: Path, *, qemu: str = QEMU_BIN, accel: Accel = "kvm",
                 uid_base: int = UID_BASE, uid_count: int = UID_COUNT,
                 overlay_mib: int = OVERLAY_MIB, artifacts: kernel.Artifacts | None = None,
                 console_log: bool = False, python: str | None = None,
                 images: Path | None = None) -> None:
        self.home = home
        self.dir = home / "microvm"
        self.jail_base = self.dir / "jail"
        # ext4 images cache (content-keyed: may be shared, e.g. by tests)
        self.images = images or self.dir / "images"
        self.qemu = qemu
        self.accel: Accel = accel
        self.uid_base = uid_base
        self.uid_count = uid_count
        self.overlay_mib = overlay_mib
        # debugging: the guest console to <jail>/root/run/console.log (bounded by the jail's
        # RLIMIT_FSIZE: a guest that writes more gets its own QEMU killed by SIGXFSZ)
        self.console_log = console_log
        self.python = python or sys.executable
        self._artifacts = artifacts
        self.vms: dict[str, VM] = {}
        self._image_locks: dict[str, asyncio.Lock] = {}
        self._support: list[tuple[str, str]] | None = None
        for d in (self.jail_base, self.images):
            d.mkdir(parents=True, exist_ok=True)
        self.jail_base = jailer.check_chroot_base(self.jail_base.resolve())

    # ---- artifacts -----------------------------------------------------------------------
    def artifacts(self) -> kernel.Artifacts:
        art = self._artifacts or kernel.current_artifacts(self.dir)
        if art is None or not art.exist():
            raise ApiError("unavailable", f"microVM guest kernel not built in {self.dir} "
                           "(scripts/build-microvm-kernel.sh)")
        return art

    async def _once(self, key: str, path: Path, build: Any) -> Path:
        lock = self._image_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if not path.exists():
                await asyncio.to_thread(build)
        return path

    async def prepare_template(self, rootfs: Path) -> Path:
        """The template's tree as an ext4 image (built once; template trees never change)."""
        key = hashlib.sha256(str(rootfs.resolve()).encode()).hexdigest()[:20]
        out = self.images / f"root-{key}.ext4"
        return await self._once(key, out, lambda: kernel.build_rootfs_image(rootfs, out))

    async def _overlay_base(self, agent_dir: Path) -> Path:
        """The blank writable layer carrying the agent package; keyed by the package's
        content (a changed agent gets a new image, never a stale cached one)."""
        h = hashlib.sha256()
        for f in sorted((agent_dir / "cpuos_agent").glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        key = f"overlay-{h.hexdigest()[:16]}-{self.overlay_mib}"
        out = self.images / f"{key}.ext4"
        return await self._once(key, out, lambda: kernel.build_overlay_image(
            out, self.overlay_mib, agent_dir))

    # ---- uids ------------------------------------------------------------------------------
    def _uids_in_use(self) -> set[int]:
        used = {vm.uid for vm in self.vms.values()}
        exec_dir = self.jail_base / Path(self.qemu).name
        if exec_dir.is_dir():
            for j in exec_dir.iterdir():
                with contextlib.suppress(OSError):
                    used.add((j / "root" / "run").stat().st_uid)
        return used

    def _allocate_uid(self) -> int:
        used = self._uids_in_use()
        for uid in range(self.uid_base, self.uid_base + self.uid_count):
            if uid not in used:
                return uid
        raise ApiError("limit_exceeded", "no free sandbox uid for another microVM")

    # ---- start / kill ----------------------------------------------------------------------
    def _vm_config(self, spec: SandboxSpec, *, incoming: bool = False) -> VMConfig:
        return VMConfig(
            qmp_socket=JAIL_QMP, kernel=JAIL_KERNEL, initrd=JAIL_INITRD,
            cmdline=kernel_cmdline(console=self.console_log, accel=self.accel,
                                   extra=[f"cpuos.hostname={spec.hostname}"]),
            serial_log="/run/console.log" if self.console_log else None,
            vcpus=spec.vcpus, memory_mib=spec.memory_mib, rootfs_image=JAIL_ROOT_IMG,
            overlay_image=JAIL_OVERLAY_IMG, agent_socket=f"{JAIL_AGENT_DIR}/{spec.sock_path.name}",
            accel=self.accel, incoming=incoming, qemu=self.qemu)

    def jailed_argv(self, spec: SandboxSpec, uid: int, vm: VMConfig, rootfs_image: Path,
                    overlay: Path, extra_binds: Sequence[tuple[str, str, bool]] = ()
                    ) -> list[str]:
        """The jailer's argv for ``vm``; ``extra_binds``: more (host, jail, read-only) bind
        mounts (e.g. a template's RAM file)."""
        art = self.artifacts()
        if self._support is None:
            self._support = support_files(self.qemu, self.accel)
        version = jailer.cgroup_version()
        return jailer.jailer_argv(
            sandbox_id=spec.id, exec_file=self.qemu, exec_dest=self.qemu, uid=uid, gid=uid,
            chroot_base=self.jail_base, args=qemu_argv(vm)[1:], files=self._support,
            binds=[(art.vmlinux, JAIL_KERNEL, True), (art.initrd, JAIL_INITRD, True),
                   (str(rootfs_image), JAIL_ROOT_IMG, True),
                   (str(overlay), JAIL_OVERLAY_IMG, False),
                   (str(spec.sock_dir), JAIL_AGENT_DIR, True), *extra_binds],
            cgroups=jailer.cgroup_limits(version, cpus=spec.vcpus,
                                         memory_bytes=(spec.memory_mib + MEM_OVERHEAD_MIB) << 20,
                                         pids=PIDS_MAX),
            cgroup_version=version,
            rlimits={"nofile": 4096, "fsize": self.overlay_mib << 20, "core": 0},
            devices=("kvm", "null", "zero", "urandom"), python=self.python)

    async def _launch(self, spec: SandboxSpec, uid: int, vm: VMConfig, rootfs_image: Path,
                      overlay: Path, extra_binds: Sequence[tuple[str, str, bool]] = ()) -> VM:
        argv = self.jailed_argv(spec, uid, vm, rootfs_image, overlay, extra_binds)
        spec.dir.mkdir(parents=True, exist_ok=True)
        with open(spec.dir / "qemu.log", "ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                start_new_session=True)
        paths = jailer.jail_paths(spec.id, self.qemu, self.jail_base, self.qemu)
        rec = VM(spec.id, uid, paths, proc, overlay, rootfs_image, vm)
        self.vms[spec.id] = rec
        return rec

    def _log_tail(self, spec: SandboxSpec) -> str:
        with contextlib.suppress(OSError):
            return (spec.dir / "qemu.log").read_bytes()[-800:].decode(errors="replace").strip()
        return ""

    async def _qmp(self, rec: VM, timeout: float = 10.0) -> QMP:
        q = QMP(rec.paths.host_path(JAIL_QMP))
        connect = asyncio.create_task(q.connect(timeout))
        waits: set[asyncio.Task[Any]] = {connect}
        if rec.proc is not None:
            waits.add(asyncio.create_task(rec.proc.wait()))
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            if t is not connect:
                t.cancel()
        if connect not in done:
            connect.cancel()
            with contextlib.suppress(BaseException):
                await connect
            raise QMPFailure("QEMU exited before its QMP socket answered")
        connect.result()
        return q

    async def start(self, spec: SandboxSpec) -> None:
        jailer.check_id(spec.id)
        self.artifacts()
        try:
            rootfs_image = await self.prepare_template(spec.rootfs)
            base = await self._overlay_base(spec.agent_dir)
        except kernel.KernelError as e:
            raise ApiError("internal", f"microVM disk images: {e}") from None
        uid = self._allocate_uid()
        overlay = spec.dir / "overlay.ext4"
        spec.dir.mkdir(parents=True, exist_ok=True)
        overlay.unlink(missing_ok=True)
        await asyncio.to_thread(kernel.copy_sparse, base, overlay)
        os.chown(overlay, uid, uid)
        os.chmod(overlay, 0o600)
        rec = await self._launch(spec, uid, self._vm_config(spec), rootfs_image, overlay)
        try:
            q = await self._qmp(rec)
            try:
                status = await q.query_status()
            finally:
                await q.close()
            if status != "running":
                raise QMPFailure(f"VM is {status!r} after start")
        except (QMPFailure, OSError) as e:
            tail = self._log_tail(spec)
            await self.kill(spec.id)
            raise ApiError("internal", f"microVM failed to start: {e}: {tail}") from None

    async def kill(self, sandbox_id: str) -> None:
        jailer.check_id(sandbox_id)
        rec = self.vms.pop(sandbox_id, None)
        paths = jailer.jail_paths(sandbox_id, self.qemu, self.jail_base, self.qemu)
        with contextlib.suppress(OSError, ValueError):
            pid = int(paths.pid_file.read_text())
            os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(jailer.cleanup, sandbox_id, self.jail_base, Path(self.qemu).name)
        if rec is not None and rec.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                rec.proc.kill()
            await rec.proc.wait()

    async def running(self) -> dict[str, str]:
        out: dict[str, str] = {}
        exec_dir = self.jail_base / Path(self.qemu).name
        if not exec_dir.is_dir():
            return out
        for j in exec_dir.iterdir():
            if not jailer.ID_RE.fullmatch(j.name):
                continue
            state = "stopped"
            with contextlib.suppress(OSError, ValueError):
                pid = int((j / jailer.PID_FILE).read_text())
                if os.path.exists(f"/proc/{pid}") and "Z" not in _proc_state(pid):
                    state = "running"
            out[j.name] = state
        return out

    # ---- the Backend contract's snapshot slots: not supported yet -----------------------------
    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        raise ApiError("conflict", SNAPSHOTS_UNSUPPORTED)

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        raise ApiError("conflict", SNAPSHOTS_UNSUPPORTED)

    def memory_usage(self, sandbox_id: str) -> int | None:
        """Bytes charged to the VM's jail cgroup (QEMU and its guest's RAM), or None."""
        try:
            dirs = jailer.cgroup_dirs(sandbox_id)
        except jailer.JailError:
            return None
        for d in dirs:
            for name in ("memory.current", "memory.usage_in_bytes"):
                try:
                    return int((d / name).read_text())
                except (OSError, ValueError):
                    continue
        return None

    # ---- state save/load over QMP (plumbing for a future checkpoint/restore) ------------------
    async def save_state(self, sandbox_id: str, directory: Path, *,
                         ignore_shared: bool = False) -> None:
        """Stop the VM and write its state to ``directory`` (the VM stays stopped)."""
        rec = self.vms.get(sandbox_id)
        if rec is None:
            raise ApiError("not_found", f"no microVM {sandbox_id}")
        directory.mkdir(parents=True, exist_ok=True)
        q = await self._qmp(rec)
        try:
            await q.stop()
            if ignore_shared:
                await q.set_ignore_shared(True)
            fd = os.open(directory / "state", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                await q.migrate_fd(fd)
            finally:
                os.close(fd)
            await q.wait_migration()
        finally:
            await q.close()
        await asyncio.to_thread(kernel.copy_sparse, rec.overlay, directory / "overlay.ext4")
        meta = {"vm": dataclasses.asdict(rec.vm), "rootfs_image": str(rec.rootfs_image)}
        (directory / "meta.json").write_text(json.dumps(meta, indent=1))

    async def load_state(self, directory: Path, spec: SandboxSpec) -> None:
        """Start ``spec.id`` from a ``save_state`` directory (its agent reconnects)."""
        meta = json.loads((directory / "meta.json").read_text())
        vm = dataclasses.replace(VMConfig(**{**meta["vm"], "extra": tuple(meta["vm"]["extra"])}),
                                 incoming=True, start_paused=False,
                                 agent_socket=f"{JAIL_AGENT_DIR}/{spec.sock_path.name}")
        uid = self._allocate_uid()
        spec.dir.mkdir(parents=True, exist_ok=True)
        overlay = spec.dir / "overlay.ext4"
        overlay.unlink(missing_ok=True)
        await asyncio.to_thread(kernel.copy_sparse, directory / "overlay.ext4", overlay)
        os.chown(overlay, uid, uid)
        os.chmod(overlay, 0o600)
        rec = await self._launch(spec, uid, vm, Path(meta["rootfs_image"]), overlay)
        try:
            q = await self._qmp(rec)
            try:
                fd = os.open(directory / "state", os.O_RDONLY)
                try:
                    await q.migrate_incoming_fd(fd)
                finally:
                    os.close(fd)
                for _ in range(6000):
                    status = await q.query_status()
                    if status != "inmigrate":
                        break
                    await asyncio.sleep(0.01)
                if status in ("paused", "prelaunch", "postmigrate"):
                    await q.cont()
            finally:
                await q.close()
        except (QMPFailure, OSError) as e:
            tail = self._log_tail(spec)
            await self.kill(spec.id)
            raise ApiError("internal", f"microVM restore failed: {e}: {tail}") from None


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
