"""cpuos benchmarks: our figure next to the raw-backend (runsc) floor measured in the same run.

    sudo .venv/bin/python bench/run.py [--quick] [--only snapshots|basic|microvm|SECTION,...]

Starts its own cpuosds one after the other (cpuosd.testing.new_daemon: own CPUOS_HOME,
shared template cache; cold, template-snapshot and warm-pool configurations), always tears
them down, and deletes every runsc container it made itself (a separate ``--root`` for the
raw runs), even on Ctrl-C or an exception. Prints one table per benchmark plus a summary,
and writes every sample to .cache/bench/results*.json.
See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

import cpuos_agent
from cpuos import Sandbox
from cpuosd.agentconn import DEVICE_SETTLE, AgentChannel
from cpuosd.backends.base import SandboxSpec
from cpuosd.backends.gvisor import SANDBOX_GID, SANDBOX_UID, oci_spec
from cpuosd.backends.microvm import jailer, kernel
from cpuosd.backends.microvm.backend import JAIL_QMP, MicroVMBackend
from cpuosd.backends.microvm.backend import QEMU_BIN as MVM_QEMU
from cpuosd.backends.microvm.backend import UID_BASE as MVM_UID_BASE
from cpuosd.backends.microvm.backend import UID_COUNT as MVM_UID_COUNT
from cpuosd.backends.microvm.probe import kvm_boot_probe
from cpuosd.backends.microvm.qemu import Accel, VMConfig, connect_unix, qemu_argv
from cpuosd.backends.runsc import find_runsc
from cpuosd.config import Config
from cpuosd.testing import TEMPLATES, Daemon, e2e_unavailable, new_daemon

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / ".cache" / "bench" / "results.json"
RUNSC_INFO = find_runsc()  # the daemon's own choice (CPUOS_RUNSC, CPUOS_RUNSC_PLATFORM)
RUNSC = RUNSC_INFO.path
MB = 1_000_000  # throughput is reported in MB/s, 1 MB = 10^6 bytes
MiB = 1 << 20

console = Console(width=110)
now = time.perf_counter


# ---- helpers ----------------------------------------------------------------------------

def pct(samples: Sequence[float], p: float) -> float:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(samples)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(samples: Sequence[float]) -> float:
    return pct(samples, 50)


def ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def mbps(v: float) -> str:
    return f"{v:.0f} MB/s"


def mib(b: float) -> str:
    return f"{b / MiB:.1f} MiB"


class Procs:
    """Every host process this script starts, so cleanup can end the ones still running
    (by pid, only ours)."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen[bytes]] = set()

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, **kw)
        self.live.add(p)
        return p

    def run(self, argv: list[str], *, stdin: Any = subprocess.DEVNULL, stdout: Any = None,
            timeout: float = 300) -> tuple[int, bytes, bytes]:
        p = self.popen(argv, stdin=stdin, stdout=subprocess.PIPE if stdout is None else stdout,
                       stderr=subprocess.PIPE)
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            self.live.discard(p)
        return p.returncode, out or b"", err or b""

    def run_logged(self, argv: list[str], log: Path, timeout: float = 120) -> int:
        """Run with stdout/stderr appended to ``log``: a detached runsc (run --detach,
        restore --detach) hands its stdio to the sandbox, so a pipe would never reach EOF.
        Own session, like the daemon's backend, so a Ctrl-C reaches only this script."""
        with open(log, "ab") as logf:
            p = self.popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                           start_new_session=True)
        try:
            return p.wait(timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            self.live.discard(p)

    def done(self, p: subprocess.Popen[bytes]) -> None:
        self.live.discard(p)

    def kill_all(self) -> None:
        for p in list(self.live):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(Exception):
                    p.wait(10)
            self.live.discard(p)


PROCS = Procs()


def _runsc_procs() -> list[tuple[int, str, bytes]]:
    """(pid, argv[0], cmdline) of runsc processes on the host (runsc, runsc-gofer,
    runsc-sandbox and its ptrace stubs; their comm is often just "exe")."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        argv0 = os.path.basename(cmd.split(b"\0")[0].decode(errors="replace"))
        if argv0.startswith("runsc"):
            found.append((int(d), argv0, cmd))
    return found


def runsc_pids_under(paths: Sequence[Path]) -> list[tuple[int, str]]:
    """runsc processes whose command line names one of ``paths`` (i.e. this run's)."""
    marks = [str(p).encode() for p in paths]
    return [(pid, a0) for pid, a0, cmd in _runsc_procs() if any(m in cmd for m in marks)]


def count_runsc_procs() -> int:
    return len(_runsc_procs())


def host_snapshot() -> dict[str, Any]:
    return {"loadavg": list(os.getloadavg()), "runsc_processes": count_runsc_procs()}


# ---- raw backend floor (runsc without cpuos) --------------------------------------------

class RawRunsc:
    """Foreground ``runsc run`` of /bin/true with the daemon's flags and OCI config, in a
    runsc root of its own (deleted in cleanup)."""

    def __init__(self, rootfs: Path) -> None:
        self.rootfs = rootfs
        self.tmp = Path(tempfile.mkdtemp(prefix="cpuos-bench-raw-", dir="/tmp"))
        self.root = self.tmp / "runsc"
        self.agent_dir = self.tmp / "agent"  # empty; mounted at /opt/cpuos like the real one
        self.root.mkdir()
        self.agent_dir.mkdir()
        self.n = 0
        cfg = Config()
        self.vcpus, self.memory_mib = cfg.default_vcpus, cfg.default_memory_mib

    def global_flags(self) -> list[str]:
        return [RUNSC, "--root", str(self.root), f"--platform={RUNSC_INFO.platform}"]

    def run_true(self) -> tuple[float, float, float]:
        """(run seconds, delete seconds, run+delete seconds)."""
        self.n += 1
        cid = f"bench-raw-{os.getpid()}-{self.n}"
        sdir = self.tmp / cid
        spec = SandboxSpec(id=cid, rootfs=self.rootfs, dir=sdir, agent_dir=self.agent_dir,
                           vcpus=self.vcpus, memory_mib=self.memory_mib, hostname=cid)
        bundle, overlay = sdir / "bundle", sdir / "overlay"
        for d in (bundle, overlay, spec.sock_dir):
            d.mkdir(parents=True)
        cfg = oci_spec(spec)
        cfg["process"]["args"] = ["/bin/true"]
        (bundle / "config.json").write_text(json.dumps(cfg, indent=1))
        run = [*self.global_flags(), "--network=none", "--host-uds=open",
               "--overlay2=root:memory", *RUNSC_INFO.gofer_flags(), "run",
               "--bundle", str(bundle), cid]
        t0 = now()
        rc, _, err = PROCS.run(run, timeout=60)
        t1 = now()
        PROCS.run([*self.global_flags(), "delete", "--force", cid], timeout=60)
        t2 = now()
        if rc != 0:
            raise RuntimeError(f"raw runsc run failed (rc={rc}): "
                               f"{err.decode(errors='replace')[-800:]}")
        shutil.rmtree(sdir, ignore_errors=True)
        return t1 - t0, t2 - t1, t2 - t0

    # -- detached containers, checkpoint and restore (snapshot floors) --------------------
    # Same flags as the daemon's backend: --overlay2=root:memory, so that a checkpoint
    # carries the writable layer (GVisorBackend._sandbox_flags).

    def sandbox_flags(self) -> list[str]:
        return [*self.global_flags(), "--network=none", "--host-uds=open",
                "--overlay2=root:memory", *RUNSC_INFO.gofer_flags()]

    def new_id(self, what: str) -> str:
        self.n += 1
        return f"bench-{what}-{os.getpid()}-{self.n}"

    def bundle(self, cid: str, args: list[str] | None = None,
               agent_dir: Path | None = None) -> Path:
        """A fresh sandbox dir for cid (bundle, sock dir, runsc log) with oci_spec's config;
        ``args`` replaces the agent as PID 1. Returns the sandbox dir."""
        sdir = self.tmp / cid
        spec = SandboxSpec(id=cid, rootfs=self.rootfs, dir=sdir,
                           agent_dir=agent_dir or self.agent_dir, vcpus=self.vcpus,
                           memory_mib=self.memory_mib, hostname="sandbox")
        for d in (sdir / "bundle", spec.sock_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(spec.sock_dir, 0o755)
        cfg = oci_spec(spec)
        if args is not None:
            cfg["process"]["args"] = args
        (sdir / "bundle" / "config.json").write_text(json.dumps(cfg, indent=1))
        return sdir

    def _check(self, rc: int, what: str, sdir: Path) -> None:
        if rc != 0:
            log = (sdir / "runsc.log").read_bytes()[-800:].decode(errors="replace")
            raise RuntimeError(f"raw runsc {what} failed (rc={rc}): {log}")

    def run_detached(self, cid: str, sdir: Path) -> None:
        rc = PROCS.run_logged([*self.sandbox_flags(), "run", "--detach", "--bundle",
                               str(sdir / "bundle"), cid], sdir / "runsc.log")
        self._check(rc, "run --detach", sdir)

    def restore(self, cid: str, sdir: Path, image: Path) -> None:
        rc = PROCS.run_logged([*self.sandbox_flags(), "restore", "--detach",
                               f"--image-path={image}", "--bundle", str(sdir / "bundle"), cid],
                              sdir / "runsc.log")
        self._check(rc, "restore --detach", sdir)

    def checkpoint(self, cid: str, sdir: Path, image: Path) -> None:
        image.mkdir(parents=True, exist_ok=True)
        rc = PROCS.run_logged([*self.global_flags(), "checkpoint", f"--image-path={image}",
                               cid], sdir / "runsc.log")
        self._check(rc, "checkpoint", sdir)

    def exec_true(self, cid: str) -> None:
        rc, _, err = PROCS.run(runsc_exec_argv(self.root, cid, "/bin/true"), timeout=60)
        if rc != 0:
            raise RuntimeError(f"raw runsc exec failed: {err.decode(errors='replace')[-500:]}")

    def delete(self, cid: str) -> None:
        PROCS.run([*self.global_flags(), "delete", "--force", cid], timeout=60)

    def wait_log(self, sdir: Path, text: bytes, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if text in (sdir / "runsc.log").read_bytes():
                return
            time.sleep(0.05)
        raise RuntimeError(f"raw container did not print {text!r}: "
                           f"{(sdir / 'runsc.log').read_bytes()[-800:].decode(errors='replace')}")

    def cleanup(self) -> list[str]:
        left: list[str] = []
        if self.root.exists():
            rc, out, _ = PROCS.run([*self.global_flags(), "list", "-format=json"], timeout=60)
            if rc == 0:
                left = [c["id"] for c in json.loads(out or b"null") or []]
            for cid in left:
                PROCS.run([*self.global_flags(), "delete", "--force", cid], timeout=60)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return left


def runsc_exec_argv(root: Path, sid: str, *argv: str) -> list[str]:
    """What a host-side caller without cpuos does: one ``runsc exec`` per command. Runs as
    the sandbox user, like the agent's commands (runsc's default, root without
    capabilities, cannot write /work)."""
    return [RUNSC, "--root", str(root), "exec", "--user", f"{SANDBOX_UID}:{SANDBOX_GID}", sid,
            *argv]


def runsc_exec(d: Daemon, sid: str, *argv: str) -> list[str]:
    return runsc_exec_argv(d.runsc_root, sid, *argv)


# ---- benchmarks -------------------------------------------------------------------------

def bench_create(d: Daemon, raw: RawRunsc, n: int) -> dict[str, Any]:
    """Sandbox.create + exec('true') vs foreground runsc run (+delete) of /bin/true.
    One untimed warmup of each, then ours and the floor alternate so host noise hits both."""
    kw: dict[str, Any] = d.sdk_kwargs()
    ours: list[float] = []
    f_run: list[float] = []
    f_del: list[float] = []
    f_total: list[float] = []
    for i in range(n + 1):
        t0 = now()
        sbx = Sandbox.create(template="python", timeout="5m", **kw)
        try:
            r = sbx.exec("true")
            t1 = now()
        finally:
            try:
                sbx.kill()
            finally:
                sbx.close()
        if r.exit_code != 0:
            raise RuntimeError(f"exec true failed: {r}")
        a, b, c = raw.run_true()
        if i == 0:
            continue  # warmup
        ours.append(t1 - t0)
        f_run.append(a)
        f_del.append(b)
        f_total.append(c)
        console.print(f"  create {i}/{n}: ours {ms(t1 - t0)}, raw run+delete {ms(c)}")
    return {"n": n, "ours_s": ours, "floor_run_s": f_run, "floor_delete_s": f_del,
            "floor_run_delete_s": f_total}


IN_SANDBOX_SPAWN = """\
import json, subprocess, sys, time
n, warm = int(sys.argv[1]), int(sys.argv[2])
for _ in range(warm):
    subprocess.run(["/bin/true"], check=True)
lat = []
for _ in range(n):
    t0 = time.perf_counter()
    subprocess.run(["/bin/true"], check=True)
    lat.append(time.perf_counter() - t0)
lat.sort()
print(json.dumps({"p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                  "samples": lat}))
"""


def bench_exec(d: Daemon, sbx: Sandbox, n: int, warm: int, peer_n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "warmup": warm}
    forms: list[tuple[str, str | list[str]]] = [("shell", "true"), ("argv", ["/bin/true"])]
    for name, cmd in forms:
        for _ in range(warm):
            sbx.exec(cmd)
        lat = []
        for _ in range(n):
            t0 = now()
            r = sbx.exec(cmd)
            lat.append(now() - t0)
            if r.exit_code != 0:
                raise RuntimeError(f"exec {cmd!r} failed: {r}")
        out[f"ours_{name}_s"] = lat
        console.print(f"  exec {name}: p50 {ms(median(lat))}")

    sbx.files.write("/work/bench_spawn.py", IN_SANDBOX_SPAWN)
    r = sbx.exec(["python3", "/work/bench_spawn.py", str(n), str(warm)], timeout="10m")
    if r.exit_code != 0:
        raise RuntimeError(f"in-sandbox spawn loop failed: {r.stderr[-800:]}")
    res = json.loads(r.stdout)
    out["floor_in_sandbox_s"] = res["samples"]
    out["floor_in_sandbox_script_p50_p99_s"] = [res["p50"], res["p99"]]
    console.print(f"  in-sandbox subprocess.run: p50 {ms(median(res['samples']))}")

    peer = []
    for i in range(peer_n + 2):
        t0 = now()
        rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "/bin/true"), timeout=60)
        dt = now() - t0
        if rc != 0:
            raise RuntimeError(f"runsc exec failed: {err.decode(errors='replace')[-500:]}")
        if i >= 2:  # two warmups
            peer.append(dt)
    out["peer_runsc_exec_s"] = peer
    out["peer_n"] = peer_n
    console.print(f"  runsc exec per command: p50 {ms(median(peer))}")
    return out


def _ours_stream(sbx: Sandbox, cmd: str, nbytes: int) -> float:
    t0 = now()
    r = sbx.exec(cmd, max_output=1 << 20, timeout="10m")
    dt = now() - t0
    if r.exit_code != 0 or r.stdout_total != nbytes:
        raise RuntimeError(f"{cmd!r} streamed {r.stdout_total} bytes, exit {r.exit_code}")
    return nbytes / dt / MB


def _floor_stream(d: Daemon, sbx: Sandbox, argv: list[str], nbytes: int) -> float:
    with tempfile.TemporaryFile() as errf:
        t0 = now()
        p = PROCS.popen(runsc_exec(d, sbx.id, *argv), stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=errf, bufsize=0)
        assert p.stdout is not None
        got = 0
        fd = p.stdout.fileno()
        while b := os.read(fd, 1 << 20):
            got += len(b)
        rc = p.wait()
        dt = now() - t0
        PROCS.done(p)
        p.stdout.close()
        if rc != 0 or got != nbytes:
            errf.seek(0)
            raise RuntimeError(f"runsc exec {argv}: rc={rc} got={got}: "
                               f"{errf.read()[-500:].decode(errors='replace')}")
    return nbytes / dt / MB


def bench_stream(d: Daemon, sbx: Sandbox, size: str, nbytes: int, runs: int) -> dict[str, Any]:
    """``head -c`` is the benchmark. ``dd bs=1M`` (info only) shows the same pipeline with
    a producer that writes 1 MiB per syscall instead of head's small buffer."""
    res: dict[str, list[float]] = {"ours": [], "floor": [], "ours_dd": [], "floor_dd": []}
    head = ["head", "-c", size, "/dev/zero"]
    dd = ["dd", "if=/dev/zero", "bs=1M", f"count={nbytes // MiB}", "status=none"]
    for i in range(runs):
        res["ours"].append(_ours_stream(sbx, " ".join(head), nbytes))
        res["floor"].append(_floor_stream(d, sbx, head, nbytes))
        res["ours_dd"].append(_ours_stream(sbx, " ".join(dd), nbytes))
        res["floor_dd"].append(_floor_stream(d, sbx, dd, nbytes))
        console.print(f"  stream {i + 1}/{runs}: head: ours {mbps(res['ours'][-1])}, runsc "
                      f"exec pipe {mbps(res['floor'][-1])}; dd bs=1M: ours "
                      f"{mbps(res['ours_dd'][-1])}, runsc exec pipe {mbps(res['floor_dd'][-1])}")
    return {"bytes": nbytes, "runs": runs, **{f"{k}_MBps": v for k, v in res.items()}}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def bench_files(d: Daemon, sbx: Sandbox, tmp: Path, runs: int, size: int) -> dict[str, Any]:
    src = tmp / "src.bin"
    with open(src, "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    want = sha256(src)
    dst = tmp / "dst.bin"
    res: dict[str, list[float]] = {"ours_up": [], "ours_down": [], "floor_up": [],
                                   "floor_down": []}

    def check(path: Path, what: str) -> None:
        if path.stat().st_size != size or sha256(path) != want:
            raise RuntimeError(f"{what}: downloaded file differs from the uploaded one")

    def timed(fn: Callable[[], None]) -> float:
        t0 = now()
        fn()
        return size / (now() - t0) / MB

    for i in range(runs):
        # ours: upload, then download what was uploaded
        def ours_up() -> None:
            sbx.files.upload(src, "/work/bench_up.bin")

        def ours_down() -> None:
            sbx.files.download("/work/bench_up.bin", dst)

        res["ours_up"].append(timed(ours_up))
        dst.unlink(missing_ok=True)
        res["ours_down"].append(timed(ours_down))
        check(dst, "files.download")

        # floor: runsc exec cat, file on stdin / stdout to a host file
        def up() -> None:
            with open(src, "rb") as f:
                rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "sh", "-c",
                                                  "cat > /work/bench_floor.bin"),
                                       stdin=f, timeout=600)
            if rc != 0:
                raise RuntimeError(f"runsc exec cat >: {err.decode(errors='replace')[-500:]}")

        def down() -> None:
            with open(dst, "wb") as f:
                rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "cat", "/work/bench_floor.bin"),
                                       stdout=f, timeout=600)
            if rc != 0:
                raise RuntimeError(f"runsc exec cat: {err.decode(errors='replace')[-500:]}")

        res["floor_up"].append(timed(up))
        dst.unlink(missing_ok=True)
        res["floor_down"].append(timed(down))
        check(dst, "runsc exec cat")
        console.print(f"  files {i + 1}/{runs}: up ours {mbps(res['ours_up'][-1])} / floor "
                      f"{mbps(res['floor_up'][-1])}; down ours {mbps(res['ours_down'][-1])} / "
                      f"floor {mbps(res['floor_down'][-1])}")
    sbx.exec("rm -f /work/bench_up.bin /work/bench_floor.bin")
    src.unlink(missing_ok=True)
    dst.unlink(missing_ok=True)
    return {"bytes": size, "runs": runs, **{f"{k}_MBps": v for k, v in res.items()}}


