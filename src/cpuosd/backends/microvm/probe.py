"""The KVM boot probe: can a microVM guest actually boot on this host?

Opening /dev/kvm is not enough: on a host with a paravirtual KVM a guest may boot hundreds
of times slower than native and then die with a KVM "emulation failure". So the probe
boots our real kernel and initramfs (``cpuos.probe=1``: /init loads the virtio modules,
prints ``CPUOS-PROBE-OK`` on the serial console and powers off) and reports whether the
marker appeared within the timeout. The QEMU it starts is always killed and reaped.

``python -m cpuosd.backends.microvm.probe [--timeout S]`` prints the verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ... import procs
from .guest_artifacts import PROBE_MARKER, Artifacts, cache_dir, current_artifacts
from .qemu import QEMU, VMConfig, kernel_cmdline, qemu_argv

MAX_LOG = 1 << 20


def _tail(path: Path, n: int = 300) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return " | ".join(x.strip() for x in text.strip().splitlines()[-4:])


def kvm_boot_probe(timeout: float = 5.0, *, artifacts: Artifacts | None = None,
                   qemu: str | None = None, cache: Path | None = None) -> tuple[bool, str]:
    """(ok, reason). ok only when a guest booted to the marker within ``timeout`` seconds.
    ``cache``: where to look for the guest artifacts when none are given (default
    ``guest_artifacts.cache_dir()``)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
    except OSError as e:
        return False, f"/dev/kvm cannot be opened: {e.strerror}"
    exe = qemu or shutil.which(QEMU)
    if exe is None:
        return False, f"{QEMU} is not installed (apt-get install qemu-system-x86)"
    if not os.path.isfile(exe):
        return False, f"{exe} does not exist"
    art = artifacts or current_artifacts(cache)
    if art is None or not art.exist():
        return False, (f"guest kernel artifacts missing in {cache or cache_dir()} "
                       "(run scripts/build-microvm-kernel.sh)")
    with tempfile.TemporaryDirectory(prefix="cpuos-kvm-probe-") as tmp:
        log = Path(tmp) / "serial.log"
        cfg = VMConfig(qmp_socket=str(Path(tmp) / "qmp.sock"), kernel=art.vmlinux,
                       initrd=art.initrd, cmdline=kernel_cmdline(console=True,
                                                                 extra=["cpuos.probe=1"]),
                       vcpus=1, memory_mib=256, serial_log=str(log), qemu=exe)
        t0 = time.monotonic()
        with open(Path(tmp) / "stderr", "w+b") as stderr:
            child = procs.spawn(qemu_argv(cfg), stdout=procs.DEVNULL, stderr=stderr,
                                env={"PATH": "/usr/bin:/bin"})
        try:
            while True:
                elapsed = time.monotonic() - t0
                with contextlib.suppress(OSError):
                    if log.stat().st_size <= MAX_LOG and PROBE_MARKER.encode() in log.read_bytes():
                        return True, f"guest booted to the probe marker in {elapsed:.2f}s"
                rc = child.poll()
                if rc is not None:
                    err = (Path(tmp) / "stderr").read_bytes().decode(errors="replace")
                    err = err.strip()[-300:]
                    return False, (f"QEMU exited with status {rc} after {elapsed:.2f}s before "
                                   f"the guest reached the marker: {err or _tail(log)!s}")
                if elapsed > timeout:
                    tail = _tail(log)
                    return False, (f"guest did not reach the probe marker within {timeout:g}s "
                                   "(KVM too slow or unusable here); serial console: "
                                   + (repr(tail) if tail else "nothing"))
                time.sleep(0.02)
        finally:
            child.kill()  # by its pidfd: a no-op once it has exited
            child.wait_sync(10)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m cpuosd.backends.microvm.probe")
    ap.add_argument("--timeout", type=float, default=5.0)
    ns = ap.parse_args()
    ok, reason = kvm_boot_probe(ns.timeout)
    print(("ok: " if ok else "no: ") + reason)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
