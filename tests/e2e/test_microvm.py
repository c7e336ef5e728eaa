"""The microVM backend end to end through the real daemon and SDK. Here the guest is
emulated (TCG): KVM guests cannot run on this kind of host (probe.py), so the daemon is
forced to ``CPUOS_BACKEND=microvm CPUOS_MICROVM_ACCEL=tcg``; on a host where the KVM boot
probe passes the same tests run again under KVM (``-m kvm``). Everything but the
accelerator is what a KVM host runs: the jailer, QEMU ``-M microvm``, the guest kernel and
/init, the agent on the virtio-serial port, the template booted once with its RAM in a
memfd and snapshotted, clones mapping the sealed memfd private (a standby QEMU handed
out), pause/resume and fork through full-state migration, identity after every restore,
a daemon restart, the VM's own limits.

``pytest -m tcg`` (~25 s; in the default run). Needs root, QEMU, the guest artifacts
(scripts/build-microvm-kernel.sh, which scripts/test.sh runs) and a built python template.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cpuos import Sandbox
from cpuosd.backends.microvm import guest_artifacts, jailer
from cpuosd.backends.microvm.backend import MEM_OVERHEAD_MIB
from cpuosd.backends.microvm.probe import kvm_boot_probe
from support.daemon import MICROVM_TEST_MIB, Daemon, e2e_unavailable, microvm_env

pytestmark = [pytest.mark.e2e, pytest.mark.tcg]

CACHE = guest_artifacts.cache_dir()


@pytest.fixture(scope="module", params=["tcg", pytest.param("kvm", marks=pytest.mark.kvm)])
def daemon(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
           ) -> Iterator[Daemon]:
    """A daemon on the microVM backend: TCG here; the same tests under KVM (``-m kvm``)
    where the KVM boot probe passes."""
    accel = request.param
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    if not os.path.exists("/usr/bin/qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")
    art = guest_artifacts.current_artifacts(CACHE)
    if art is None or not art.exist():
        pytest.skip(f"guest artifacts not built in {CACHE} (scripts/build-microvm-kernel.sh)")
    if accel == "kvm":
        ok, reason = kvm_boot_probe(5.0)
        if not ok:
            pytest.skip(f"KVM boot probe failed: {reason}")
    home = tmp_path_factory.mktemp("mvm") / "home"
    home.mkdir()
    d = Daemon(home, microvm_env(accel, CACHE))
    d.start()
    failed_before = request.session.testsfailed
    failed = True
    try:
        yield d
        failed = request.session.testsfailed > failed_before
    finally:
        d.teardown(failed)  # a failed run's daemon log: .cache/test-artifacts/
        jails = home / "microvm" / "jail" / "qemu-system-x86_64"
        left = sorted(p.name for p in jails.iterdir()) if jails.is_dir() else []
        cgroups = [jid for jid in left if any(p.exists() for p in jailer.cgroup_dirs(jid))]
        for jid in left:
            jailer.cleanup(jid, home / "microvm" / "jail")
        assert not left and not cgroups, f"jails left behind: {left}"


def _ident(s: Sandbox) -> tuple[str, str]:
    out = s.exec("hostname; cat /etc/machine-id", timeout="60s").stdout.split()
    return out[0], out[1]


def test_microvm_sandboxes_clone_pause_resume_fork(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    assert httpx.get(daemon.url + "/health").json()["backend"] == "microvm"
    t0 = time.monotonic()
    a = Sandbox.create(template="python", timeout="15m", **kw)  # template boot + snapshot
    print(f"\nfirst create (template boot under TCG + snapshot + clone): "
          f"{time.monotonic() - t0:.1f}s")
    try:
        run = a.exec("python3 -c 'print(6 * 7)'", timeout="60s")
        assert (run.exit_code, run.stdout) == (0, "42\n")
        host, mid = _ident(a)
        assert host == a.id and re.fullmatch(r"[0-9a-f]{32}", mid)
        # the guest's clock was set after the restore (the snapshot is older)
        guest_now = float(a.exec("date +%s.%N").stdout)
        assert abs(guest_now - time.time()) < 5

        t0 = time.monotonic()
        b = Sandbox.create(template="python", timeout="15m", **kw)  # a standby QEMU
        print(f"second create (clone from a standby QEMU): {time.monotonic() - t0:.2f}s")
        try:
            hb, mb = _ident(b)
            assert hb == b.id and mb != mid
            # copy on write: what one clone writes, even in RAM, the other never sees
            a.files.write("/dev/shm/mine", b"a's page")
            assert b.exec("cat /dev/shm/mine").exit_code != 0
            # randomness: the clones' kernels were reseeded apart (same snapshot)
            ra = a.exec("head -c 16 /dev/urandom | od -An -tx1").stdout
            rb = b.exec("head -c 16 /dev/urandom | od -An -tx1").stdout
            assert ra != rb
            # a clone may use (nearly) all its RAM: its cgroup is charged its own copies
            # of the template's pages, not those pages as well (were both charged, writing
            # 3/4 of the RAM would pass the cgroup's limit, RAM + overhead, and be killed)
            big = MICROVM_TEST_MIB * 3 // 4
            assert 2 * big > MICROVM_TEST_MIB + MEM_OVERHEAD_MIB
            run = b.exec(f"python3 -c \"x = bytearray(b'x') * ({big} << 20); print(len(x))\"",
                         timeout="300s")
            assert (run.exit_code, run.stdout) == (0, f"{big << 20}\n"), run.stderr
            assert b.exec("echo alive").stdout == "alive\n"
        finally:
            b.kill()

        # pause/resume: memory (a tmpfs file, a running process) and disk come back
        a.files.write("/work/note.txt", b"on disk")
        a.exec("nohup sleep 3600 >/dev/null 2>&1 & echo $! > /dev/shm/pid")
        pid = a.exec("cat /dev/shm/pid").stdout.strip()
        t0 = time.monotonic()
        a.pause()
        print(f"pause: {time.monotonic() - t0:.2f}s")
        jails = daemon.home / "microvm" / "jail" / "qemu-system-x86_64"
        vms = [j for j in jails.iterdir() if not j.name.startswith("sb-")  # (standby VMs)
               or (j / "sandbox").exists()]
        assert not vms, "a paused microVM keeps no QEMU"
        t0 = time.monotonic()
        a = Sandbox.resume(a.id, **kw)
        print(f"resume: {time.monotonic() - t0:.2f}s")
        assert a.files.read("/dev/shm/mine") == b"a's page"
        assert a.files.read("/work/note.txt") == b"on disk"
        assert a.exec(f"kill -0 {pid}").exit_code == 0
        assert _ident(a) == (a.id, mid)

        # fork: the copy has a's memory and files, its own identity
        (c,) = a.fork(1)
        try:
            assert c.files.read("/dev/shm/mine") == b"a's page"
            assert c.exec(f"kill -0 {pid}").exit_code == 0
            hc, mc = _ident(c)
            assert hc == c.id and mc != mid
            c.files.write("/work/note.txt", b"c's")
            assert a.files.read("/work/note.txt") == b"on disk"
        finally:
            c.kill()
    finally:
        a.kill()


def _standbys(daemon: Daemon, timeout: float = 10.0) -> list[Path]:
    """The jails of standby QEMUs ready and not handed out (waiting up to timeout for one;
    ready: the backend writes vm.json once QEMU waits for its state)."""
    jails = daemon.home / "microvm" / "jail" / "qemu-system-x86_64"
    deadline = time.monotonic() + timeout
    while True:
        found = [j for j in jails.iterdir() if j.name.startswith("sb-")
                 and (j / "vm.json").exists() and not (j / "sandbox").exists()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_dead_standby_is_replaced_not_handed_out(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    Sandbox.create(template="python", timeout="5m", **kw).kill()
    (sb,) = _standbys(daemon)
    os.kill(int((sb / "vmm.pid").read_text()), signal.SIGKILL)
    s = Sandbox.create(template="python", timeout="5m", **kw)
    try:
        assert s.exec("hostname").stdout.strip() == s.id
    finally:
        s.kill()
    assert f"standby microVM {sb.name} unusable" in daemon.log.read_text()


def test_daemon_restart_reattaches_and_clones_from_the_saved_ram(daemon: Daemon) -> None:
    """kill -9 the daemon: a running microVM (a standby that was handed out) is reattached
    (QEMU reconnects into the sandbox's socket directory), can be paused and resumed; the
    standby left behind is ended; a new clone loads the template RAM from its saved pages
    into a new sealed memfd."""
    kw = daemon.sdk_kwargs()
    Sandbox.create(template="python", timeout="15m", **kw).kill()  # let a standby spawn
    a = Sandbox.create(template="python", timeout="15m", **kw)
    try:
        a.files.write("/dev/shm/before", b"kept")
        jails = daemon.home / "microvm" / "jail" / "qemu-system-x86_64"
        assert _standbys(daemon)  # the replacement standby is up
        daemon.kill9()
        daemon.start()
        assert a.exec("cat /dev/shm/before", timeout="60s").stdout == "kept"
        left = [j.name for j in jails.iterdir() if not (j / "sandbox").exists()
                and j.name.startswith("sb-")]
        assert not left, f"standby VMs of the old daemon still there: {left}"
        a.pause()
        a = Sandbox.resume(a.id, **kw)
        assert a.files.read("/dev/shm/before") == b"kept"
        b = Sandbox.create(template="python", timeout="15m", **kw)
        try:
            assert b.exec("hostname").stdout.strip() == b.id
        finally:
            b.kill()
    finally:
        a.kill()


def test_limits_are_the_vms(daemon: Daemon) -> None:
    """vCPUs and memory are the VM's own (a non-default size boots cold, no template
    image); the writable layer is bounded; the guest's pid limit is its own."""
    kw = daemon.sdk_kwargs()
    s = Sandbox.create(template="python", timeout="10m", vcpus=1, memory_mib=512,
                       disk="300MiB", **kw)
    try:
        assert s.exec("nproc").stdout.strip() == "1"
        mem_kib = int(s.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
        assert 300 * 1024 < mem_kib <= 512 * 1024
        # a memory hog is the guest's problem: its own OOM killer, the sandbox lives on
        hog = s.exec("python3 -c 'x = bytearray(1 << 30)'", timeout="120s")
        assert hog.exit_code != 0
        assert s.exec("echo alive").stdout == "alive\n"
        # the writable layer is disk="300MiB": ENOSPC past it
        full = s.exec("dd if=/dev/zero of=/work/fill bs=1M count=400", timeout="300s")
        assert full.exit_code != 0 and "No space left" in full.stderr, full
        assert s.exec("rm /work/fill && echo ok > /work/small && cat /work/small"
                      ).stdout == "ok\n"
    finally:
        s.kill()


def _link(fd: Path) -> str:
    """An fd's target, or "" when the daemon closed it between the listing and the read."""
    try:
        return os.readlink(fd)
    except FileNotFoundError:
        return ""


def test_template_ram_is_sealed_and_saved(daemon: Daemon) -> None:
    """After the first test: the template image holds the device state and the saved
    RAM pages; the daemon keeps the memfd sealed (checked through its /proc)."""
    img, _ = daemon.template_image("python")  # (beside it: its lock file, python-....lock)
    assert (img / "ram").stat().st_blocks * 512 < (img / "ram").stat().st_size  # sparse
    assert (img / "checkpoint.img").stat().st_size < 16 << 20  # no RAM in the stream
    assert daemon.proc is not None
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    memfds = [fd for fd in fds.iterdir() if _link(fd).startswith("/memfd:cpuos-")]
    assert memfds, "the daemon holds the template's RAM memfd"
    with open(memfds[0], "r+b", buffering=0) as f, pytest.raises(PermissionError):
        f.write(b"x")
