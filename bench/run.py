"""cpuos benchmarks: our figure next to the raw-backend (runsc) floor measured in the same run.

    sudo .venv/bin/python bench/run.py [--quick]

Starts its own cpuosd (cpuosd.testing.new_daemon: own CPUOS_HOME, shared template cache),
always tears it down, and deletes every runsc container it made itself (a separate
``--root`` for the raw runs), even on Ctrl-C or an exception. Prints one table per
benchmark plus a summary, and writes every sample to .cache/bench/results.json.
See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cpuos import Sandbox
from cpuosd.backends.base import SandboxSpec
from cpuosd.backends.gvisor import SANDBOX_GID, SANDBOX_UID, oci_spec
from cpuosd.config import Config
from cpuosd.testing import TEMPLATES, Daemon, e2e_unavailable, new_daemon

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / ".cache" / "bench" / "results.json"
RUNSC = "runsc"
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
        return [RUNSC, "--root", str(self.root), "--platform=ptrace"]

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
               f"--overlay2=root:{overlay}", "run", "--bundle", str(bundle), cid]
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


def runsc_exec(d: Daemon, sid: str, *argv: str) -> list[str]:
    """What a host-side caller without cpuos does: one ``runsc exec`` per command. Runs as
    the sandbox user, like the agent's commands (runsc's default, root without
    capabilities, cannot write /work)."""
    return [RUNSC, "--root", str(d.home / "runsc"), "exec", "--user",
            f"{SANDBOX_UID}:{SANDBOX_GID}", sid, *argv]


# ---- benchmarks -------------------------------------------------------------------------

def bench_create(d: Daemon, raw: RawRunsc, n: int) -> dict[str, Any]:
    """Sandbox.create + exec('true') vs foreground runsc run (+delete) of /bin/true.
    One untimed warmup of each, then ours and the floor alternate so host noise hits both."""
    kw = d.sdk_kwargs()
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

    s = R.get("stream")
    if s:
        t = table(f"3. stdout streaming to the SDK ({s['bytes'] // MiB} MiB of zeros, "
                  f"{s['runs']} runs; MB = 10^6 B)", ["", "median", "best", "worst"])
        for label, k in (("ours: sbx.exec('head -c …', max_output=1 MiB)", "ours_MBps"),
                         ("floor: runsc exec head -c … | host pipe", "floor_MBps"),
                         ("(info) ours: sbx.exec('dd … bs=1M')", "ours_dd_MBps"),
                         ("(info) floor: runsc exec dd … bs=1M | host pipe", "floor_dd_MBps")):
            xs = s[k]
            t.add_row(label, mbps(median(xs)), mbps(max(xs)), mbps(min(xs)))
        console.print(t)
        o = median(s["ours_MBps"])
        summary.append({"metric": "stdout streaming (head -c), median", "ours": mbps(o),
                        "floor": mbps(median(s["floor_MBps"])), "target": "≥ 200 MB/s",
                        "met": "yes" if o >= 200 else "no"})

    f = R.get("files")
    if f:
        t = table(f"4. files, {f['bytes'] // MiB} MiB random data ({f['runs']} runs; "
                  f"MB = 10^6 B)", ["", "median", "best", "worst"])
        for label, k in (("ours: files.upload", "ours_up_MBps"),
                         ("floor: runsc exec sh -c 'cat > f' < file", "floor_up_MBps"),
                         ("ours: files.download", "ours_down_MBps"),
                         ("floor: runsc exec cat f > file", "floor_down_MBps")):
            xs = f[k]
            t.add_row(label, mbps(median(xs)), mbps(max(xs)), mbps(min(xs)))
        console.print(t)
        for way, k in (("upload", "up"), ("download", "down")):
            o = median(f[f"ours_{k}_MBps"])
            summary.append({"metric": f"file {way}, median", "ours": mbps(o),
                            "floor": mbps(median(f[f"floor_{k}_MBps"])),
                            "target": "≥ 150 MB/s", "met": "yes" if o >= 150 else "no"})

    if summary:
        t = table("Summary", ["metric", "ours", "floor", "target", "met?"])
        for row in summary:
            t.add_row(row["metric"], row["ours"], row["floor"], row["target"], row["met"])
        console.print(t)
    return summary


# ---- main -------------------------------------------------------------------------------

def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations, smaller transfers")
    args = ap.parse_args()
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

    signal.signal(signal.SIGTERM, _sigterm)
    R: dict[str, Any] = {
        "meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": q,
                 "host": platform.node(), "kernel": platform.release(),
                 "cpus": os.cpu_count(),
                 "runsc": subprocess.run([RUNSC, "--version"], capture_output=True,
                                         text=True).stdout.strip(),
                 "template_rootfs": str(rootfs), "host_before": host_snapshot(),
                 "complete": False},
    }
    d = new_daemon()
    raw: RawRunsc | None = None
    tmp = Path(tempfile.mkdtemp(prefix="cpuos-bench-", dir="/tmp"))
    failed = False
    try:
        d.start()
        raw = RawRunsc(rootfs)
        console.print(f"[bold]cpuos bench[/] ({'quick' if q else 'full'}); daemon {d.url}, "
                      f"home {d.home}; load {os.getloadavg()[0]:.2f}, "
                      f"{R['meta']['host_before']['runsc_processes']} runsc processes on host")
        console.print("1. create → first exec …")
        R["create"] = bench_create(d, raw, n_create)
        sbx = Sandbox.create(template="python", timeout="60m", **d.sdk_kwargs())
        try:
            console.print("2. exec round trip …")
            R["exec"] = bench_exec(d, sbx, n_exec, 10, 30)
            console.print("3. stdout streaming …")
            R["stream"] = bench_stream(d, sbx, stream_size, stream_bytes, 3)
            console.print("4. file upload/download …")
            R["files"] = bench_files(d, sbx, tmp, 3, file_size)
        finally:
            try:
                sbx.kill()
            finally:
                sbx.close()
        R["meta"]["complete"] = True
    except BaseException:
        failed = True
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
        PROCS.kill_all()
        raw_left = raw.cleanup() if raw is not None else []
        daemon_left = d.teardown(False)
        shutil.rmtree(tmp, ignore_errors=True)
        ours_paths = [d.home, raw.tmp if raw else d.home]
        deadline = time.time() + 10  # sandbox/gofer processes exit shortly after delete
        while (stray := runsc_pids_under(ours_paths)) and time.time() < deadline:
            time.sleep(0.2)
        R["meta"]["host_after"] = host_snapshot()
        R["meta"]["cleanup"] = {"raw_containers_left": raw_left,
                                "daemon_containers_left": daemon_left,
                                "stray_runsc_processes": stray}
        if raw_left or daemon_left:
            console.print(f"[yellow]cleanup deleted leftover containers: raw {raw_left}, "
                          f"daemon {daemon_left}[/]")
        if stray:
            console.print(f"[red]runsc processes of this run still alive: {stray}[/]")
        try:
            R["summary"] = report(R)  # partial results too, if a benchmark failed
        except Exception as e:
            console.print(f"[red]report failed: {e!r}[/]")
        R["meta"]["failed"] = failed
        # an incomplete run does not overwrite the last complete results
        out = RESULTS if R["meta"]["complete"] else RESULTS.with_name("results-partial.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(R, indent=1))
        console.print(f"results: {out}; load average at the end "
                      f"{R['meta']['host_after']['loadavg'][0]:.2f}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