# ---- snapshot benchmarks ----------------------------------------------------------------

# PID 1 of the raw heap container, and a background process in our sandbox: 100 MiB of
# heap, then a ready mark (argv[1]) and a line on stdout, then sleep.
HEAP_HOLDER = """\
import os, sys, time
data = bytearray(os.urandom(1 << 20) * 100)
open(sys.argv[1], "w").close()
print("ready", len(data), flush=True)
while True:
    time.sleep(3600)
"""
IDLE_HOLDER = """\
import sys, time
open(sys.argv[1], "w").close()
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def start_heap_holder(sbx: Sandbox) -> None:
    """Start HEAP_HOLDER in the background in sbx and wait until its 100 MiB are allocated."""
    sbx.files.write("/work/holder.py", HEAP_HOLDER)
    r = sbx.exec("nohup python3 /work/holder.py /work/holder.ready >/work/holder.log 2>&1 &")
    if r.exit_code != 0:
        raise RuntimeError(f"starting the heap holder failed: {r}")
    deadline = time.time() + 60
    while time.time() < deadline:
        if sbx.files.exists("/work/holder.ready"):
            return
        time.sleep(0.05)
    raise RuntimeError("heap holder did not start: " + sbx.files.read_text("/work/holder.log"))


def check_heap_holder(sbx: Sandbox) -> None:
    r = sbx.exec("pgrep -f holder.py >/dev/null")
    if r.exit_code != 0:
        raise RuntimeError("the heap holder is gone after resume")


def du(path: Path) -> tuple[int, int]:
    """(apparent bytes ``du -sb``, allocated bytes ``du -s -B1``) of a directory."""
    out = []
    for flags in (["-sb"], ["-s", "-B1"]):
        rc, o, err = PROCS.run(["du", *flags, str(path)], timeout=60)
        if rc != 0:
            raise RuntimeError(f"du {path}: {err.decode(errors='replace')}")
        out.append(int(o.split()[0]))
    return out[0], out[1]


def kill_quietly(sbx: Sandbox) -> None:
    try:
        sbx.kill()
    finally:
        sbx.close()


def bench_snap_create(d: Daemon, raw: RawRunsc, n: int) -> dict[str, Any]:
    """Sandbox.create + exec('true') restoring the template snapshot (daemon with
    CPUOS_POOL_SIZE=0) vs raw ``runsc restore --detach`` of a copy of the same image.
    The first create (untimed) makes the template snapshot; ours and the floor alternate."""
    kw: dict[str, Any] = d.sdk_kwargs()
    ours: list[float] = []
    ours_create: list[float] = []
    f_restore: list[float] = []
    f_exec: list[float] = []
    image = agent = None
    for i in range(n + 1):
        t0 = now()
        sbx = Sandbox.create(template="python", timeout="5m", **kw)
        try:
            t1 = now()
            r = sbx.exec("true")
            t2 = now()
        finally:
            kill_quietly(sbx)
        if r.exit_code != 0:
            raise RuntimeError(f"exec true failed: {r}")
        if image is None or agent is None:
            # the raw floor restores a copy of the daemon's template image, with a copy of
            # the agent package at /opt/cpuos (the restored agent keeps polling for its
            # socket, which nobody serves)
            src, src_agent = d.template_image("python")
            image = raw.tmp / "template-image"
            shutil.copytree(src, image)
            agent = raw.tmp / "agent-copy"
            shutil.copytree(src_agent, agent)
        cid = raw.new_id("restore")
        sdir = raw.bundle(cid, agent_dir=agent)
        try:
            t3 = now()
            raw.restore(cid, sdir, image)
            t4 = now()
            raw.exec_true(cid)
            t5 = now()
        finally:
            raw.delete(cid)
            shutil.rmtree(sdir, ignore_errors=True)
        if i == 0:
            continue  # warmup (ours made the template snapshot)
        ours.append(t2 - t0)
        ours_create.append(t1 - t0)
        f_restore.append(t4 - t3)
        f_exec.append(t5 - t3)
        console.print(f"  snapshot create {i}/{n}: ours create+exec {ms(t2 - t0)} "
                      f"(create {ms(t1 - t0)}); raw restore {ms(t4 - t3)}, "
                      f"+exec {ms(t5 - t3)}")
    assert image is not None
    return {"n": n, "image_bytes": du(image)[0], "ours_s": ours, "ours_create_s": ours_create,
            "floor_restore_s": f_restore, "floor_restore_exec_s": f_exec}


def connected_agents(d: Daemon, ids: Iterable[str]) -> set[str]:
    """Those of ``ids`` (sandboxes of d) whose agent is connected right now. The accepted
    end of an agent connection lives in the network namespace of the connecting gofer, so
    it shows (path, state 03 = connected) in that gofer's /proc/<pid>/net/unix, not in
    ours."""
    want = {str(d.agent_socket(sid)): sid for sid in ids}
    home = str(d.home).encode()
    found: set[str] = set()
    for pid, argv0, cmd in _runsc_procs():
        if argv0 != "runsc-gofer" or home not in cmd:
            continue
        try:
            lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) >= 8 and f[5] == "03" and f[7] in want:
                found.add(want[f[7]])
    return found


def wait_pool(d: Daemon, size: int, mine: set[str], timeout: float = 180) -> set[str]:
    """Wait until ``size`` runsc containers besides ``mine`` run with their agent connected
    (the daemon puts a sandbox in the pool once its agent is back); returns their ids."""
    deadline = time.time() + timeout
    while True:
        ready = connected_agents(d, set(d.runsc_containers()) - mine)
        if len(ready) >= size:
            time.sleep(0.1)  # the daemon appends to the pool right after the connect
            return ready
        if time.time() > deadline:
            raise RuntimeError(f"warm pool did not fill: {len(ready)}/{size} ready; see {d.log}")
        time.sleep(0.05)


def bench_pool(d: Daemon, n: int, size: int) -> dict[str, Any]:
    """Sandbox.create (+ first exec) served from a full warm pool (daemon with
    CPUOS_POOL_SIZE=size). Before each sample the pool is full; the create starts a refill
    (a restore) in the daemon, which runs during our exec. The floors are taken after the
    pool has refilled, on a quiet host: a new httpx client's GET /health (the SDK's create
    makes a new client and connection too) and one ``runsc exec /bin/true`` into the
    running sandbox."""
    kw: dict[str, Any] = d.sdk_kwargs()
    res: dict[str, list[float]] = {"ours_create_s": [], "ours_create_exec_s": [],
                                   "floor_http_s": [], "floor_runsc_exec_s": []}
    misses = 0
    for i in range(n + 1):
        pooled = wait_pool(d, size, set())
        t0 = now()
        sbx = Sandbox.create(template="python", timeout="5m", **kw)
        try:
            t1 = now()
            r = sbx.exec("true")
            t2 = now()
            if r.exit_code != 0:
                raise RuntimeError(f"exec true failed: {r}")
            hit = sbx.id in pooled
            wait_pool(d, size, {sbx.id})  # let the refill finish before the floors
            t3 = now()
            with httpx.Client(timeout=30, verify=False) as c:  # as the SDK's, for http URLs
                c.get(d.url + "/health").raise_for_status()
            t4 = now()
            rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "/bin/true"), timeout=60)
            t5 = now()
            if rc != 0:
                raise RuntimeError(f"runsc exec failed: {err.decode(errors='replace')[-500:]}")
        finally:
            kill_quietly(sbx)
        if i == 0:
            continue  # warmup
        misses += not hit
        res["ours_create_s"].append(t1 - t0)
        res["ours_create_exec_s"].append(t2 - t0)
        res["floor_http_s"].append(t4 - t3)
        res["floor_runsc_exec_s"].append(t5 - t4)
        console.print(f"  pool create {i}/{n}: create {ms(t1 - t0)}, +exec {ms(t2 - t0)}"
                      f"{'' if hit else ' [yellow](not from the pool!)[/]'}; floor http "
                      f"{ms(t4 - t3)}, runsc exec {ms(t5 - t4)}")
    return {"n": n, "pool_size": size, "pool_misses": misses, **res}


CHECKPOINT_LOG = re.compile(r"checkpoint of (\S+): quiesce (\d+) ms, runsc checkpoint (\d+) ms, "
                            r"teardown (\d+) ms")


def pause_breakdown(d: Daemon, sid: str) -> list[tuple[float, float, float]]:
    """(quiesce, backend checkpoint, teardown) seconds of each pause of sid, from the daemon's
    log (empty if the daemon does not log them). The backend's checkpoint is ``runsc
    checkpoint`` followed by ``runsc delete --force`` (GVisorBackend.checkpoint)."""
    found = []
    for m in CHECKPOINT_LOG.finditer(d.log.read_text(errors="replace")):
        if m.group(1) == sid:
            found.append((int(m.group(2)) / 1e3, int(m.group(3)) / 1e3, int(m.group(4)) / 1e3))
    return found


def bench_pause(d: Daemon, raw: RawRunsc, n: int) -> dict[str, Any]:
    """pause / resume (+ first exec) of a sandbox holding a 100 MiB heap, vs runsc
    checkpoint / restore of a raw container whose PID 1 is the same heap holder (same
    rootfs and flags, no agent). One untimed warmup cycle of each, then they alternate."""
    kw: dict[str, Any] = d.sdk_kwargs()
    res: dict[str, list[float]] = {k: [] for k in (
        "ours_pause_s", "ours_resume_s", "ours_resume_exec_s", "floor_checkpoint_s",
        "floor_checkpoint_delete_s", "floor_restore_s", "floor_restore_exec_s")}
    sizes: list[int] = []
    floor_sizes: list[int] = []
    sbx = Sandbox.create(template="python", timeout="30m", **kw)
    cid = raw.new_id("heap")
    sdir = raw.bundle(cid, ["/usr/bin/python3", "-c", HEAP_HOLDER, "/work/holder.ready"])
    image: Path | None = None
    try:
        start_heap_holder(sbx)
        raw.run_detached(cid, sdir)
        raw.wait_log(sdir, b"ready")
        for i in range(n + 1):
            t0 = now()
            sid = sbx.pause()
            t1 = now()
            sizes.append(sbx.info().snapshot_bytes or 0)
            paused = sbx
            t2 = now()
            sbx = Sandbox.resume(sid, **kw)
            t3 = now()
            paused.close()
            r = sbx.exec("true")
            t4 = now()
            if r.exit_code != 0:
                raise RuntimeError(f"exec true after resume failed: {r}")
            check_heap_holder(sbx)

            old, image = image, raw.tmp / f"{cid}-image-{i}"
            f0 = now()
            raw.checkpoint(cid, sdir, image)
            f1 = now()
            raw.delete(cid)
            f2 = now()
            raw.restore(cid, sdir, image)
            f3 = now()
            raw.exec_true(cid)
            f4 = now()
            floor_sizes.append(du(image)[0])
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            if i == 0:
                continue  # warmup
            for k, v in (("ours_pause_s", t1 - t0), ("ours_resume_s", t3 - t2),
                         ("ours_resume_exec_s", t4 - t2), ("floor_checkpoint_s", f1 - f0),
                         ("floor_checkpoint_delete_s", f2 - f0), ("floor_restore_s", f3 - f2),
                         ("floor_restore_exec_s", f4 - f2)):
                res[k].append(v)
            console.print(f"  pause/resume {i}/{n}: ours pause {ms(t1 - t0)}, resume "
                          f"{ms(t3 - t2)}, +exec {ms(t4 - t2)}; raw checkpoint {ms(f1 - f0)}"
                          f" (+delete {ms(f2 - f0)}), restore {ms(f3 - f2)}, "
                          f"+exec {ms(f4 - f2)}")
    finally:
        kill_quietly(sbx)
        raw.delete(cid)
        shutil.rmtree(sdir, ignore_errors=True)
        if image is not None:
            shutil.rmtree(image, ignore_errors=True)
    parts = pause_breakdown(d, sbx.id)[1:]  # without the warmup
    if len(parts) == n:
        for i, k in enumerate(("quiesce", "checkpoint", "teardown")):
            res[f"ours_pause_{k}_s"] = [x[i] for x in parts]
    return {"n": n, "ours_snapshot_bytes": sizes, "floor_image_bytes": floor_sizes, **res}


def bench_size(d: Daemon, raw: RawRunsc) -> dict[str, Any]:
    """Disk size of one paused sandbox, idle and with the 100 MiB heap: the daemon's
    ``snapshot_bytes`` and ``du`` of $CPUOS_HOME/snapshots/<id>; beside it ``du`` of a raw
    checkpoint of a container whose PID 1 is a Python process (idle / the heap holder)."""
    kw: dict[str, Any] = d.sdk_kwargs()
    out: dict[str, Any] = {}
    for name, holder in (("idle", IDLE_HOLDER), ("heap", HEAP_HOLDER)):
        sbx = Sandbox.create(template="python", timeout="10m", **kw)
        try:
            if name == "heap":
                start_heap_holder(sbx)
            sid = sbx.pause()
            info = sbx.info()
            if info.state != "paused":
                raise RuntimeError(f"sandbox {sid} is {info.state} after pause")
            apparent, allocated = du(d.snapshots_dir / sid)
        finally:
            kill_quietly(sbx)
        cid = raw.new_id(f"size-{name}")
        sdir = raw.bundle(cid, ["/usr/bin/python3", "-c", holder, "/work/holder.ready"])
        image = raw.tmp / f"{cid}-image"
        try:
            raw.run_detached(cid, sdir)
            raw.wait_log(sdir, b"ready")
            raw.checkpoint(cid, sdir, image)
            f_apparent, f_allocated = du(image)
        finally:
            raw.delete(cid)
            shutil.rmtree(sdir, ignore_errors=True)
            shutil.rmtree(image, ignore_errors=True)
        out[name] = {"snapshot_bytes": info.snapshot_bytes, "du_apparent": apparent,
                     "du_allocated": allocated, "floor_du_apparent": f_apparent,
                     "floor_du_allocated": f_allocated}
        console.print(f"  size {name}: snapshot_bytes {mib(info.snapshot_bytes or 0)}, du "
                      f"{mib(apparent)} (allocated {mib(allocated)}); raw image "
                      f"{mib(f_apparent)}")
    return out


# ---- microVM (QEMU -M microvm under our jailer) ------------------------------------------

MVM_EXEC = Path(MVM_QEMU).name
# a uid block of the bench's own, beside the daemon's (UID_BASE .. UID_BASE + UID_COUNT)
MVM_UID = MVM_UID_BASE + MVM_UID_COUNT + 900
MVM_CLONE_TARGET_S = 0.060
MVM_MEM_TARGET = 10 * MiB


def qmp_ready(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30
              ) -> str:
    """Connect to a QMP socket as soon as it exists, negotiate capabilities and return
    ``query-status`` (QMP ready). Synchronous and polling every 1 ms, the same for the jailed
    VMM and the bare floor."""
    deadline = now() + timeout
    while True:
        try:
            sock = connect_unix(str(path))
            break
        except OSError as e:
            # (a --detach jailer exits 0 once QEMU runs: only a failure ends the wait)
            if proc.poll() not in (None, 0):
                tail = log.read_bytes()[-600:].decode(errors="replace") if log.exists() else ""
                raise RuntimeError(f"QEMU exited ({proc.returncode}) before QMP answered: "
                                   f"{tail.strip()}") from None
            if now() > deadline:
                raise RuntimeError(f"no QMP at {path} after {timeout:g}s: {e}") from None
            time.sleep(0.001)
    with sock:
        sock.settimeout(timeout)
        f = sock.makefile("rwb")

        def answer() -> dict[str, Any]:
            while True:
                line = f.readline()
                if not line:
                    raise RuntimeError("QMP closed the connection")
                msg: dict[str, Any] = json.loads(line)
                if "return" in msg or "error" in msg or "QMP" in msg:
                    return msg

        if "QMP" not in answer():
            raise RuntimeError("no QMP greeting")
        for cmd in ("qmp_capabilities", "query-status"):
            f.write(json.dumps({"execute": cmd}).encode() + b"\n")
            f.flush()
            r = answer()
            if "error" in r:
                raise RuntimeError(f"QMP {cmd}: {r['error']}")
        return str(r["return"]["status"])


def smaps_memory(pid: int, ram_name: str | None = None) -> dict[str, int]:
    """Bytes from /proc/<pid>/smaps: ``uss`` (Private_Clean + Private_Dirty) and ``pss`` of
    every mapping but the guest RAM (the mapping whose file is named ``ram_name``), and
    ``ram_private`` / ``ram_pss`` of the guest RAM mapping (its path contains ``ram_name``)."""
    out = {"uss": 0, "pss": 0, "ram_private": 0, "ram_pss": 0}
    is_ram = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if not parts[0].endswith(":"):  # a mapping's header: range perms off dev ino path
                path = parts[5] if len(parts) > 5 else ""
                is_ram = ram_name is not None and ram_name in path
                continue
            head = parts[0][:-1]
            if head in ("Private_Clean", "Private_Dirty", "Pss"):
                v = int(parts[1]) * 1024
                if head == "Pss":
                    out["ram_pss" if is_ram else "pss"] += v
                else:
                    out["ram_private" if is_ram else "uss"] += v
    return out


class MicroVMBench:
    """Jailed QEMU the way MicroVMBackend runs it (its own jailed_argv, the default sandbox
    size), in a home of its own under the run's temp dir; every jail it makes is removed
    (VMM killed, cgroup and jail dir deleted) by ``stop`` and again by ``cleanup``."""

    def __init__(self, tmp: Path, accel: Accel) -> None:
        self.tmp = (tmp / "microvm").resolve()
        self.tmp.mkdir(parents=True)
        self.accel: Accel = accel
        self.art = kernel.current_artifacts()
        art = self.art
        if art is None:  # placeholders for the binds; QEMU gets no -kernel (see vm_config)
            ph = self.tmp / "no-artifacts"
            ph.mkdir()
            for name in ("vmlinux", "initrd"):
                (ph / name).write_bytes(b"")
            art = kernel.Artifacts("none", str(ph / "vmlinux"), str(ph / "initrd"), [], 0.0)
        # guest disk images: content-keyed, cached beside the guest artifacts (as the tests do)
        images = kernel.cache_dir() / "images" if self.art is not None else self.tmp / "images"
        # uids of their own (never a running daemon's sandbox uids)
        self.backend = MicroVMBackend(self.tmp / "home", accel=accel, artifacts=art,
                                      images=images, uid_base=MVM_UID + 100, uid_count=200)
        self.root_img = self.tmp / "placeholder-root.ext4"  # for spawn: QEMU only opens it
        with open(self.root_img, "wb") as f:
            f.truncate(64 * MiB)
        self.agent_dir = self.tmp / "agent"
        self.agent_dir.mkdir()
        cfg = Config()
        self.vcpus, self.memory_mib = cfg.default_vcpus, cfg.default_memory_mib
        self.n = 0
        self.ids: list[str] = []

    @property
    def jail_base(self) -> Path:
        return self.backend.jail_base

    def spec(self, what: str) -> SandboxSpec:
        self.n += 1
        sid = f"bench-mvm-{what}-{os.getpid()}-{self.n}"
        self.ids.append(sid)
        spec = SandboxSpec(id=sid, rootfs=self.tmp, dir=self.tmp / "sandboxes" / sid,
                           agent_dir=self.agent_dir, vcpus=self.vcpus,
                           memory_mib=self.memory_mib, hostname=sid)
        spec.sock_dir.mkdir(parents=True)
        os.chmod(spec.sock_dir, 0o755)
        return spec

    def uid(self) -> int:
        return MVM_UID + self.n % 64

    def vm_config(self, spec: SandboxSpec) -> VMConfig:
        """The daemon's VM config for spec (MicroVMBackend.vm_config), with ``-S``."""
        vm = dataclasses.replace(self.backend.vm_config(spec), start_paused=True)
        if self.art is None:
            vm = dataclasses.replace(vm, kernel=None, initrd=None, cmdline="")
        return vm

    def _overlay(self, spec: SandboxSpec, uid: int) -> Path:
        overlay = spec.dir / "overlay.ext4"
        with open(overlay, "wb") as f:
            f.truncate(self.backend.overlay_mib * MiB)
        os.chown(overlay, uid, uid)
        os.chmod(overlay, 0o600)
        return overlay

    @staticmethod
    def _listener(spec: SandboxSpec) -> socket.socket:
        """The daemon-side agent socket QEMU's chardev connects to (nobody answers)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(spec.sock_path))
        os.chmod(spec.sock_path, 0o666)
        s.listen(4)
        return s

    def spawn_jailed(self) -> float:
        """Seconds from starting the jailer to QMP ready, QEMU jailed with the real argv."""
        spec = self.spec("spawn")
        uid = self.uid()
        vm = self.vm_config(spec)
        argv = self.backend.jailed_argv(spec, uid, vm, self.root_img, self._overlay(spec, uid))
        paths = jailer.jail_paths(spec.id, MVM_QEMU, self.jail_base, MVM_QEMU)
        log = spec.dir / "qemu.log"
        listener = self._listener(spec)
        try:
            with open(log, "wb") as logf:
                t0 = now()
                p = PROCS.popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)
            try:
                status = qmp_ready(paths.host_path(JAIL_QMP), p, log)
                t1 = now()
            finally:
                self.stop(spec.id, p)
        finally:
            listener.close()
            shutil.rmtree(spec.dir, ignore_errors=True)
        if status != "prelaunch":
            raise RuntimeError(f"jailed QEMU is {status!r}, expected prelaunch (-S)")
        return t1 - t0

    def spawn_bare(self) -> float:
        """The floor: the same QEMU command line with host paths, run directly as root (no
        jailer: no chroot, namespaces, cgroup, uid change)."""
        spec = self.spec("bare")
        vm = self.vm_config(spec)
        vm = dataclasses.replace(
            vm, qmp_socket=str(spec.dir / "qmp.sock"),
            kernel=None if vm.kernel is None else self.backend.artifacts().vmlinux,
            initrd=None if vm.initrd is None else self.backend.artifacts().initrd,
            rootfs_image=str(self.root_img), overlay_image=str(self._overlay(spec, 0)),
            agent_socket=str(spec.sock_path))
        log = spec.dir / "qemu.log"
        listener = self._listener(spec)
        try:
            with open(log, "wb") as logf:
                t0 = now()
                p = PROCS.popen(qemu_argv(vm), stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=logf, start_new_session=True, env={})
            try:
                status = qmp_ready(spec.dir / "qmp.sock", p, log)
                t1 = now()
            finally:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
                PROCS.done(p)
        finally:
            listener.close()
            shutil.rmtree(spec.dir, ignore_errors=True)
        if status != "prelaunch":
            raise RuntimeError(f"bare QEMU is {status!r}, expected prelaunch (-S)")
        return t1 - t0

    def stop(self, sid: str, p: subprocess.Popen[bytes] | None = None) -> None:
        """Kill a jail's VMM, reap its jailer, remove its cgroup and jail dir."""
        paths = jailer.jail_paths(sid, MVM_QEMU, self.jail_base, MVM_QEMU)
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(paths.pid_file.read_text()), signal.SIGKILL)
        if p is not None:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            PROCS.done(p)
        jailer.cleanup(sid, self.jail_base, MVM_EXEC)

    def cleanup(self) -> list[str]:
        """Remove every jail this bench made; returns the ids that were still there."""
        left = [sid for sid in self.ids
                if jailer.jail_paths(sid, MVM_QEMU, self.jail_base, MVM_QEMU).jail_dir.exists()
                or any(d.exists() for d in jailer.cgroup_dirs(sid))]
        for sid in self.ids:
            with contextlib.suppress(Exception):
                self.stop(sid)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return left


