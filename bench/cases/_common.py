"""What the benchmark cases share: statistics and formatting, the host processes a run
starts, the raw-runsc floor, and the driver that runs cases (one daemon configuration at a
time) and reports them. bench/run.py runs many cases with it; each case module runs
itself with ``case_main``.

Cases reach the daemon through the public SDK (``cpuos.Sandbox``), its HTTP API and
``support.daemon`` (a real cpuosd in a home of its own); the raw floor runs ``runsc``
directly, with the gVisor backend's OCI spec builder and the daemon's choice of runsc.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
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
from typing import Any, Protocol, TypeVar, cast

from rich.console import Console
from rich.table import Table

from cpuos import Sandbox
from cpuosd.backends.base import SandboxSpec
from cpuosd.backends.gvisor import SANDBOX_GID, SANDBOX_UID, oci_spec, overlay_flag
from cpuosd.backends.runsc import Runsc, find_runsc
from support.daemon import (TEMPLATES, Daemon, SdkKwargs, e2e_unavailable, new_daemon,
                            runsc_processes, wait_until)

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".cache" / "bench"
MB = 1_000_000  # throughput is reported in MB/s, 1 MB = 10^6 bytes
MiB = 1 << 20

# The daemon configurations the cases run on (environment of support.daemon.new_daemon).
# Cold boot, as the floor (runsc run) is: no template snapshot and no warm pool (a pool
# refill would also run beside the floor's runsc).
COLD_BOOT = {"CPUOS_POOL_SIZE": "0", "CPUOS_TEMPLATE_SNAPSHOTS": "0"}
# Every create restores the template snapshot: no warm pool.
FROM_SNAPSHOT = {"CPUOS_POOL_SIZE": "0"}

console = Console(width=110)
now = time.perf_counter
T = TypeVar("T")
Row = dict[str, Any]  # a row of the summary table: metric, ours, floor, target, met, note?


# ---- statistics and formatting ----------------------------------------------------------

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


def table(title: str, cols: Sequence[str]) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    return t


def timing_table(title: str, rows: Sequence[tuple[str, Sequence[float]]]) -> None:
    t = table(title, ["", "p50", "p95", "min"])
    for label, xs in rows:
        t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 95)), ms(min(xs)))
    console.print(t)


def throughput_table(title: str, data: dict[str, Any], rows: Sequence[tuple[str, str]]
                     ) -> None:
    t = table(title, ["", "median", "best", "worst"])
    for label, k in rows:
        xs = data[k]
        t.add_row(label, mbps(median(xs)), mbps(max(xs)), mbps(min(xs)))
    console.print(t)


def target_row(metric: str, ours: float, floor: float, limit: float, target: str) -> Row:
    return {"metric": metric, "ours": ms(ours), "floor": ms(floor), "target": target,
            "met": "yes" if ours <= limit else "no"}


def info_row(metric: str, ours: str, floor: str) -> Row:
    """A summary row without a target."""
    return {"metric": metric, "ours": ours, "floor": floor, "target": "—", "met": "—"}


# ---- host processes ---------------------------------------------------------------------

class Procs:
    """Every host process a run starts, so cleanup can end the ones still running (by pid,
    only ours)."""

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


def runsc_procs() -> list[tuple[int, str, bytes]]:
    """(pid, argv[0]'s name, cmdline) of runsc processes on the host
    (support.daemon.runsc_processes)."""
    return [(pid, os.path.basename(argv[0].decode(errors="replace")), b"\0".join(argv))
            for pid, argv in runsc_processes()]


def runsc_pids_under(paths: Sequence[Path]) -> list[tuple[int, str]]:
    """runsc processes whose command line names one of ``paths`` (i.e. this run's)."""
    marks = [str(p).encode() for p in paths]
    return [(pid, a0) for pid, a0, cmd in runsc_procs() if any(m in cmd for m in marks)]


def host_snapshot() -> dict[str, Any]:
    return {"loadavg": list(os.getloadavg()), "runsc_processes": len(runsc_procs())}


def du(path: Path) -> tuple[int, int]:
    """(apparent bytes ``du -sb``, allocated bytes ``du -s -B1``) of a directory."""
    out = []
    for flags in (["-sb"], ["-s", "-B1"]):
        rc, o, err = PROCS.run(["du", *flags, str(path)], timeout=60)
        if rc != 0:
            raise RuntimeError(f"du {path}: {err.decode(errors='replace')}")
        out.append(int(o.split()[0]))
    return out[0], out[1]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


# ---- sandboxes through the SDK ----------------------------------------------------------

# PID 1 of a raw container, or a background process in our sandbox: 100 MiB of heap, then a
# ready mark (argv[1]) and a line on stdout, then sleep.
HEAP_HOLDER = """\
import os, sys, time
data = bytearray(os.urandom(1 << 20) * 100)
open(sys.argv[1], "w").close()
print("ready", len(data), flush=True)
while True:
    time.sleep(3600)
"""


def start_heap_holder(sbx: Sandbox) -> None:
    """Start HEAP_HOLDER in the background in sbx and wait until its 100 MiB are allocated."""
    sbx.files.write("/work/holder.py", HEAP_HOLDER)
    r = sbx.exec("nohup python3 /work/holder.py /work/holder.ready >/work/holder.log 2>&1 &")
    if r.exit_code != 0:
        raise RuntimeError(f"starting the heap holder failed: {r}")
    try:
        wait_until(lambda: sbx.files.exists("/work/holder.ready"), "the heap holder")
    except TimeoutError:
        raise RuntimeError("heap holder did not start: "
                           + sbx.files.read_text("/work/holder.log")) from None


def kill_quietly(sbx: Sandbox) -> None:
    try:
        sbx.kill()
    finally:
        sbx.close()


def pause_resume_exec(sbx: Sandbox, kw: SdkKwargs,
                      between: Callable[[str], None] | None = None
                      ) -> tuple[Sandbox, tuple[float, float, float]]:
    """``sbx.pause()``, then ``Sandbox.resume(id)`` and ``exec("true")``: the resumed
    sandbox and (pause, resume, resume + exec) seconds; ``between(id)`` runs untimed while
    it is paused."""
    t0 = now()
    sid = sbx.pause()
    t1 = now()
    if between is not None:
        between(sid)
    t2 = now()
    resumed = Sandbox.resume(sid, **kw)
    t3 = now()
    sbx.close()
    r = resumed.exec("true")
    t4 = now()
    if r.exit_code != 0:
        raise RuntimeError(f"exec true after resume failed: {r}")
    return resumed, (t1 - t0, t3 - t2, t4 - t2)


def create_exec_true(d: Daemon, timeout: str = "5m") -> tuple[str, float, float]:
    """Sandbox.create + exec('true'), killed afterwards (untimed): (id, seconds to the
    create's return, seconds to the exec's result)."""
    t0 = now()
    sbx = Sandbox.create(template="python", timeout=timeout, **d.sdk_kwargs())
    try:
        t1 = now()
        r = sbx.exec("true")
        t2 = now()
    finally:
        kill_quietly(sbx)
    if r.exit_code != 0:
        raise RuntimeError(f"exec true failed: {r}")
    return sbx.id, t1 - t0, t2 - t0


def template_rootfs() -> Path:
    """The python template's root filesystem (the shared template cache)."""
    return Path(json.loads((TEMPLATES / "python.json").read_text())["rootfs"])


# ---- raw backend floor (runsc without cpuos) --------------------------------------------

@functools.cache
def runsc() -> Runsc:
    """The runsc the daemon runs, and its platform (CPUOS_RUNSC, CPUOS_RUNSC_PLATFORM, else
    the daemon's own choice)."""
    return find_runsc()


def runsc_exec_argv(root: Path, sid: str, *argv: str) -> list[str]:
    """What a host-side caller without cpuos does: one ``runsc exec`` per command. Runs as
    the sandbox user, like the agent's commands (runsc's default, root without
    capabilities, cannot write /work)."""
    return [runsc().path, "--root", str(root), "exec", "--user",
            f"{SANDBOX_UID}:{SANDBOX_GID}", sid, *argv]


def runsc_exec(d: Daemon, sid: str, *argv: str) -> list[str]:
    """``runsc exec`` into the daemon's sandbox sid (runsc's container of that id)."""
    return runsc_exec_argv(d.runsc_root, sid, *argv)


class RawRunsc:
    """Containers of the daemon's runsc, flags and OCI config (``oci_spec``, the size of the
    daemon's sandboxes: ``match``), without cpuos: in a runsc root of its own (deleted in
    cleanup)."""

    # a sandbox's size as the API reports it and SandboxSpec takes it
    SIZE = ("vcpus", "memory_mib", "pids", "disk_mib")

    def __init__(self, rootfs: Path) -> None:
        self.rootfs = rootfs
        self.tmp = Path(tempfile.mkdtemp(prefix="cpuos-bench-raw-", dir="/tmp"))
        self.root = self.tmp / "runsc"
        self.agent_dir = self.tmp / "agent"  # empty; mounted at /opt/cpuos like the real one
        self.root.mkdir()
        self.agent_dir.mkdir()
        self.n = 0
        self.size: dict[str, Any] = {}  # SandboxSpec's defaults until match()
        self.networked = False  # the daemon's sandboxes have a network namespace (match())
        self.namespaces: list[str] = []

    def match(self, d: Daemon, sid: str) -> None:
        """From now on, give the raw containers the size the daemon gave its sandbox sid
        (``GET /sandboxes/{id}``), so their OCI config is the daemon's: a restore of the
        daemon's template image checks that it is."""
        with d.client() as c:
            r = c.get(f"/sandboxes/{sid}")
            r.raise_for_status()
            info = r.json()
        known = {f.name for f in dataclasses.fields(SandboxSpec)}
        self.size = {k: info[k] for k in self.SIZE if k in known and info.get(k) is not None}
        self.networked = info.get("network") is not None

    def global_flags(self) -> list[str]:
        return [runsc().path, "--root", str(self.root), f"--platform={runsc().platform}"]

    def sandbox_flags(self, sdir: Path, network: bool = False) -> list[str]:
        """The daemon's backend flags (GVisorBackend): its writable layer (``overlay_flag``:
        a file of the daemon's disk size in the sandbox dir ``sdir``); ``network``: gVisor's
        netstack (``--network=sandbox``) in the network namespace the bundle names, as the
        daemon runs a sandbox that has one."""
        spec = SandboxSpec(id=sdir.name, rootfs=self.rootfs, dir=sdir,
                           agent_dir=self.agent_dir, **self.size)
        return [*self.global_flags(), "--network=sandbox" if network else "--network=none",
                "--host-uds=open", overlay_flag(spec, runsc()), *runsc().gofer_flags()]

    def new_id(self, what: str) -> str:
        self.n += 1
        return f"bench-{what}-{os.getpid()}-{self.n}"

    def bundle(self, cid: str, args: list[str] | None = None,
               agent_dir: Path | None = None, hostname: str = "sandbox",
               netns: str | None = None) -> Path:
        """A fresh sandbox dir for cid (bundle, sock dir, runsc log) with oci_spec's config;
        ``args`` replaces the agent as PID 1, run as the sandbox user (as the agent runs
        commands); ``netns``: the path of a network namespace to run in (then run it with
        ``network=True``). Returns the sandbox dir."""
        sdir = self.tmp / cid
        spec = SandboxSpec(id=cid, rootfs=self.rootfs, dir=sdir,
                           agent_dir=agent_dir or self.agent_dir, hostname=hostname,
                           netns=netns, **self.size)
        for d in (sdir / "bundle", spec.sock_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(spec.sock_dir, 0o755)
        cfg = oci_spec(spec)
        if args is not None:
            cfg["process"]["args"] = args
            cfg["process"]["user"] = {"uid": SANDBOX_UID, "gid": SANDBOX_GID}
        (sdir / "bundle" / "config.json").write_text(json.dumps(cfg, indent=1))
        return sdir

    def run_true(self) -> tuple[float, float, float]:
        """Foreground ``runsc run`` of /bin/true, then ``runsc delete``: (run seconds,
        delete seconds, run+delete seconds)."""
        cid = self.new_id("raw")
        sdir = self.bundle(cid, ["/bin/true"], hostname=cid)
        t0 = now()
        rc, _, err = PROCS.run([*self.sandbox_flags(sdir), "run", "--bundle",
                                str(sdir / "bundle"), cid], timeout=60)
        t1 = now()
        PROCS.run([*self.global_flags(), "delete", "--force", cid], timeout=60)
        t2 = now()
        if rc != 0:
            raise RuntimeError(f"raw runsc run failed (rc={rc}): "
                               f"{err.decode(errors='replace')[-800:]}")
        shutil.rmtree(sdir, ignore_errors=True)
        return t1 - t0, t2 - t1, t2 - t0

    def _check(self, rc: int, what: str, sdir: Path) -> None:
        if rc != 0:
            log = (sdir / "runsc.log").read_bytes()[-800:].decode(errors="replace")
            raise RuntimeError(f"raw runsc {what} failed (rc={rc}): {log}")

    def run_detached(self, cid: str, sdir: Path, network: bool = False) -> None:
        rc = PROCS.run_logged([*self.sandbox_flags(sdir, network), "run", "--detach", "--bundle",
                               str(sdir / "bundle"), cid], sdir / "runsc.log")
        self._check(rc, "run --detach", sdir)

    def restore(self, cid: str, sdir: Path, image: Path, network: bool = False) -> None:
        rc = PROCS.run_logged([*self.sandbox_flags(sdir, network), "restore", "--detach",
                               f"--image-path={image}", "--bundle", str(sdir / "bundle"), cid],
                              sdir / "runsc.log")
        self._check(rc, "restore --detach", sdir)

    def netns(self) -> str:
        """A network namespace like the daemon gives a sandbox (made ahead, as the daemon's
        are: not timed), with an addressed interface and a default route but no peer (a
        veth pair with both ends inside: the floor sends nothing). Returns its path; removed in
        cleanup."""
        self.n += 1
        name = f"cpuos-bench-{os.getpid()}-{self.n}"
        self.namespaces.append(name)
        for argv in (["ip", "netns", "add", name],
                     ["ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name",
                      "peer0"],
                     ["ip", "-n", name, "link", "set", "peer0", "up"],
                     ["ip", "-n", name, "addr", "add", "10.254.255.2/30", "dev", "eth0"],
                     ["ip", "-n", name, "link", "set", "eth0", "up"],
                     ["ip", "-n", name, "link", "set", "lo", "up"],
                     ["ip", "-n", name, "route", "add", "default", "via", "10.254.255.1"]):
            rc, _, err = PROCS.run(argv, timeout=30)
            if rc != 0:
                raise RuntimeError(f"{' '.join(argv)}: {err.decode(errors='replace')}")
        return f"/var/run/netns/{name}"

    def drop_netns(self, path: str) -> None:
        name = path.rsplit("/", 1)[-1]
        PROCS.run(["ip", "netns", "del", name], timeout=30)
        if name in self.namespaces:
            self.namespaces.remove(name)

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

    def wait_log(self, sdir: Path, text: bytes) -> None:
        log = sdir / "runsc.log"
        try:
            wait_until(lambda: text in log.read_bytes(), f"{text!r} from the raw container")
        except TimeoutError:
            raise RuntimeError(f"raw container did not print {text!r}: "
                               f"{log.read_bytes()[-800:].decode(errors='replace')}") from None

    def cleanup(self) -> list[str]:
        left: list[str] = []
        if self.root.exists():
            rc, out, _ = PROCS.run([*self.global_flags(), "list", "-format=json"], timeout=60)
            if rc == 0:
                left = [c["id"] for c in json.loads(out or b"null") or []]
            for cid in left:
                PROCS.run([*self.global_flags(), "delete", "--force", cid], timeout=60)
        for name in list(self.namespaces):
            PROCS.run(["ip", "netns", "del", name], timeout=30)
        self.namespaces.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return left


# ---- running cases ----------------------------------------------------------------------

class Case(Protocol):
    """A benchmark case: a module of bench/cases/."""

    @property
    def SECTION(self) -> str: ...  # its name for bench/run.py --only
    @property
    def KEY(self) -> str: ...  # its figures' key in results.json
    @property
    def TITLE(self) -> str: ...  # printed before it runs
    @property
    def DAEMON(self) -> dict[str, str] | None: ...  # its daemon (None: it starts its own)

    def measure(self, ctx: Context) -> dict[str, Any]: ...

    def report(self, data: dict[str, Any]) -> list[Row]:
        """Print the case's table; its rows of the summary."""


class Context:
    """What the cases of one run share: the mode (N), a temp dir, one daemon at a time
    (``daemon(env)``), a long-lived sandbox on it, the raw floor, and the figures of the
    cases that ran before (``results``). ``close`` removes all of it."""

    def __init__(self, mode: str, args: argparse.Namespace) -> None:
        self.mode = mode  # full | quick | smoke
        self.args = args
        self.rootfs = template_rootfs()
        self.results: dict[str, Any] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="cpuos-bench-", dir="/tmp"))
        self.daemons: list[Daemon] = []
        self.daemon_left: dict[str, list[str]] = {}
        self._daemon: Daemon | None = None
        self._env: dict[str, str] = {}
        self._sbx: Sandbox | None = None
        self._raw: RawRunsc | None = None
        self._deferred: list[tuple[str, Callable[[], None]]] = []

    def pick(self, full: T, quick: T, smoke: T) -> T:
        """The size for this run's mode (smoke: tiny, proves the case runs)."""
        return {"full": full, "quick": quick, "smoke": smoke}[self.mode]

    @property
    def raw(self) -> RawRunsc:
        if self._raw is None:
            self._raw = RawRunsc(self.rootfs)
        return self._raw

    def daemon(self, env: dict[str, str]) -> Daemon:
        """A running cpuosd with environment ``env``: the current one if it has it, else a
        new one (the current one is torn down first: one daemon at a time)."""
        if self._daemon is not None and self._env == env:
            return self._daemon
        self.stop_daemon()
        d = self._start_daemon(env)
        self._daemon, self._env = d, dict(env)
        return d

    def _start_daemon(self, env: dict[str, str]) -> Daemon:
        d = new_daemon(**env)
        # snapshots under this daemon's home even if CPUOS_SNAPSHOTS_DIR is set around us
        # (support.daemon runs it with CPUOS_BACKEND=gvisor: the floors are runsc's)
        d.extra_env["CPUOS_SNAPSHOTS_DIR"] = str(d.home / "snapshots")
        self.daemons.append(d)
        d.start()
        console.print(f"daemon {d.url}, home {d.home}, "
                      + ", ".join(f"{k}={v}" for k, v in env.items()))
        return d

    def extra_daemon(self, env: dict[str, str]) -> Daemon:
        """A second cpuosd beside the current one, for a case that alternates two
        configurations sample by sample; torn down by ``drop_daemon`` or at close."""
        return self._start_daemon(env)

    def drop_daemon(self, d: Daemon, failed: bool = False) -> None:
        """Tear down a daemon from ``extra_daemon`` (what it left goes to the report)."""
        if d.home.exists():
            self.daemon_left[str(d.home)] = d.teardown(failed)

    def sandbox(self) -> Sandbox:
        """One long-lived sandbox on the current daemon, shared by the cases that run on it
        (killed when the daemon stops)."""
        if self._daemon is None:
            raise RuntimeError("no daemon running")
        if self._sbx is None:
            self._sbx = Sandbox.create(template="python", timeout="60m",
                                       **self._daemon.sdk_kwargs())
        return self._sbx

    def defer(self, what: str, fn: Callable[[], None]) -> None:
        """Undo something a case made outside the daemons and the raw root (a network
        namespace, a fake internet): ``fn`` runs at ``close`` (last deferred first, after
        the daemons and raw containers are gone), even after a failure or Ctrl-C, unless
        the case has run it already with ``undo``. ``fn`` must be idempotent."""
        self._deferred.append((what, fn))

    def undo(self, what: str | None = None) -> None:
        """Run the deferred cleanups now (last first): the one named ``what``, or all. Each
        is forgotten only once it has run, so an interrupted one runs again at close."""
        for item in reversed(list(self._deferred)):
            if what is None or item[0] == what:
                item[1]()
                self._deferred.remove(item)

    def _undo_all(self) -> list[str]:
        failed = []
        for item in reversed(list(self._deferred)):
            try:
                item[1]()
            except Exception as e:
                failed.append(f"{item[0]}: {e!r}")
            self._deferred.remove(item)
        return failed

    def stop_daemon(self, failed: bool = False) -> None:
        d, sbx, self._daemon, self._sbx = self._daemon, self._sbx, None, None
        try:
            if sbx is not None:
                kill_quietly(sbx)
        finally:
            if d is not None and d.home.exists():
                self.daemon_left[str(d.home)] = d.teardown(failed)

    def close(self, failed: bool) -> dict[str, Any]:
        """End every process, container and daemon of the run and remove its files;
        returns what was still there (the cleanup report)."""
        PROCS.kill_all()
        raw_left = self._raw.cleanup() if self._raw is not None else []
        with contextlib.suppress(Exception):
            self.stop_daemon(failed)
        for d in self.daemons:
            if d.home.exists():
                self.daemon_left[str(d.home)] = d.teardown(failed)
        undo_failed = self._undo_all()
        shutil.rmtree(self.tmp, ignore_errors=True)
        ours = [d.home for d in self.daemons] + ([self._raw.tmp] if self._raw else [])
        deadline = time.time() + 10  # sandbox/gofer processes exit shortly after delete
        while (stray := runsc_pids_under(ours)) and time.time() < deadline:
            time.sleep(0.2)
        if raw_left or any(self.daemon_left.values()):
            console.print(f"[yellow]cleanup deleted leftover containers: raw {raw_left}, "
                          f"daemons {self.daemon_left}[/]")
        if stray:
            console.print(f"[red]runsc processes of this run still alive: {stray}[/]")
        if undo_failed:
            console.print(f"[red]cleanup failed: {undo_failed}[/]")
        out: dict[str, Any] = {"raw_containers_left": raw_left,
                               "daemon_containers_left": self.daemon_left,
                               "stray_runsc_processes": stray}
        if undo_failed:
            out["cleanup_failed"] = undo_failed
        return out


def report(R: dict[str, Any], cases: Sequence[Case]) -> list[Row]:
    """Each case's table (in the order given), then the summary; returns the summary."""
    summary: list[Row] = []
    for case in cases:
        if R.get(case.KEY):
            summary += case.report(R[case.KEY])
    if summary:
        t = table("Summary", ["metric", "ours", "floor", "target", "met?"])
        for row in summary:
            t.add_row(row["metric"], row["ours"], row["floor"], row["target"], row["met"])
        console.print(t)
        for row in summary:
            if row.get("note"):
                console.print(f"  {row['metric']}: {row['note']}")
    return summary


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def execute(run_order: Sequence[Case], report_order: Sequence[Case], mode: str,
            args: argparse.Namespace, out: Callable[[dict[str, Any]], Path]) -> int:
    """Run the cases in ``run_order``, each on its daemon configuration (consecutive cases
    with the same one share the daemon); always clean up; print their tables in
    ``report_order`` and the summary (of a failed run too); write every sample to
    ``out(results)``."""
    signal.signal(signal.SIGTERM, _sigterm)
    ctx = Context(mode, args)
    R: dict[str, Any] = {
        "meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode,
                 "quick": mode == "quick", "sections": [c.SECTION for c in report_order],
                 "host": platform.node(), "kernel": platform.release(),
                 "cpus": os.cpu_count(),
                 "runsc": subprocess.run([runsc().path, "--version"], capture_output=True,
                                         text=True).stdout.strip(),
                 "template_rootfs": str(ctx.rootfs), "host_before": host_snapshot(),
                 "complete": False},
    }
    failed = False
    try:
        console.print(f"[bold]cpuos bench[/] ({mode}; "
                      f"{', '.join(c.SECTION for c in report_order)}); "
                      f"load {os.getloadavg()[0]:.2f}, "
                      f"{R['meta']['host_before']['runsc_processes']} runsc processes on host")
        for case in run_order:
            if case.DAEMON is None:
                ctx.stop_daemon()
            else:
                ctx.daemon(case.DAEMON)
            console.print(case.TITLE + " …")
            R[case.KEY] = ctx.results[case.KEY] = case.measure(ctx)
        ctx.stop_daemon()
        R["meta"]["complete"] = True
    except BaseException:
        failed = True
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
        R["meta"]["cleanup"] = ctx.close(failed)
        R["meta"]["host_after"] = host_snapshot()
        try:
            R["summary"] = report(R, report_order)  # partial results too, if a case failed
        except Exception as e:
            console.print(f"[red]report failed: {e!r}[/]")
        R["meta"]["failed"] = failed
        path = out(R)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(R, indent=1))
        console.print(f"results: {path}; load average at the end "
                      f"{R['meta']['host_after']['loadavg'][0]:.2f}, "
                      f"{R['meta']['host_after']['runsc_processes']} runsc processes on host")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0


def case_main(name: str, argv: list[str] | None = None) -> int:
    """``python bench/cases/<case>.py [--quick | --smoke]``: the case module ``name`` by
    itself, on a daemon of its own; samples in .cache/bench/case-<section>[-<mode>].json."""
    case = cast(Case, sys.modules[name])
    ap = argparse.ArgumentParser(description=(case.__doc__ or case.SECTION).splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer iterations")
    size.add_argument("--smoke", action="store_true",
                      help="tiny N: proves the case runs (the test suite runs it)")
    add_arguments = getattr(case, "add_arguments", None)
    if add_arguments is not None:
        add_arguments(ap)
    args = ap.parse_args(argv)
    why = e2e_unavailable()
    if why:
        print(f"cannot run the benchmark: {why}", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    suffix = "" if mode == "full" else f"-{mode}"
    try:
        return execute([case], [case], mode, args,
                       lambda R: OUT / f"case-{case.SECTION}{suffix}.json")
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
