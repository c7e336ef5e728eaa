"""QEMU ``-M microvm`` command lines (pure functions) and an async QMP client.

The command line is built for ``qemu-system-x86_64`` from Debian (7.2): microvm machine
without legacy devices, KVM with ``-cpu host,-arch-capabilities``, QEMU's own seccomp
sandbox with every optional deny, never ``-daemonize`` (the jailer supervises QEMU),
PVH direct boot of an uncompressed vmlinux, and virtio-mmio devices only:

* ``virtio-blk-device`` ``serial=cpuos-root``: the template's ext4 image, read-only;
* ``virtio-blk-device`` ``serial=cpuos-overlay``: the sandbox's writable layer;
* ``virtio-serial-device`` + ``virtserialport name=cpuos.agent`` on a unix-socket chardev:
  the agent channel (by default QEMU *connects* to the daemon's per-sandbox listening
  socket, reconnecting every second);
* ``virtio-net-device`` on a tap, only when networking is on.

The guest's serial console is discarded (no serial device at all) unless a log file is
asked for (probe and debugging only; under the jailer it is bounded by RLIMIT_FSIZE).

Template clones (QEMU 7.2: no ``file:`` migration URI, no ``mapped-ram``): the template
boots with its RAM in ``memory-backend-file,share=on`` on a tmpfs file; it is stopped,
``x-ignore-shared`` is set and the device state migrated to a file; a clone maps the same
RAM file ``share=off`` (MAP_PRIVATE, copy-on-write) and starts with ``-incoming defer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from qemu.qmp import ConnectError, ExecInterruptedError, QMPClient, QMPError

from .jailer import ldd_deps

QEMU = "qemu-system-x86_64"
MACHINE = "microvm,x-option-roms=off,pit=off,pic=off,rtc=off"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
KVM_CPU = "host,-arch-capabilities"
TCG_CPU = "max"
AGENT_PORT_NAME = "cpuos.agent"
ROOT_SERIAL = "cpuos-root"
OVERLAY_SERIAL = "cpuos-overlay"
# Firmware the microvm machine loads (qboot); Debian: a symlink to qboot.rom.
FIRMWARE = ("/usr/share/qemu/bios-microvm.bin",)
MODULE_DIR = "/usr/lib/x86_64-linux-gnu/qemu"

Accel = Literal["kvm", "tcg"]


@dataclass(frozen=True)
class VMConfig:
    """Everything the command line depends on. Paths are as QEMU sees them (inside the jail
    when jailed)."""

    qmp_socket: str
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str = ""
    vcpus: int = 1
    memory_mib: int = 512
    rootfs_image: str | None = None
    overlay_image: str | None = None
    agent_socket: str | None = None
    agent_socket_server: bool = False  # False: QEMU connects to the daemon's socket
    tap: str | None = None
    mac: str | None = None
    serial_log: str | None = None  # None: no serial device; the console goes nowhere
    accel: Accel = "kvm"
    memory_file: str | None = None  # memory-backend-file mem-path (template / clone)
    memory_shared: bool = True  # share=on (template boot) / share=off (clone, MAP_PRIVATE)
    incoming: bool = False  # -incoming defer
    start_paused: bool = False  # -S
    qemu: str = QEMU
    extra: tuple[str, ...] = field(default_factory=tuple)


def _opt(value: str) -> str:
    """A value inside a QEMU option list: commas are doubled."""
    return value.replace(",", ",,")


def qemu_argv(cfg: VMConfig) -> list[str]:
    if cfg.vcpus < 1 or cfg.memory_mib < 16:
        raise ValueError("need at least 1 vCPU and 16 MiB")
    machine = MACHINE + (",isa-serial=on" if cfg.serial_log else ",isa-serial=off")
    if cfg.accel == "tcg":
        # no kvmclock under TCG: the guest calibrates its TSC against the PIT (and reads
        # the time from the RTC); without them it stalls in early boot
        machine = machine.replace("pit=off", "pit=on").replace("rtc=off", "rtc=on")
    argv = [cfg.qemu, "-M", machine, "-nodefaults", "-no-user-config", "-display", "none",
            "-no-reboot"]
    if cfg.accel == "kvm":
        argv += ["-cpu", KVM_CPU, "-enable-kvm"]
    elif cfg.accel == "tcg":
        argv += ["-cpu", TCG_CPU, "-accel", "tcg"]
    else:
        raise ValueError(f"unknown accelerator {cfg.accel!r}")
    argv += ["-smp", str(cfg.vcpus), "-m", str(cfg.memory_mib), "-sandbox", SANDBOX]
    # always a named memory backend: migration matches RAM blocks by name, and an image of
    # a template clone (file-backed RAM) restores into plain RAM
    if cfg.memory_file is not None:
        argv += ["-object", f"memory-backend-file,id=mem,size={cfg.memory_mib}M,"
                 f"mem-path={_opt(cfg.memory_file)},share={'on' if cfg.memory_shared else 'off'}"]
    else:
        argv += ["-object", f"memory-backend-ram,id=mem,size={cfg.memory_mib}M"]
    argv += ["-machine", "memory-backend=mem"]
    if cfg.kernel is not None:
        argv += ["-kernel", cfg.kernel]
        if cfg.initrd is not None:
            argv += ["-initrd", cfg.initrd]
        if cfg.cmdline:
            argv += ["-append", cfg.cmdline]
    if cfg.rootfs_image is not None:
        argv += ["-drive", f"id=root,file={_opt(cfg.rootfs_image)},format=raw,if=none,"
                 "readonly=on",
                 "-device", f"virtio-blk-device,drive=root,serial={ROOT_SERIAL}"]
    if cfg.overlay_image is not None:
        argv += ["-drive", f"id=overlay,file={_opt(cfg.overlay_image)},format=raw,if=none,"
                 "discard=unmap",
                 "-device", f"virtio-blk-device,drive=overlay,serial={OVERLAY_SERIAL}"]
    if cfg.agent_socket is not None:
        mode = "server=on,wait=off" if cfg.agent_socket_server else "server=off,reconnect=1"
        argv += ["-device", "virtio-serial-device,max_ports=2",
                 "-chardev", f"socket,id=agent,path={_opt(cfg.agent_socket)},{mode}",
                 "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME},nr=1"]
    if cfg.tap is not None:
        dev = "virtio-net-device,netdev=net0" + (f",mac={cfg.mac}" if cfg.mac else "")
        argv += ["-netdev", f"tap,id=net0,ifname={_opt(cfg.tap)},script=no,downscript=no",
                 "-device", dev]
    if cfg.serial_log is not None:
        argv += ["-chardev", f"file,id=serial0,path={_opt(cfg.serial_log)}",
                 "-serial", "chardev:serial0"]
    argv += ["-qmp", f"unix:{_opt(cfg.qmp_socket)},server=on,wait=off"]
    if cfg.incoming:
        argv += ["-incoming", "defer"]
    if cfg.start_paused:
        argv.append("-S")
    argv += list(cfg.extra)
    assert "-daemonize" not in argv
    return argv


def template_boot_argv(cfg: VMConfig, mem_path: str) -> list[str]:
    """First boot of a template: its RAM in a shared file (later ``x-ignore-shared``)."""
    return qemu_argv(replace(cfg, memory_file=mem_path, memory_shared=True, incoming=False))


def clone_argv(cfg: VMConfig, mem_path: str) -> list[str]:
    """A clone of a template: the RAM file mapped private, device state from a migration."""
    return qemu_argv(replace(cfg, memory_file=mem_path, memory_shared=False, incoming=True))


# Under TCG the TSC and delay-loop calibrations against the emulated PIT are timing
# dependent (they fail on a loaded host and boot then stalls): give the values instead.
TCG_CMDLINE = ("tsc_early_khz=2000000", "lpj=8000000")


def kernel_cmdline(*, console: bool = False, accel: Accel = "kvm",
                   extra: Sequence[str] = ()) -> str:
    """The guest kernel command line: quiet, no legacy probing, panic -> VM exit."""
    parts = ["panic=-1", "reboot=t", "pci=off", "i8042.noaux", "i8042.nomux", "i8042.nopnp",
             "i8042.dumbkbd", "tsc=reliable", "no_timer_check", "random.trust_cpu=on"]
    parts += ["console=ttyS0", "earlyprintk=ttyS0"] if console else ["quiet", "8250.nr_uarts=0"]
    if accel == "tcg":
        parts += TCG_CMDLINE
    return " ".join([*parts, *extra])


def support_files(qemu: str = f"/usr/bin/{QEMU}", accel: Accel = "kvm",
                  firmware: Sequence[str] = FIRMWARE) -> list[tuple[str, str]]:
    """(host path, jail path) of every file QEMU needs in its jail: its shared libraries
    (from ``ldd``), the machine firmware and, for TCG, the accelerator module and its
    libraries (Debian builds TCG as a module)."""
    files = [(p, p) for p in ldd_deps(qemu)]
    for fw in firmware:
        files.append((fw, fw))
    if accel == "tcg":
        mod = f"{MODULE_DIR}/accel-tcg-x86_64.so"
        if os.path.exists(mod):
            files.append((mod, mod))
            files += [(p, p) for p in ldd_deps(mod)]
    seen: set[str] = set()
    out = []
    for src, dst in files:
        if dst not in seen:
            seen.add(dst)
            out.append((src, dst))
    return out


# ---- QMP --------------------------------------------------------------------------------------

class QMPFailure(Exception):
    pass


def connect_unix(path: str) -> socket.socket:
    """A connected unix stream socket. Paths longer than sun_path (108 bytes; jail paths
    under $CPUOS_HOME with a 64-character id are) go through ``/proc/self/fd/<dir>``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if len(os.fsencode(path)) < 100:
            sock.connect(path)
        else:
            dfd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
            try:
                sock.connect(f"/proc/self/fd/{dfd}/{os.path.basename(path)}")
            finally:
                os.close(dfd)
    except BaseException:
        sock.close()
        raise
    return sock