async def mvm_clones(mb: MicroVMBench, rootfs: Path, agent_pkg: Path, n: int
                     ) -> dict[str, Any]:
    """Clone from a template → agent ready, and per-VM memory, through the backend's own
    contract (what the daemon runs): the template boots with ``template_boot`` (RAM in a
    memfd mapped shared), its agent is quiesced as the Manager does and ``checkpoint``
    saves its device state and seals the memfd; each clone is a ``restore`` of that image
    — a standby QEMU already waiting on ``-incoming defer`` when there is one (the
    backend refills it in the background; we wait for that between clones). Timed per
    clone: from before its agent socket listens to the agent's hello. Memory of each clone
    once its agent is ready: USS and PSS of QEMU without the guest-RAM mapping, plus the
    jailer process that supervises it."""
    b = mb.backend
    out: dict[str, Any] = {"n": n, "clone_s": [], "clone_running_s": [], "standby": [],
                           "vmm_uss": [], "vmm_pss": [],
                           "ram_private": []}
    image = mb.tmp / "template-image"
    try:
        tspec = mb.spec("tpl")
        tspec.agent_dir, tspec.rootfs, tspec.template_boot = agent_pkg, rootfs, True
        chan = AgentChannel(tspec.sock_path)
        await chan.listen()
        try:
            t0 = now()
            await b.start(tspec)
            await chan.wait_connected(300)
            out["template_boot_s"] = now() - t0
            # quiesce, as Manager._quiesce does for a device agent
            chan.stop_listening()
            await chan.call({"t": "quiesce"}, timeout=30)
            chan.disconnect()
            await asyncio.sleep(DEVICE_SETTLE)
            t1 = now()
            await b.checkpoint(tspec.id, image)
            out["template_save_s"] = now() - t1
            out["state_bytes"] = (image / "checkpoint.img").stat().st_size
            out["ram_bytes"] = (image / "ram").stat().st_blocks * 512
        finally:
            await chan.close()
            await b.kill(tspec.id)
        console.print(f"  template booted to its agent in {out['template_boot_s']:.2f}s, "
                      f"snapshotted in {ms(out['template_save_s'])} (device state "
                      f"{mib(out['state_bytes'])}, RAM pages {mib(out['ram_bytes'])})")
        for i in range(n + 1):
            for _ in range(200):  # the standby the last restore asked for is up
                if b.standby_waiting():
                    break
                await asyncio.sleep(0.05)
            spec = mb.spec("clone")
            spec.agent_dir, spec.rootfs = agent_pkg, rootfs
            chan = AgentChannel(spec.sock_path)
            spec.adopt = chan.adopt
            try:
                t0 = now()
                await chan.listen()
                await b.restore(spec, image)
                t_run = now()
                await chan.wait_connected(60)
                t1 = now()
                rec = b.vms[spec.id]
                standby = rec.jail_id != spec.id
                m = smaps_memory(int(rec.paths.pid_file.read_text()), "memfd:cpuos-")
            finally:
                await chan.close()
                await b.kill(spec.id)
            console.print(f"  clone {i}/{n}{' (standby QEMU)' if standby else ''}: agent "
                          f"ready after {ms(t1 - t0)} (running {ms(t_run - t0)}); VMM USS "
                          f"{mib(m['uss'])} beside guest RAM "
                          f"({mib(m['ram_private'])} of it private)")
            if i == 0:
                continue  # warmup
            out["clone_s"].append(t1 - t0)
            out["clone_running_s"].append(t_run - t0)
            out["standby"].append(standby)
            out["vmm_uss"].append(m["uss"])
            out["vmm_pss"].append(m["pss"])
            out["ram_private"].append(m["ram_private"])
    finally:
        await b.close()
        for sid in list(b.vms):
            await b.kill(sid)
        shutil.rmtree(image, ignore_errors=True)
    return out


