"""microVM backend: one QEMU ``-M microvm`` (KVM) per sandbox, run by our jailer.

Per sandbox: a uid/gid of its own (``uid_base + slot``), a jail
``<CPUOS_HOME>/microvm/jail/qemu-system-x86_64/<id>/root`` holding QEMU, its libraries and
firmware, and, bind-mounted (read-only unless noted):

* ``/boot/vmlinux``, ``/boot/initrd``: the guest kernel and initramfs
  (``guest_artifacts.py``);
* ``/disk/root.ext4``: the template's tree as an ext4 image, built once per template;
* ``/disk/overlay.ext4`` (read-write, owned by the sandbox uid): the writable layer, a
  sparse copy of a blank image that carries the agent package;
* ``/agent``: the daemon's per-sandbox socket directory; QEMU's virtio-serial chardev
  connects to ``/agent/agent.sock`` (where ``AgentChannel`` listens) and reconnects.

In the guest, /init (``guest_artifacts.py``) runs the agent itself (``python3 -m
cpuos_agent``, real uid 0, effective uid 1000; commands run as 1000) with
``CPUOS_AGENT_SOCKET`` set to the port's device (``/dev/vportNpM``): the agent's
character-device transport waits until QEMU is connected to the daemon, says hello, and
says it again on every reconnect (a daemon restart, a restore), so ``AgentChannel`` sees
an ordinary agent connection. The
agent cannot close QEMU's connection: after a ``quiesce`` the host side must hang up
(close the accepted connection) for the next hello to come on a new connection; otherwise
the agent resumes on the same one after 5 s.

QEMU's QMP socket is ``/run/qmp.sock`` in the jail (``<jail>/root/run/qmp.sock`` on the
host). Limits: cgroup cpu quota = vCPUs, memory = guest RAM + ``MEM_OVERHEAD_MIB``, pids;
RLIMIT_FSIZE = the overlay's size. Only used where ``probe.kvm_boot_probe()`` passes.

Snapshots (the ``Backend`` contract's ``checkpoint``/``restore``; QEMU 7.2 has no
``file:`` migration URI and no ``mapped-ram``). ``checkpoint`` stops the VM over QMP and
migrates its state to a host file passed to QEMU as an fd (``checkpoint.img``: nothing is
spawned in the jail, ``-sandbox spawn=deny``), copies the writable layer (sparse) beside
it, and ends the VM. Two kinds of image:

* a **template image** (``spec.template_boot``: the Manager's boot-once-then-snapshot):
  the template booted with its RAM in a memfd mapped ``share=on`` (``ram.py``), so the
  migration runs with ``x-ignore-shared`` and carries device state only; the memfd's
  pages are saved (sparse) as ``ram``, then it is filled and sealed against writes. A
  clone maps the sealed memfd ``share=off`` (``MAP_PRIVATE``: copy on write, one copy of
  the template's RAM in host memory for all clones), starts with ``-incoming defer`` and
  loads the device state.
* a **full image** (pause, fork): RAM travels in the migration stream (zero pages as
  flags), restored into a plain anonymous-memory VM.

Standby VMs: for a template image, ``standby`` jailed QEMUs per (image, size) are kept
spawned and waiting on ``-incoming defer`` with the memfd mapped, a copy of the writable
layer open and their agent chardev already connected to a placeholder listener. A
restore hands one out: the placeholder's connection goes to the daemon's ``AgentChannel``
(``spec.adopt``), the jail-bound socket directory becomes the sandbox's (renamed, with the
daemon's listening socket moved in, so a restarted daemon's QEMU reconnects there), then
``migrate-incoming`` and ``cont`` on the QMP connection opened when it was spawned. The
jail id of such a VM is its standby id; ``<jail dir>/sandbox`` names the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import procs
from ...errors import ApiError
from ..base import Capabilities, SandboxSpec
from . import guest_artifacts, jailer, ram, tap
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
MACHINE_VERSION = 2  # bump when the VM's devices (and so its migration state) change
STATE = "checkpoint.img"  # the migration stream (the Manager checks for this name)
SANDBOX_FILE = "sandbox"  # in a jail dir: the sandbox a standby VM was handed to
RECORD_FILE = "vm.json"  # in a jail dir (outside the chroot): what a restarted daemon needs
STANDBY_PREFIX = "sb-"
MIGRATE_BANDWIDTH = 64 << 30  # bytes/s: unlimited in effect


@dataclass
class VM:
    id: str  # the sandbox (a standby's own id until it is handed out)
    jail_id: str
    uid: int
    paths: jailer.JailPaths
    overlay: Path
    rootfs_image: Path
    vm: VMConfig
    ram_fd: int | None = None  # template boot: the RAM memfd, until checkpoint seals it
    qmp: QMP | None = None  # standby: the QMP connection opened at spawn
    listener: socket.socket | None = None  # standby: placeholder the chardev connected to
    sock_dir: Path | None = None  # standby: the directory bound at /agent


@dataclass
class TemplateRAM:
    fd: int
    standby: list[VM] = field(default_factory=list)
    filling: bool = False


# s the jailer has to set up the jail and exec QEMU
JAIL_TIMEOUT = 60.0


class MicroVMBackend:
    capabilities = Capabilities(name="microvm", checkpoint=True, network=False, guest_net=True)

    def __init__(self, home: Path, *, qemu: str = QEMU_BIN, accel: Accel = "kvm",
                 uid_base: int = UID_BASE, uid_count: int = UID_COUNT,
                 overlay_mib: int = OVERLAY_MIB, artifacts: guest_artifacts.Artifacts | None = None,
                 console_log: bool = False, python: str | None = None,
                 images: Path | None = None, standby: int = 1) -> None:
        self.home = home
        self.dir = home / "microvm"
        self.jail_base = self.dir / "jail"
        self.standby_dir = self.dir / "standby"
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
        self.standby = standby  # spawned QEMUs kept waiting per template image and size
        # images restore only into the same accelerator and device set (MACHINE_VERSION)
        self.image_kind = f"microvm-{accel}-m{MACHINE_VERSION}"
        self._artifacts = artifacts
        self.vms: dict[str, VM] = {}
        self._rams: dict[str, TemplateRAM] = {}  # template image's ram_id -> its memfd
        self._tasks: set[asyncio.Task[Any]] = set()
        self._image_locks: dict[str, asyncio.Lock] = {}
        self._support: list[tuple[str, str]] | None = None
        self._init_checked = False
        for d in (self.jail_base, self.images, self.standby_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.jail_base = jailer.check_chroot_base(self.jail_base.resolve())

    # ---- artifacts -----------------------------------------------------------------------

    def runtime(self) -> dict[str, str]:
        return {"vmm": self.qemu, "accel": self.accel}

    def artifacts(self) -> guest_artifacts.Artifacts:
        art = self._artifacts or guest_artifacts.current_artifacts(self.dir)
        if art is None or not art.exist():
            raise ApiError("unavailable", f"microVM guest kernel not built in {self.dir} "
                           "(scripts/build-microvm-kernel.sh)")
        if not self._init_checked:
            self._init_checked = True
            if not guest_artifacts.built_from_this_init(art):
                log.warning("the guest initramfs %s is of an older /init: guests may lack "
                            "what the daemon asks of them (their network address); rebuild "
                            "it with scripts/build-microvm-kernel.sh", art.initrd)
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
        return await self._once(key, out, lambda: guest_artifacts.build_rootfs_image(rootfs, out))

    def disk_mib(self, spec: SandboxSpec) -> int:
        """The size of the sandbox's writable layer (an ext4 image: ENOSPC past it, and
        its own inode count)."""
        return spec.disk_mib or self.overlay_mib

    async def _overlay_base(self, agent_dir: Path, size_mib: int) -> Path:
        """The blank writable layer carrying the agent package, of size_mib; keyed by the
        package's content (a changed agent gets a new image, never a stale cached one)."""
        h = hashlib.sha256()
        for f in sorted((agent_dir / "cpuos_agent").glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        key = f"overlay-{h.hexdigest()[:16]}-{size_mib}"
        out = self.images / f"{key}.ext4"
        return await self._once(key, out, lambda: guest_artifacts.build_overlay_image(
            out, size_mib, agent_dir))

    # ---- uids and jails ------------------------------------------------------------------
    def _exec_dir(self) -> Path:
        return self.jail_base / Path(self.qemu).name

    def _uids_in_use(self) -> set[int]:
        used = {vm.uid for vm in self.vms.values()}
        used |= {vm.uid for tr in self._rams.values() for vm in tr.standby}
        if self._exec_dir().is_dir():
            for j in self._exec_dir().iterdir():
                with contextlib.suppress(OSError):
                    used.add((j / "root" / "run").stat().st_uid)
        return used

    def _allocate_uid(self) -> int:
        used = self._uids_in_use()
        for uid in range(self.uid_base, self.uid_base + self.uid_count):
            if uid not in used:
                return uid
        raise ApiError("limit_exceeded", "no free sandbox uid for another microVM")

    def _jails(self) -> dict[str, str]:
        """jail id -> the sandbox it runs (a standby not handed out: its own id)."""
        out: dict[str, str] = {}
        if not self._exec_dir().is_dir():
            return out
        for j in self._exec_dir().iterdir():
            if not jailer.ID_RE.fullmatch(j.name):
                continue
            sid = j.name
            with contextlib.suppress(OSError):
                named = (j / SANDBOX_FILE).read_text().strip()
                if jailer.ID_RE.fullmatch(named):
                    sid = named
            out[j.name] = sid
        return out

    def _record(self, rec: VM) -> None:
        """Write what a restarted daemon needs to pause or kill this VM."""
        data = {"uid": rec.uid, "overlay": str(rec.overlay),
                "rootfs_image": str(rec.rootfs_image), "vm": dataclasses.asdict(rec.vm)}
        tmp = rec.paths.jail_dir / (RECORD_FILE + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, rec.paths.jail_dir / RECORD_FILE)

    def _rec(self, sandbox_id: str) -> VM:
        """The VM running sandbox_id: known, or (a restarted daemon) read back from its
        jail's record."""
        rec = self.vms.get(sandbox_id)
        if rec is not None:
            return rec
        jid = self._jail_of(sandbox_id)
        paths = jailer.jail_paths(jid, self.qemu, self.jail_base, self.qemu)
        try:
            data = json.loads((paths.jail_dir / RECORD_FILE).read_text())
            raw = data["vm"]
            vm = VMConfig(**{**raw, "extra": tuple(raw.get("extra") or ())})
            rec = VM(sandbox_id, jid, int(data["uid"]), paths, Path(data["overlay"]),
                     Path(data["rootfs_image"]), vm)
        except (OSError, ValueError, KeyError, TypeError):
            raise ApiError("not_found", f"no microVM {sandbox_id}") from None
        self.vms[sandbox_id] = rec
        return rec

    def _jail_of(self, sandbox_id: str) -> str:
        rec = self.vms.get(sandbox_id)
        if rec is not None:
            return rec.jail_id
        for jid, sid in self._jails().items():
            if sid == sandbox_id:
                return jid
        return sandbox_id

    # ---- launching -----------------------------------------------------------------------
    def vm_config(self, spec: SandboxSpec, *, incoming: bool = False) -> VMConfig:
        """The VM a sandbox of spec runs (paths as seen inside its jail)."""
        return VMConfig(
            qmp_socket=JAIL_QMP, kernel=JAIL_KERNEL, initrd=JAIL_INITRD,
            cmdline=kernel_cmdline(console=self.console_log, accel=self.accel,
                                   extra=[f"cpuos.hostname={spec.hostname}"]),
            serial_log="/run/console.log" if self.console_log else None,
            vcpus=spec.vcpus, memory_mib=spec.memory_mib, rootfs_image=JAIL_ROOT_IMG,
            overlay_image=JAIL_OVERLAY_IMG, agent_socket=f"{JAIL_AGENT_DIR}/{spec.sock_path.name}",
            accel=self.accel, incoming=incoming, qemu=self.qemu, tap=tap.TAP)

    def jailed_argv(self, spec: SandboxSpec, uid: int, vm: VMConfig, rootfs_image: Path,
                    overlay: Path, jail_id: str | None = None, ram_fd: int | None = None
                    ) -> list[str]:
        """The jailer's argv for ``vm`` (jail ``jail_id``, default the sandbox's id);
        ``ram_fd``: a RAM memfd QEMU inherits (``vm.memory_file`` names it)."""
        art = self.artifacts()
        if self._support is None:
            self._support = support_files(self.qemu, self.accel)
        version = jailer.cgroup_version()
        return jailer.jailer_argv(
            sandbox_id=jail_id or spec.id, exec_file=self.qemu, exec_dest=self.qemu, uid=uid,
            gid=uid, chroot_base=self.jail_base, args=qemu_argv(vm)[1:], files=self._support,
            binds=[(art.vmlinux, JAIL_KERNEL, True), (art.initrd, JAIL_INITRD, True),
                   (str(rootfs_image), JAIL_ROOT_IMG, True),
                   (str(overlay), JAIL_OVERLAY_IMG, False),
                   (str(spec.sock_dir), JAIL_AGENT_DIR, True)],
            cgroups=jailer.cgroup_limits(version, cpus=spec.vcpus,
                                         memory_bytes=(spec.memory_mib + MEM_OVERHEAD_MIB) << 20,
                                         pids=PIDS_MAX),
            cgroup_version=version,
            rlimits={"nofile": 4096, "fsize": self.disk_mib(spec) << 20, "core": 0},
            devices=("kvm", "tun", "null", "zero", "urandom"), new_netns=True, tap=tap.TAP,
            python=self.python,
            keep_fds=() if ram_fd is None else (ram_fd,), mount_proc=ram_fd is not None,
            detach=True)

    async def _launch(self, spec: SandboxSpec, uid: int, vm: VMConfig, rootfs_image: Path,
                      overlay: Path, jail_id: str | None = None, ram_fd: int | None = None
                      ) -> VM:
        jid = jail_id or spec.id
        if ram_fd is not None:
            vm = dataclasses.replace(vm, memory_file=ram.jail_path(ram_fd))
        argv = self.jailed_argv(spec, uid, vm, rootfs_image, overlay, jid, ram_fd)
        spec.dir.mkdir(parents=True, exist_ok=True)
        with open(spec.dir / "qemu.log", "ab") as logf:
            proc = procs.spawn(argv, stdout=logf, stderr=logf,
                               pass_fds=() if ram_fd is None else (ram_fd,))
        # --detach: the jailer exits once QEMU has been exec'd (QEMU is left to us, the
        # subreaper); no supervisor process stays beside each VM
        try:
            rc = await proc.wait(JAIL_TIMEOUT)
        except BaseException:
            proc.killpg()
            proc.kill()
            raise
        paths = jailer.jail_paths(jid, self.qemu, self.jail_base, self.qemu)
        if rc != 0:
            await asyncio.to_thread(jailer.cleanup, jid, self.jail_base, Path(self.qemu).name)
            raise ApiError("internal", f"microVM jail failed (status {rc}): "
                           f"{self._log_tail(spec.dir)}")
        rec = VM(spec.id, jid, uid, paths, overlay, rootfs_image, vm)
        self.vms[spec.id] = rec
        return rec

    def _log_tail(self, d: Path) -> str:
        with contextlib.suppress(OSError):
            return (d / "qemu.log").read_bytes()[-800:].decode(errors="replace").strip()
        return ""

    async def _qmp(self, rec: VM, timeout: float = 10.0) -> QMP:
        q = QMP(rec.paths.host_path(JAIL_QMP))
        connect = asyncio.create_task(q.connect(timeout))
        waits: set[asyncio.Task[Any]] = {connect, asyncio.create_task(self._until_dead(rec))}
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

    async def _link(self, rec: VM, spec: SandboxSpec) -> None:
        """The VM's tap into the sandbox's network namespace (tap.py), if it has one."""
        if spec.netns is None:
            return
        try:
            pid = int(rec.paths.pid_file.read_text())
            await asyncio.to_thread(tap.attach, spec.netns, pid)
        except (OSError, ValueError, tap.TapError) as e:
            raise QMPFailure(f"its network link: {e}") from None

    @staticmethod
    async def _until_dead(rec: VM) -> None:
        try:
            pid = int(rec.paths.pid_file.read_text())
        except (OSError, ValueError):
            return
        while _alive(pid):
            await asyncio.sleep(0.02)

    async def _writable_layer(self, src: Path, dst: Path, uid: int) -> None:
        dst.unlink(missing_ok=True)
        await asyncio.to_thread(guest_artifacts.copy_sparse, src, dst)
        os.chown(dst, uid, uid)
        os.chmod(dst, 0o600)

    async def start(self, spec: SandboxSpec) -> None:
        jailer.check_id(spec.id)
        self.artifacts()
        try:
            rootfs_image = await self.prepare_template(spec.rootfs)
            base = await self._overlay_base(spec.agent_dir, self.disk_mib(spec))
        except guest_artifacts.KernelError as e:
            raise ApiError("internal", f"microVM disk images: {e}") from None
        uid = self._allocate_uid()
        spec.dir.mkdir(parents=True, exist_ok=True)
        overlay = spec.dir / "overlay.ext4"
        await self._writable_layer(base, overlay, uid)
        vm = self.vm_config(spec)
        ram_fd = None
        if spec.template_boot:
            # RAM in a memfd the clones will share (ram.py); read-write: the template runs
            ram_fd = ram.new(f"cpuos-{spec.id}", spec.memory_mib << 20)
            vm = dataclasses.replace(vm, memory_shared=True)
        try:
            rec = await self._launch(spec, uid, vm, rootfs_image, overlay, ram_fd=ram_fd)
        except BaseException:
            if ram_fd is not None:
                os.close(ram_fd)
            raise
        rec.ram_fd = ram_fd
        try:
            q = await self._qmp(rec)  # (QMP answers once QEMU has opened its tap)
            try:
                await self._link(rec, spec)
                status = await q.query_status()
            finally:
                await q.close()
            if status != "running":
                raise QMPFailure(f"VM is {status!r} after start")
            self._record(rec)
        except (QMPFailure, OSError) as e:
            tail = self._log_tail(spec.dir)
            await self.kill(spec.id)
            raise ApiError("internal", f"microVM failed to start: {e}: {tail}") from None

    async def kill(self, sandbox_id: str) -> None:
        jailer.check_id(sandbox_id)
        jid = self._jail_of(sandbox_id)
        rec = self.vms.pop(sandbox_id, None)
        await self._end(jid, rec)

    async def _end(self, jid: str, rec: VM | None) -> None:
        paths = jailer.jail_paths(jid, self.qemu, self.jail_base, self.qemu)
        pid = None
        with contextlib.suppress(OSError, ValueError):
            pid = int(paths.pid_file.read_text())
            os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(jailer.cleanup, jid, self.jail_base, Path(self.qemu).name)
        if pid is not None:  # our child when we are its subreaper (cpuosd): reap it now
            await asyncio.to_thread(procs.reap_orphans)  # (never a child registered there)
        if jid.startswith(STANDBY_PREFIX) and jailer.ID_RE.fullmatch(jid):
            shutil.rmtree(self.standby_dir / jid, ignore_errors=True)
        if rec is None:
            return
        if rec.qmp is not None:
            await rec.qmp.close()
        if rec.listener is not None:
            rec.listener.close()
        if rec.ram_fd is not None:
            os.close(rec.ram_fd)
            rec.ram_fd = None

    async def running(self) -> dict[str, str]:
        out: dict[str, str] = {}
        jails = self._jails()
        standing = {tr_vm.jail_id for tr in self._rams.values() for tr_vm in tr.standby}
        for d in self.standby_dir.iterdir():  # a standby's directory whose jail is gone
            with contextlib.suppress(OSError):
                if d.name not in jails and d.name not in standing \
                        and time.time() - d.stat().st_mtime > 60:  # (not one being made)
                    shutil.rmtree(d, ignore_errors=True)
        for jid, sid in jails.items():
            state = "stopped"
            with contextlib.suppress(OSError, ValueError):
                if _alive(int((self._exec_dir() / jid / jailer.PID_FILE).read_text())):
                    state = "running"
            out[sid] = state
        return out

    async def close(self) -> None:
        """End the standby VMs and drop the template memfds (sandboxes keep running)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:  # a standby being spawned ends its QEMU before it lets go (bounded)
            await asyncio.wait(tasks, timeout=30)
        for tr in self._rams.values():
            while tr.standby:
                sb = tr.standby.pop()
                await self._end(sb.jail_id, sb)
            os.close(tr.fd)
        self._rams.clear()

    # ---- checkpoint / restore -----------------------------------------------------------
    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        """Save the VM to image_dir (see the module docstring) and end it."""
        rec = self._rec(sandbox_id)
        shared = rec.ram_fd is not None
        try:
            await self.save_state(sandbox_id, image_dir, ignore_shared=shared)
            meta = json.loads((image_dir / "meta.json").read_text())
            fd, rec.ram_fd = rec.ram_fd, None
        finally:
            await self.kill(sandbox_id)  # QEMU gone: no shared writable mapping is left
        if fd is None:
            return
        try:
            t0 = time.monotonic()
            size = await asyncio.to_thread(ram.save, fd, image_dir / "ram")  # sparse
            await asyncio.to_thread(ram.fill, fd)
            ram.seal(fd)
            log.info("template RAM of %s: %d MiB of pages saved, memfd filled and sealed in "
                     "%.0f ms", sandbox_id, size >> 20, (time.monotonic() - t0) * 1e3)
        except BaseException:
            os.close(fd)
            raise
        meta.update(ram="shared", ram_id=secrets.token_hex(8))
        (image_dir / "meta.json").write_text(json.dumps(meta, indent=1))
        self._rams[meta["ram_id"]] = TemplateRAM(fd)

    async def _template_ram(self, image_dir: Path, meta: dict[str, Any]) -> TemplateRAM:
        """The template's sealed RAM memfd (a restarted daemon loads it from the saved
        pages)."""
        ram_id = str(meta["ram_id"])
        async with self._image_locks.setdefault("ram:" + ram_id, asyncio.Lock()):
            tr = self._rams.get(ram_id)
            if tr is None:
                fd = await asyncio.to_thread(ram.load, image_dir / "ram", f"cpuos-{ram_id}")
                tr = self._rams[ram_id] = TemplateRAM(fd)
            return tr

    @staticmethod
    def _read_meta(image_dir: Path) -> tuple[dict[str, Any], VMConfig]:
        try:
            meta = json.loads((image_dir / "meta.json").read_text())
            raw = meta["vm"]
            vm = VMConfig(**{**raw, "extra": tuple(raw.get("extra") or ())})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ApiError("internal", f"microVM image {image_dir.name} is unreadable: {e}"
                           ) from None
        return meta, vm

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        jailer.check_id(spec.id)
        meta, vm = self._read_meta(image_dir)
        if (vm.vcpus, vm.memory_mib) != (spec.vcpus, spec.memory_mib):
            raise ApiError("conflict", f"image {image_dir.name} is of a {vm.vcpus}-vCPU "
                           f"{vm.memory_mib} MiB VM, not {spec.vcpus} vCPUs {spec.memory_mib} MiB")
        vm = dataclasses.replace(vm, incoming=True, start_paused=False,
                                 agent_socket=f"{JAIL_AGENT_DIR}/{spec.sock_path.name}")
        tr = None
        ram_fd = None
        if meta.get("ram") == "shared":
            tr = await self._template_ram(image_dir, meta)
            vm = dataclasses.replace(vm, memory_shared=False)
            while tr.standby:
                sb = tr.standby.pop(0)
                self._fill_standby(tr, image_dir, spec, vm)
                try:
                    return await self._handout(sb, spec, image_dir)
                except ApiError as e:  # it died waiting, or failed its load: start afresh
                    log.warning("standby microVM %s unusable: %s", sb.jail_id, e.message)
            ram_fd = tr.fd
        uid = self._allocate_uid()
        spec.dir.mkdir(parents=True, exist_ok=True)
        overlay = spec.dir / "overlay.ext4"
        await self._writable_layer(image_dir / "overlay.ext4", overlay, uid)
        rec = await self._launch(spec, uid, vm, Path(meta["rootfs_image"]), overlay,
                                 ram_fd=ram_fd)
        try:
            q = await self._qmp(rec)
            try:
                await self._link(rec, spec)
                await self._incoming(q, image_dir, tr is not None)
            finally:
                await q.close()
            self._record(rec)
        except (QMPFailure, OSError) as e:
            tail = self._log_tail(spec.dir)
            await self.kill(spec.id)
            raise ApiError("internal", f"microVM restore failed: {e}: {tail}") from None
        if tr is not None:
            self._fill_standby(tr, image_dir, spec, vm)

    async def _incoming(self, q: QMP, image_dir: Path, shared: bool) -> None:
        """Load image_dir's state into a QEMU waiting on ``-incoming defer``; run it.
        ``shared``: a template image (saved with ``x-ignore-shared``, which the loading
        side must have on too)."""
        await q.set_ignore_shared(shared)
        fd = os.open(image_dir / STATE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await q.migrate_incoming_fd(fd)
        finally:
            os.close(fd)
        status = "inmigrate"
        deadline = time.monotonic() + 60
        while status == "inmigrate" and time.monotonic() < deadline:
            status = await q.query_status()
            if status == "inmigrate":
                await asyncio.sleep(0.002)
        if status == "inmigrate":
            raise QMPFailure("the VM state did not load within 60s")
        if status in ("paused", "prelaunch", "postmigrate"):
            await q.cont()
        elif status != "running":
            info = await q.execute("query-migrate")
            raise QMPFailure(f"VM is {status!r} after loading its state: "
                             f"{info.get('error-desc', info.get('status'))}")

    # ---- standby VMs -----------------------------------------------------------------------
    def standby_waiting(self) -> int:
        """How many standby QEMUs wait for a clone (over every template image)."""
        return sum(len(tr.standby) for tr in self._rams.values())

    def _fill_standby(self, tr: TemplateRAM, image_dir: Path, like: SandboxSpec,
                      vm: VMConfig) -> None:
        if tr.filling or len(tr.standby) >= self.standby:
            return
        tr.filling = True

        async def fill() -> None:
            try:
                while len(tr.standby) < self.standby:
                    tr.standby.append(await self._spawn_standby(image_dir, like, vm, tr))
            except Exception:
                log.exception("standby microVM for %s", image_dir.name)
            finally:
                tr.filling = False

        t = asyncio.get_running_loop().create_task(fill())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _spawn_standby(self, image_dir: Path, like: SandboxSpec, vm: VMConfig,
                             tr: TemplateRAM) -> VM:
        """A jailed QEMU waiting on ``-incoming defer`` for image_dir, its agent chardev
        connected to a placeholder listener (QEMU retries a failed connect only after a
        second; this way the connection is made before a sandbox needs it)."""
        jid = STANDBY_PREFIX + secrets.token_hex(8)
        d = self.standby_dir / jid
        spec = dataclasses.replace(like, id=jid, dir=d, template_boot=False, adopt=None)
        spec.sock_dir.mkdir(parents=True)
        spec.sock_dir.chmod(0o755)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(spec.sock_path))
            listener.listen(1)
            listener.setblocking(False)
            os.chmod(spec.sock_path, 0o666)
            uid = self._allocate_uid()
            overlay = d / "overlay.ext4"
            await self._writable_layer(image_dir / "overlay.ext4", overlay, uid)
            meta, _ = self._read_meta(image_dir)
            rec = await self._launch(spec, uid, vm, Path(meta["rootfs_image"]), overlay,
                                     ram_fd=tr.fd)
        except BaseException:
            listener.close()
            # (cancelled while the jailer ran: a QEMU it started must not outlive us)
            await self._end(jid, None)
            shutil.rmtree(d, ignore_errors=True)
            raise
        self.vms.pop(jid, None)  # not a sandbox until handed out
        rec.listener, rec.sock_dir = listener, spec.sock_dir
        try:
            rec.qmp = await self._qmp(rec)
            if await rec.qmp.query_status() != "inmigrate":
                raise QMPFailure("a standby VM is not waiting for its state")
            self._record(rec)
        except BaseException:
            await self._end(jid, rec)
            raise
        return rec

    async def _handout(self, sb: VM, spec: SandboxSpec, image_dir: Path) -> None:
        assert sb.listener is not None and sb.sock_dir is not None and sb.qmp is not None
        loop = asyncio.get_running_loop()
        try:
            if not _alive(int(sb.paths.pid_file.read_text())):
                raise OSError("its QEMU has exited")
            conn, _ = await asyncio.wait_for(loop.sock_accept(sb.listener), 5)
        except (TimeoutError, OSError, ValueError) as e:
            await self._end(sb.jail_id, sb)
            raise ApiError("internal", f"standby microVM's agent chardev: {e}") from None
        sb.listener.close()
        sb.listener = None
        # the jail-bound directory becomes the sandbox's socket directory: the daemon's
        # listening socket (and whatever else is there) is moved in, same inodes
        for f in spec.sock_dir.iterdir():
            os.rename(f, sb.sock_dir / f.name)
        os.rmdir(spec.sock_dir)
        os.rename(sb.sock_dir, spec.sock_dir)
        (sb.paths.jail_dir / SANDBOX_FILE).write_text(spec.id + "\n")
        sb.id = spec.id
        self.vms[spec.id] = sb
        q, sb.qmp = sb.qmp, None
        try:
            await self._link(sb, spec)
            if spec.adopt is not None:
                await spec.adopt(conn)
            else:
                conn.close()  # QEMU reconnects (after a second) to the daemon's socket
            await self._incoming(q, image_dir, True)
        except (QMPFailure, OSError) as e:
            await self.kill(spec.id)
            raise ApiError("internal", f"microVM restore (standby) failed: {e}") from None
        finally:
            await q.close()

    def stats(self, sandbox_id: str) -> dict[str, int | float]:
        """The VM's memory as the host sees it (its jail cgroup); the guest's CPU and
        process figures are not measured from outside."""
        m = self.memory_usage(sandbox_id)
        return {} if m is None else {"memory_bytes": m}

    def memory_watch(self, sandbox_id: str, threshold: int) -> int | None:
        """None: a guest kernel has its own OOM killer (no guard in the agent to wake)."""
        return None

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """CPU time of the VM's jail cgroup (QEMU: the guest's vCPUs and its devices)."""
        try:
            dirs = jailer.cgroup_dirs(self._jail_of(sandbox_id))
        except jailer.JailError:
            return None
        for d in dirs:
            try:
                if (d / "cpuacct.usage").exists():
                    return int((d / "cpuacct.usage").read_text()) / 1e9
                for line in (d / "cpu.stat").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "usage_usec":
                        return int(v) / 1e6
            except (OSError, ValueError):
                continue
        return None

    def memory_usage(self, sandbox_id: str) -> int | None:
        """Bytes charged to the VM's jail cgroup (QEMU and its guest's RAM), or None."""
        try:
            dirs = jailer.cgroup_dirs(self._jail_of(sandbox_id))
        except jailer.JailError:
            return None
        for d in dirs:
            for name in ("memory.current", "memory.usage_in_bytes"):
                try:
                    return int((d / name).read_text())
                except (OSError, ValueError):
                    continue
        return None

    # ---- state save over QMP ------------------------------------------------------------------
    async def save_state(self, sandbox_id: str, directory: Path, *,
                         ignore_shared: bool = False) -> None:
        """Stop the VM and write its state to ``directory`` (the VM stays stopped):
        ``checkpoint.img`` (the migration stream; RAM too unless ``ignore_shared`` and the
        RAM is a shared memory backend), ``overlay.ext4``, ``meta.json``."""
        rec = self._rec(sandbox_id)
        directory.mkdir(parents=True, exist_ok=True)
        q = await self._qmp(rec)
        try:
            await q.stop()
            await q.set_ignore_shared(ignore_shared)
            # to a local file: QEMU's default 128 MiB/s migration bandwidth cap is no use
            await q.execute("migrate-set-parameters", {"max-bandwidth": MIGRATE_BANDWIDTH})
            fd = os.open(directory / STATE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                         0o600)
            try:
                await q.migrate_fd(fd)
            finally:
                os.close(fd)
            await q.wait_migration()
        finally:
            await q.close()
        await asyncio.to_thread(guest_artifacts.copy_sparse, rec.overlay,
                                directory / "overlay.ext4")
        vm = dataclasses.replace(rec.vm, memory_file=None, memory_shared=True, incoming=False)
        meta = {"vm": dataclasses.asdict(vm), "rootfs_image": str(rec.rootfs_image),
                "ram": "stream"}
        (directory / "meta.json").write_text(json.dumps(meta, indent=1))


def _alive(pid: int) -> bool:
    """pid is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