class QMP:
    """A QMP connection to one QEMU (async, ``qemu.qmp``)."""

    def __init__(self, path: str | Path, name: str = "cpuosd") -> None:
        self.path = str(path)
        self.client = QMPClient(name)
        self._fileno = -1

    async def connect(self, timeout: float = 5.0) -> None:
        """Connect, retrying until the socket appears (QEMU creates it at startup)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = connect_unix(self.path)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise QMPFailure(f"cannot connect to QMP at {self.path}: {e}") from None
                await asyncio.sleep(0.02)
        self._fileno = sock.fileno()  # kept: the event loop may take the socket object over
        try:
            await asyncio.wait_for(self.client.connect(sock), max(1.0, deadline - time.monotonic()))
        except (ConnectError, TimeoutError) as e:
            sock.close()
            raise QMPFailure(f"QMP handshake at {self.path} failed: {e}") from None

    async def execute(self, cmd: str, args: dict[str, Any] | None = None,
                      timeout: float = 10.0) -> Any:
        try:
            return await asyncio.wait_for(self.client.execute(cmd, args), timeout)
        except TimeoutError:
            raise QMPFailure(f"QMP {cmd} did not answer within {timeout}s") from None
        except QMPError as e:
            raise QMPFailure(f"QMP {cmd}: {e}") from None

    async def query_status(self) -> str:
        r = await self.execute("query-status")
        return str(r["status"])

    async def stop(self) -> None:
        await self.execute("stop")

    async def cont(self) -> None:
        await self.execute("cont")

    async def set_ignore_shared(self, on: bool = True) -> None:
        await self.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": on}]})

    async def migrate_exec(self, state_path: str) -> None:
        """``migrate exec:cat > state`` (needs a shell in QEMU's mount namespace and
        ``-sandbox spawn=allow``: not usable under our jail, see ``migrate_fd``)."""
        await self.execute("migrate", {"uri": f"exec:cat > {shlex.quote(state_path)}"})

    async def migrate_incoming_exec(self, state_path: str) -> None:
        await self.execute("migrate-incoming", {"uri": f"exec:cat {shlex.quote(state_path)}"})

    async def _pass_fd(self, fd: int, name: str) -> None:
        # (qemu.qmp's send_fd_scm needs asyncio's own socket wrapper; uvloop has another)
        try:
            with socket.socket(fileno=os.dup(self._fileno)) as s:
                s.sendmsg([b" "], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                    struct.pack("@i", fd))])
        except OSError as e:
            raise QMPFailure(f"passing an fd to QEMU: {e}") from None
        await self.execute("getfd", {"fdname": name})

    async def migrate_fd(self, fd: int, name: str = "migout") -> None:
        """Migrate to an fd opened by the host (a file outside the jail): no process is
        spawned, so it works under ``-sandbox spawn=deny`` and in an empty chroot."""
        await self._pass_fd(fd, name)
        await self.execute("migrate", {"uri": f"fd:{name}"})

    async def migrate_incoming_fd(self, fd: int, name: str = "migin") -> None:
        await self._pass_fd(fd, name)
        await self.execute("migrate-incoming", {"uri": f"fd:{name}"})

    async def wait_migration(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            info: dict[str, Any] = await self.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return info
            if status in ("failed", "cancelled"):
                raise QMPFailure(f"migration {status}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise QMPFailure(f"migration still {status} after {timeout}s")
            await asyncio.sleep(0.01)

    async def quit(self) -> None:
        """Ask QEMU to exit; its closing the connection is the expected answer."""
        with contextlib.suppress(ExecInterruptedError, QMPFailure, EOFError, ConnectionError):
            await self.execute("quit", timeout=5.0)
        await self.close()

    async def close(self) -> None:
        with contextlib.suppress(QMPError, OSError, EOFError):
            await self.client.disconnect()