def bench_microvm(tmp: Path, rootfs: Path, n: int, n_clone: int,
                  gvisor: Callable[[], dict[str, Any]], tcg: bool = False) -> dict[str, Any]:
    """Section 9: jailed QEMU spawn → QMP ready vs bare QEMU; the KVM boot probe; if it
    passes, clone from template → agent ready and per-VM memory; the gVisor snapshot create
    of the same run beside (``gvisor()``)."""
    accel: Accel = "kvm"
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC))
    except OSError:
        accel = "tcg"  # spawn only: QEMU cannot even initialise KVM here
    out: dict[str, Any] = {"n": n, "accel": accel, "artifacts": None}
    mb = MicroVMBench(tmp, accel)
    out["artifacts"] = mb.art.vmlinux if mb.art is not None else None
    try:
        spawn: list[float] = []
        bare: list[float] = []
        for i in range(n + 1):
            a = mb.spawn_jailed()
            c = mb.spawn_bare()
            if i == 0:
                continue  # warmup
            spawn.append(a)
            bare.append(c)
            console.print(f"  spawn {i}/{n}: jailed QEMU → QMP ready {ms(a)}; "
                          f"bare QEMU {ms(c)}")
        out["spawn_jailed_s"], out["spawn_bare_s"] = spawn, bare
        t0 = now()
        ok, reason = kvm_boot_probe(5.0)
        out["probe"] = {"ok": ok, "reason": reason, "seconds": now() - t0}
        console.print(f"  KVM boot probe ({out['probe']['seconds']:.2f}s): "
                      f"{'passed' if ok else 'failed'}: {reason}")
        if ok or (tcg and mb.art is not None):
            pkg = tmp / "microvm-agent-pkg"
            (pkg / "cpuos_agent").mkdir(parents=True)
            for f in Path(cpuos_agent.__file__).parent.glob("*.py"):
                shutil.copy2(f, pkg / "cpuos_agent" / f.name)
            cmb = mb
            if not ok:  # --microvm-tcg: the same path with the guest emulated
                cmb = MicroVMBench(tmp / "tcg", "tcg")
                out["clone_accel"] = "tcg"
                console.print("  [yellow]clone rows under TCG (emulated guest): the path is "
                              "the real one, the figures are not KVM's[/]")
            try:
                out["clone"] = asyncio.run(mvm_clones(cmb, rootfs, pkg, n_clone))
            finally:
                if cmb is not mb:
                    cmb.cleanup()
    finally:
        left = mb.cleanup()
        out["jails_left"] = left
        if left:
            console.print(f"[yellow]microvm: removed leftover jails {left}[/]")
    out["gvisor"] = gvisor()
    return out


# ---- report -----------------------------------------------------------------------------

def table(title: str, cols: Sequence[str]) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    return t


def report(R: dict[str, Any]) -> list[dict[str, Any]]:
    summary: list[dict[str, Any]] = []

    c = R.get("create")
    if c:
        t = table(f"1. create → first exec result (N={c['n']}, after 1 warmup)",
                  ["", "p50", "p95", "min"])
        for label, k in (("ours: Sandbox.create + exec('true')", "ours_s"),
                         ("floor: runsc run /bin/true + delete", "floor_run_delete_s"),
                         ("  of which runsc run (foreground)", "floor_run_s"),
                         ("  of which runsc delete", "floor_delete_s")):
            xs = c[k]
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 95)), ms(min(xs)))
        console.print(t)
        summary.append({"metric": "create → first exec, p50", "ours": ms(median(c["ours_s"])),
                        "floor": ms(median(c["floor_run_delete_s"])), "target": "—",
                        "met": "—"})

    e = R.get("exec")
    if e:
        t = table(f"2. exec round trip of `true` on a running sandbox (N={e['n']}, "
                  f"after {e['warmup']} warmup)", ["", "p50", "p99", "min"])
        for label, k in (("ours: sbx.exec('true')", "ours_shell_s"),
                         ("ours: sbx.exec(['/bin/true'])", "ours_argv_s"),
                         ("floor: subprocess.run(['/bin/true']) inside the sandbox",
                          "floor_in_sandbox_s")):
            xs = e[k]
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 99)), ms(min(xs)))
        xs = e["peer_runsc_exec_s"]
        t.add_row(f"peer: host `runsc exec <id> /bin/true` (N={e['peer_n']})", ms(median(xs)),
                  ms(pct(xs, 99)), ms(min(xs)))
        console.print(t)
        fl = ms(median(e["floor_in_sandbox_s"]))
        summary.append({"metric": "exec 'true' round trip, p50",
                        "ours": ms(median(e["ours_shell_s"])), "floor": fl, "target": "—",
                        "met": "—"})
        summary.append({"metric": "exec ['/bin/true'] round trip, p50",
                        "ours": ms(median(e["ours_argv_s"])), "floor": fl, "target": "—",
                        "met": "—"})

    def throughput_table(title: str, data: dict[str, Any],
                         rows: Sequence[tuple[str, str]]) -> None:
        t = table(title, ["", "median", "best", "worst"])
        for label, k in rows:
            xs = data[k]
            t.add_row(label, mbps(median(xs)), mbps(max(xs)), mbps(min(xs)))
        console.print(t)

    s = R.get("stream")
    if s:
        throughput_table(
            f"3. stdout streaming to the SDK ({s['bytes'] // MiB} MiB of zeros, "
            f"{s['runs']} runs; MB = 10^6 B)", s,
            (("ours: sbx.exec('head -c …', max_output=1 MiB)", "ours_MBps"),
             ("floor: runsc exec head -c … | host pipe", "floor_MBps"),
             ("(info) ours: sbx.exec('dd … bs=1M')", "ours_dd_MBps"),
             ("(info) floor: runsc exec dd … bs=1M | host pipe", "floor_dd_MBps")))
        for what, k in (("head -c", ""), ("dd bs=1M", "_dd")):
            o = median(s[f"ours{k}_MBps"])
            summary.append({"metric": f"stdout streaming ({what}), median", "ours": mbps(o),
                            "floor": mbps(median(s[f"floor{k}_MBps"])),
                            "target": "≥ 200 MB/s", "met": "yes" if o >= 200 else "no"})

    f = R.get("files")
    if f:
        throughput_table(
            f"4. files, {f['bytes'] // MiB} MiB random data ({f['runs']} runs; MB = 10^6 B)", f,
            (("ours: files.upload", "ours_up_MBps"),
             ("floor: runsc exec sh -c 'cat > f' < file", "floor_up_MBps"),
             ("ours: files.download", "ours_down_MBps"),
             ("floor: runsc exec cat f > file", "floor_down_MBps")))
        for way, k in (("upload", "up"), ("download", "down")):
            o = median(f[f"ours_{k}_MBps"])
            summary.append({"metric": f"file {way}, median", "ours": mbps(o),
                            "floor": mbps(median(f[f"floor_{k}_MBps"])),
                            "target": "≥ 150 MB/s", "met": "yes" if o >= 150 else "no"})

    def timing_table(title: str, rows: Sequence[tuple[str, Sequence[float]]]) -> None:
        t = table(title, ["", "p50", "p95", "min"])
        for label, xs in rows:
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 95)), ms(min(xs)))
        console.print(t)

    def target_row(metric: str, ours: float, floor: float, limit: float, target: str
                   ) -> dict[str, Any]:
        return {"metric": metric, "ours": ms(ours), "floor": ms(floor), "target": target,
                "met": "yes" if ours <= limit else "no"}

    sc = R.get("snap_create")
    if sc:
        timing_table(
            f"5. create from the template snapshot → first exec result (N={sc['n']}, after 1 "
            f"warmup; CPUOS_POOL_SIZE=0; image {mib(sc['image_bytes'])})",
            [("ours: Sandbox.create + exec('true')", sc["ours_s"]),
             ("  of which Sandbox.create", sc["ours_create_s"]),
             ("floor: runsc restore --detach (same image)", sc["floor_restore_s"]),
             ("floor: runsc restore --detach + runsc exec true", sc["floor_restore_exec_s"])])
        o, floor_s = median(sc["ours_s"]), median(sc["floor_restore_s"])
        summary.append(target_row("create from snapshot → first exec, p50", o, floor_s,
                                  1.2 * floor_s, f"≤ 1.2× floor ({ms(1.2 * floor_s)})"))
        summary[-1]["note"] = (f"{o / floor_s:.2f}× runsc restore; "
                               f"{o / median(sc['floor_restore_exec_s']):.2f}× restore + exec")

    pl = R.get("pool")
    if pl:
        timing_table(
            f"6. create from the warm pool (CPUOS_POOL_SIZE={pl['pool_size']}, full before "
            f"each sample; N={pl['n']}, after 1 warmup; {pl['pool_misses']} not from the pool)",
            [("ours: Sandbox.create", pl["ours_create_s"]),
             ("ours: Sandbox.create + exec('true')", pl["ours_create_exec_s"]),
             ("floor: GET /health on a fresh connection", pl["floor_http_s"]),
             ("floor: runsc exec true into the running sandbox", pl["floor_runsc_exec_s"])])
        summary.append(target_row("create from warm pool, p50", median(pl["ours_create_s"]),
                                  median(pl["floor_http_s"]), 0.010, "≤ 10 ms"))
        summary.append({"metric": "create from warm pool + first exec, p50",
                        "ours": ms(median(pl["ours_create_exec_s"])),
                        "floor": ms(median(pl["floor_runsc_exec_s"])), "target": "—",
                        "met": "—"})

    pr = R.get("pause")
    if pr:
        timing_table(
            f"7. pause / resume with a 100 MiB heap (N={pr['n']}, after 1 warmup cycle)",
            [("ours: sbx.pause()", pr["ours_pause_s"]),
             *[(f"  (info, daemon log) of which {label}", pr[f"ours_pause_{k}_s"])
               for k, label in (("quiesce", "quiesce"),
                                ("checkpoint", "runsc checkpoint + delete"),
                                ("teardown", "teardown"))
               if f"ours_pause_{k}_s" in pr],
             ("floor: runsc checkpoint", pr["floor_checkpoint_s"]),
             ("floor: runsc checkpoint + runsc delete", pr["floor_checkpoint_delete_s"]),
             ("ours: Sandbox.resume(id)", pr["ours_resume_s"]),
             ("ours: Sandbox.resume(id) + exec('true')", pr["ours_resume_exec_s"]),
             ("floor: runsc restore --detach", pr["floor_restore_s"]),
             ("floor: runsc restore --detach + runsc exec true", pr["floor_restore_exec_s"])])
        summary.append(target_row("pause, 100 MiB heap, p50", median(pr["ours_pause_s"]),
                                  median(pr["floor_checkpoint_s"]), 0.400, "≤ 400 ms"))
        summary.append(target_row("resume, 100 MiB heap, p50", median(pr["ours_resume_s"]),
                                  median(pr["floor_restore_s"]), 0.300, "≤ 300 ms"))
        summary.append(target_row("resume + first exec, 100 MiB heap, p50",
                                  median(pr["ours_resume_exec_s"]),
                                  median(pr["floor_restore_exec_s"]), 0.300, "≤ 300 ms"))

    sz = R.get("size")
    if sz:
        t = table("8. snapshot size on disk, one paused sandbox (MiB = 2^20 B)",
                  ["", "snapshot_bytes", "du -sb", "du (allocated)"])
        for name, label in (("idle", "idle sandbox"), ("heap", "100 MiB heap")):
            x = sz[name]
            t.add_row(f"ours: {label}", mib(x["snapshot_bytes"] or 0), mib(x["du_apparent"]),
                      mib(x["du_allocated"]))
            t.add_row(f"floor: runsc checkpoint, python PID 1 ({name})", "—",
                      mib(x["floor_du_apparent"]), mib(x["floor_du_allocated"]))
            summary.append({"metric": f"snapshot size on disk, {label}",
                            "ours": mib(x["du_allocated"]), "floor": mib(x["floor_du_allocated"]),
                            "target": "—", "met": "—"})
        console.print(t)

    mv = R.get("microvm")
    if mv:
        pr = mv.get("probe") or {}
        cl = mv.get("clone")
        gv = mv.get("gvisor") or {}
        skipped = "skipped (probe failed)" if pr and not pr.get("ok") else "not measured"
        kern = "real guest kernel loaded" if mv.get("artifacts") else "no -kernel: guest " \
            "artifacts not built"
        t = table(f"9. microVM: QEMU -M microvm ({mv['accel']}), default size; spawn N="
                  f"{mv['n']} after 1 warmup, -S ({kern})", ["", "p50", "p95", "min", "target"])
        for label, xs in (("ours: jailer + QEMU (real argv, -S) → QMP ready",
                           mv["spawn_jailed_s"]),
                          ("floor: bare qemu-system-x86_64 -M microvm -S → QMP ready",
                           mv["spawn_bare_s"])):
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 95)), ms(min(xs)), "—")
        emu = mv.get("clone_accel") == "tcg"
        if cl:
            xs = cl["clone_s"]
            tag = " [TCG: emulated, not a KVM figure]" if emu else ""
            t.add_row(f"ours: clone from template → agent ready (N={cl['n']}, "
                      f"{sum(cl.get('standby') or [])} from a standby QEMU){tag}",
                      ms(pct(xs, 50)), ms(pct(xs, 95)), ms(min(xs)),
                      f"≤ {ms(MVM_CLONE_TARGET_S)}")
            for label, ys, tgt in (
                    ("ours: per-VM host memory beyond guest RAM: QEMU's USS but the "
                     "guest-RAM mapping (no jailer process stays: --detach)", cl["vmm_uss"],
                     f"≤ {mib(MVM_MEM_TARGET)}"),
                    ("(info) guest RAM the clone made private (CoW)", cl["ram_private"], "")):
                t.add_row(label, mib(pct(ys, 50)), mib(pct(ys, 95)), mib(min(ys)), tgt)
        else:
            t.add_row("ours: clone from template → agent ready", skipped, "", "",
                      f"≤ {ms(MVM_CLONE_TARGET_S)}")
            t.add_row("ours: per-VM host memory beyond guest RAM", skipped, "", "",
                      f"≤ {mib(MVM_MEM_TARGET)}")
        if gv:
            t.add_row(f"gVisor, same run: Sandbox.create from the template snapshot "
                      f"(N={gv['n']})", ms(pct(gv["ours_create_s"], 50)),
                      ms(pct(gv["ours_create_s"], 95)), ms(min(gv["ours_create_s"])), "—")
            t.add_row("gVisor floor: runsc restore --detach (same image)",
                      ms(pct(gv["floor_restore_s"], 50)), ms(pct(gv["floor_restore_s"], 95)),
                      ms(min(gv["floor_restore_s"])), "—")
        console.print(t)
        if pr:
            console.print(f"  KVM boot probe ({pr['seconds']:.2f}s): "
                          f"{'passed' if pr['ok'] else 'failed'}: {pr['reason']}")
        summary.append({"metric": "microVM spawn → QMP ready (jailed, -S), p50",
                        "ours": ms(median(mv["spawn_jailed_s"])),
                        "floor": ms(median(mv["spawn_bare_s"])), "target": "—", "met": "—"})
        gfig = ms(median(gv["ours_create_s"])) + " (gVisor)" if gv else "—"
        if cl and emu:
            summary.append({"metric": "microVM clone → agent ready, p50 (TCG)",
                            "ours": ms(median(cl["clone_s"])), "floor": gfig,
                            "target": f"≤ {ms(MVM_CLONE_TARGET_S)} (KVM)", "met": "— (TCG)"})
            mem = median(cl["vmm_uss"])
            summary.append({"metric": "microVM per-VM memory beyond guest RAM, p50 (TCG)",
                            "ours": mib(mem), "floor": "—",
                            "target": f"≤ {mib(MVM_MEM_TARGET)} (KVM)", "met": "— (TCG)"})
        elif cl:
            summary.append(target_row("microVM clone → agent ready, p50",
                                      median(cl["clone_s"]), median(gv["ours_create_s"])
                                      if gv else math.nan, MVM_CLONE_TARGET_S,
                                      f"≤ {ms(MVM_CLONE_TARGET_S)}"))
            summary[-1]["note"] = f"floor column: {gfig} Sandbox.create from snapshot"
            mem = median(cl["vmm_uss"])
            summary.append({"metric": "microVM per-VM memory beyond guest RAM, p50",
                            "ours": mib(mem), "floor": "—", "target": f"≤ {mib(MVM_MEM_TARGET)}",
                            "met": "yes" if mem <= MVM_MEM_TARGET else "no"})
        else:
            summary.append({"metric": "microVM clone → agent ready, p50", "ours": skipped,
                            "floor": gfig, "target": f"≤ {ms(MVM_CLONE_TARGET_S)}",
                            "met": "—"})
            summary.append({"metric": "microVM per-VM memory beyond guest RAM, p50",
                            "ours": skipped, "floor": "—", "target": f"≤ {mib(MVM_MEM_TARGET)}",
                            "met": "—"})

    if summary:
        t = table("Summary", ["metric", "ours", "floor", "target", "met?"])
        for row in summary:
            t.add_row(row["metric"], row["ours"], row["floor"], row["target"], row["met"])
        console.print(t)
        for row in summary:
            if row.get("note"):
                console.print(f"  {row['metric']}: {row['note']}")
    return summary


# ---- main -------------------------------------------------------------------------------

def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


SECTIONS = {  # name -> what it measures (the order they run in)
    "create": "1. create → first exec (cold boot: no template snapshot, no pool)",
    "exec": "2. exec round trip",
    "stream": "3. stdout streaming",
    "files": "4. file upload/download",
    "snap-create": "5. create from the template snapshot → first exec",
    "pool": "6. create from the warm pool",
    "pause": "7. pause / resume with a 100 MiB heap",
    "size": "8. snapshot size on disk",
    "microvm": "9. microVM: jailed QEMU spawn → QMP ready; KVM boot probe; clone → agent "
               "ready and per-VM memory (if the probe passes); gVisor snapshot create beside",
}
GROUPS = {"basic": ["create", "exec", "stream", "files"],
          "snapshots": ["snap-create", "pool", "pause", "size"]}


def parse_only(value: str | None) -> list[str]:
    if not value:
        return list(SECTIONS)
    want: set[str] = set()
    for name in (x.strip() for x in value.split(",") if x.strip()):
        if name in GROUPS:
            want.update(GROUPS[name])
        elif name in SECTIONS:
            want.add(name)
        else:
            raise SystemExit(f"--only: unknown section {name!r}; choose from "
                             f"{', '.join([*GROUPS, *SECTIONS])}")
    return [x for x in SECTIONS if x in want]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations, smaller transfers")
    ap.add_argument("--microvm-tcg", action="store_true",
                    help="where the KVM boot probe fails, run the microVM clone rows with the "
                         "guest emulated (TCG): the real path, not KVM's figures")
    ap.add_argument("--only", metavar="SECTIONS",
                    help="comma-separated sections or groups: "
                         + ", ".join([*GROUPS, *SECTIONS]) + " (default: all)")
    args = ap.parse_args()
    only = parse_only(args.only)
    why = e2e_unavailable()
    if why:
        print(f"cannot run the benchmarks: {why}", file=sys.stderr)
        return 2
    rootfs = Path(json.loads((TEMPLATES / "python.json").read_text())["rootfs"])
    q = args.quick
    n_create = 3 if q else 10
    n_exec = 50 if q else 300
    stream_size, stream_bytes = ("128M", 128 * MiB) if q else ("512M", 512 * MiB)
    file_size = 100 * MiB
    n_snap_create = 3 if q else 10
    n_pool = 3 if q else 10
    n_pause = 2 if q else 5
    pool_size = 2
    n_mvm_spawn = 3 if q else 10
    n_mvm_clone = 3 if q else 10
    n_mvm_gvisor = 3 if q else 5

    signal.signal(signal.SIGTERM, _sigterm)
    R: dict[str, Any] = {
        "meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": q,
                 "sections": only,
                 "host": platform.node(), "kernel": platform.release(),
                 "cpus": os.cpu_count(),
                 "runsc": subprocess.run([RUNSC, "--version"], capture_output=True,
                                         text=True).stdout.strip(),
                 "template_rootfs": str(rootfs), "host_before": host_snapshot(),
                 "complete": False},
    }
    daemons: list[Daemon] = []
    daemon_left: dict[str, list[str]] = {}
    raw: RawRunsc | None = None
    tmp = Path(tempfile.mkdtemp(prefix="cpuos-bench-", dir="/tmp"))
    failed = False

    def start_daemon(**env: str) -> Daemon:
        d = new_daemon(**env)
        # snapshots under this daemon's home even if CPUOS_SNAPSHOTS_DIR is set around us
        d.extra_env["CPUOS_SNAPSHOTS_DIR"] = str(d.home / "snapshots")
        # the floors are runsc's: never let CPUOS_BACKEND=auto pick the microVM backend
        d.extra_env["CPUOS_BACKEND"] = "gvisor"
        daemons.append(d)
        d.start()
        console.print(f"daemon {d.url}, home {d.home}, "
                      + ", ".join(f"{k}={v}" for k, v in env.items()))
        return d

    def stop_daemon(d: Daemon, failed: bool = False) -> None:
        if d.home.exists():
            daemon_left[str(d.home)] = d.teardown(failed)

    try:
        raw = RawRunsc(rootfs)
        console.print(f"[bold]cpuos bench[/] ({'quick' if q else 'full'}; {', '.join(only)}); "
                      f"load {os.getloadavg()[0]:.2f}, "
                      f"{R['meta']['host_before']['runsc_processes']} runsc processes on host")
        basic = [x for x in only if x in GROUPS["basic"]]
        if basic:
            # Cold boot, as the floor (runsc run) is: no template snapshot and no warm pool
            # (a pool refill would also run beside the floor's runsc).
            d = start_daemon(CPUOS_POOL_SIZE="0", CPUOS_TEMPLATE_SNAPSHOTS="0")
            if "create" in only:
                console.print(SECTIONS["create"] + " …")
                R["create"] = bench_create(d, raw, n_create)
            if set(basic) - {"create"}:
                kw: dict[str, Any] = d.sdk_kwargs()
                sbx = Sandbox.create(template="python", timeout="60m", **kw)
                try:
                    if "exec" in only:
                        console.print(SECTIONS["exec"] + " …")
                        R["exec"] = bench_exec(d, sbx, n_exec, 10, 30)
                    if "stream" in only:
                        console.print(SECTIONS["stream"] + " …")
                        R["stream"] = bench_stream(d, sbx, stream_size, stream_bytes, 3)
                    if "files" in only:
                        console.print(SECTIONS["files"] + " …")
                        R["files"] = bench_files(d, sbx, tmp, 3, file_size)
                finally:
                    kill_quietly(sbx)
            stop_daemon(d)
        if {"snap-create", "pause", "size"} & set(only):
            # every create restores the template snapshot: no warm pool
            d = start_daemon(CPUOS_POOL_SIZE="0")
            if "snap-create" in only:
                console.print(SECTIONS["snap-create"] + " …")
                R["snap_create"] = bench_snap_create(d, raw, n_snap_create)
            if "pause" in only:
                console.print(SECTIONS["pause"] + " …")
                R["pause"] = bench_pause(d, raw, n_pause)
            if "size" in only:
                console.print(SECTIONS["size"] + " …")
                R["size"] = bench_size(d, raw)
            stop_daemon(d)
        if "pool" in only:
            d = start_daemon(CPUOS_POOL_SIZE=str(pool_size))
            console.print(SECTIONS["pool"] + " …")
            R["pool"] = bench_pool(d, n_pool, pool_size)
            stop_daemon(d)
        if "microvm" in only:
            console.print(SECTIONS["microvm"] + " …")

            def gvisor_snapshot_create() -> dict[str, Any]:
                if "snap_create" in R:  # measured earlier in this run (section 5)
                    return dict(R["snap_create"])
                d = start_daemon(CPUOS_POOL_SIZE="0")
                console.print("  gVisor: create from the template snapshot (same run) …")
                fig = bench_snap_create(d, raw, n_mvm_gvisor)
                stop_daemon(d)
                return fig

            R["microvm"] = bench_microvm(tmp, rootfs, n_mvm_spawn, n_mvm_clone,
                                         gvisor_snapshot_create, tcg=args.microvm_tcg)
        R["meta"]["complete"] = True
    except BaseException:
        failed = True
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
        PROCS.kill_all()
        raw_left = raw.cleanup() if raw is not None else []
        for d in daemons:
            stop_daemon(d, failed)
        shutil.rmtree(tmp, ignore_errors=True)
        ours_paths = [d.home for d in daemons] + ([raw.tmp] if raw else [])
        deadline = time.time() + 10  # sandbox/gofer processes exit shortly after delete
        while (stray := runsc_pids_under(ours_paths)) and time.time() < deadline:
            time.sleep(0.2)
        R["meta"]["host_after"] = host_snapshot()
        R["meta"]["cleanup"] = {"raw_containers_left": raw_left,
                                "daemon_containers_left": daemon_left,
                                "stray_runsc_processes": stray}
        if raw_left or any(daemon_left.values()):
            console.print(f"[yellow]cleanup deleted leftover containers: raw {raw_left}, "
                          f"daemons {daemon_left}[/]")
        if stray:
            console.print(f"[red]runsc processes of this run still alive: {stray}[/]")
        try:
            R["summary"] = report(R)  # partial results too, if a benchmark failed
        except Exception as e:
            console.print(f"[red]report failed: {e!r}[/]")
        R["meta"]["failed"] = failed
        # an incomplete or partial (--only) run does not overwrite the last full results
        if not R["meta"]["complete"]:
            out = RESULTS.with_name("results-partial.json")
        elif only != list(SECTIONS):
            out = RESULTS.with_name("results-only-" + "+".join(only) + ".json")
        else:
            out = RESULTS
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(R, indent=1))
        console.print(f"results: {out}; load average at the end "
                      f"{R['meta']['host_after']['loadavg'][0]:.2f}, "
                      f"{R['meta']['host_after']['runsc_processes']} runsc processes on host")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
