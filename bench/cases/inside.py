"""Benchmark 19: code inside a sandbox runs as fast as runsc allows. Agent workloads (import
numpy/pandas/matplotlib, 100 fork/execs of /bin/true, ``python3 -c pass`` x20, ``pip
install`` of a local wheel set, ``git clone`` + ``status`` of a generated repo, ``pytest`` on
a generated suite; and, for what the machine's virtualization costs, computation without
system calls and system calls alone), each in four places in one run, sample by sample in
rotation:

- ``native``: a chroot of the template's root filesystem (an overlay on it, in a private
  mount namespace, so the shared template is never written) as uid 1000;
- ``raw``: raw runsc, same rootfs, the daemon's runsc, platform and flags (writable layer,
  netstack in a network namespace, cgroups, the sandbox's size), PID 1 ``sleep infinity``:
  no cpuos agent, no monitoring; each step a ``runsc exec`` as uid 1000;
- ``on``: cpuos with the audit trail on (the default: gVisor's runtime monitoring), each
  step an ``exec`` through the SDK;
- ``off``: cpuos with ``CPUOS_AUDIT_RUNTIME=0`` (a second daemon beside the first).

Every step runs ``bash /tmp/bench/run.sh <workload>`` with the same environment
(``env -i``); bash's ``time`` gives the wall time inside (the exec that starts it is not in
the figure). CPU: native, bash's user+sys of the workload; sandboxes, the sandbox cgroup's
CPU time over the step (the Sentry's work, the monitoring included; steadier than wall time
on a loaded host) less the median of an empty step in the same place. Ratios are medians
of paired samples (one rep of every place back to back).

    .venv/bin/python bench/cases/inside.py [--quick | --smoke]
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import os
import shlex
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (FROM_SNAPSHOT, PROCS, Context, Row, case_main, console, info_row,
                           kill_quietly, median, runsc_exec_argv, table)

from cpuos import Sandbox

SECTION = KEY = "inside"
TITLE = "19. code inside: agent workloads, native / raw runsc / cpuos audit on / off"
# audit on (the default); the "off" daemon is started beside it. A long agent liveness: on a
# loaded host a sandbox busy with a workload may not answer a ping for many seconds, and
# this case measures speed, not liveness.
DAEMON = {**FROM_SNAPSHOT, "CPUOS_AGENT_LIVENESS": "300"}
OFF = {**DAEMON, "CPUOS_AUDIT_RUNTIME": "0"}
PLACES = ("native", "raw", "on", "off")
WORKLOADS = {
    "import": "import numpy, pandas, matplotlib.pyplot",
    "fork100": "100 fork/execs of /bin/true (bash loop)",
    "pass20": "python3 -c pass, 20 times",
    "pip": "pip install of a local wheel set",
    "git": "git clone + status of a generated repo",
    "pytest": "pytest on a generated suite",
    # what this machine's virtualization costs: computation alone, and system calls alone
    "compute": "python3: sum of 3M squares (no system calls)",
    "syscalls": "dd bs=1 count=200000 (400k read/write calls)",
}
# the sizes of the workloads that have one (import: its modules), as their names say. A
# smoke run (it proves the case runs, its figures mean nothing) makes them small, yet not so
# small that bash's time (ms) could see one take none: on a host without KVM, syscalls' 200k
# calls took ~20 s of CPU in each sandbox (3/4 of the smoke run's), import ~4 s
SIZES = {"import": "numpy, pandas, matplotlib.pyplot", "fork100": "100", "pass20": "20",
         "compute": "3_000_000", "syscalls": "200000"}
SMOKE_SIZES = {"import": "numpy", "fork100": "10", "pass20": "2", "compute": "100_000",
               "syscalls": "2000"}
TARGET_RAW, TARGET_OFF = 1.10, 1.05
# the same environment everywhere (cpuos's commands get PATH/HOME/USER/LANG/TERM too)
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "HOME=/tmp/bench/home", "USER=user", "LANG=C.UTF-8", "TERM=xterm",
       "MPLCONFIGDIR=/tmp/bench/mpl",
       # git's identity given: else it guesses one from the host's name (a DNS lookup, which
       # waits for a timeout where no resolver answers)
       "GIT_AUTHOR_NAME=bench", "GIT_AUTHOR_EMAIL=bench@example.invalid",
       "GIT_COMMITTER_NAME=bench", "GIT_COMMITTER_EMAIL=bench@example.invalid"]
PYTEST_DISTS = ["pytest", "pluggy", "iniconfig", "packaging", "pygments"]
PIP_DISTS = ["pytest", "pluggy", "iniconfig", "packaging", "pygments", "rich",
             "markdown-it-py", "mdurl", "click"]

RUN_SH = r"""#!/bin/bash
# one workload (its size N where it has one), timed by bash: prints "<wall> <user> <sys>" in
# seconds
set -u
B=/tmp/bench
N=${2:-}
cd $B
case $1 in
  pip) rm -rf $B/pip-target ;;
  git) rm -rf $B/clone ;;
esac
step() {
  case $1 in
    noop) : ;;
    import) python3 -c "import $N" ;;
    fork100) for ((i = 0; i < N; i++)); do /bin/true; done ;;
    pass20) for ((i = 0; i < N; i++)); do python3 -c pass; done ;;
    pip) python3 -m pip install -q --no-index --no-deps --no-cache-dir \
           --disable-pip-version-check --target $B/pip-target $B/wheels/pip/*.whl ;;
    git) git clone -q $B/repo $B/clone && git -C $B/clone status --porcelain ;;
    pytest) PYTHONPATH=$B/site python3 -m pytest -q -p no:cacheprovider $B/suite ;;
    compute) python3 -c "sum(i * i for i in range($N))" ;;
    syscalls) dd if=/dev/zero of=/dev/null bs=1 count=$N status=none ;;
    *) echo "unknown workload $1" >&2; return 2 ;;
  esac
}
TIMEFORMAT='%3R %3U %3S'
{ time step "$1" >$B/out.log 2>&1 ; } 2>$B/time.txt
rc=$?
if [ $rc -ne 0 ]; then tail -c 2000 $B/out.log >&2; exit $rc; fi
cat $B/time.txt
"""

SETUP_SH = r"""#!/bin/bash
# untimed: the repo, the suite and pytest's site, once per place
set -eu
B=/tmp/bench
mkdir -p $B/home $B/mpl
cd $B
python3 $B/gen.py $B "$1" "$2"
git init -q repo
cd repo
git add -A
git commit -qm init
cd $B
python3 -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check \
  --target $B/site $B/wheels/pytest/*.whl
"""

GEN_PY = r"""
import os, sys
base, files, tests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(files):
    d = os.path.join(base, "repo", f"d{i // 100:03d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i:05d}.txt"), "w") as f:
        f.write(f"file {i}\n" + "line of text\n" * (i % 7))
suite = os.path.join(base, "suite")
os.makedirs(suite, exist_ok=True)
per = 20
for m in range(max(1, tests // per)):
    with open(os.path.join(suite, f"test_m{m:03d}.py"), "w") as f:
        f.write("import pytest\n\n")
        for t in range(per // 2):
            f.write(f"def test_{t}():\n    assert sum(range({t})) == {t * (t - 1) // 2}\n\n")
        f.write("@pytest.mark.parametrize('x', range(%d))\n" % (per - per // 2))
        f.write("def test_param(x):\n    assert str(x).isdigit()\n")
"""


# ---- the files a place needs ------------------------------------------------------------

def wheel_from_installed(name: str, dest: Path) -> Path:
    """A wheel of an installed pure-Python distribution (this interpreter's), repacked from
    its RECORD: the bench brings its own wheel set without reaching an index."""
    dist = md.distribution(name)
    meta = dist.metadata
    tags = [ln.split(":", 1)[1].strip() for ln in (dist.read_text("WHEEL") or "").splitlines()
            if ln.startswith("Tag:")]
    if not tags or not all(t.endswith("-none-any") for t in tags):
        raise RuntimeError(f"{name} is not a pure-Python wheel ({tags})")
    dname, version = meta["Name"].replace("-", "_"), dist.version
    info = f"{dname}-{version}.dist-info"
    path = dest / f"{dname}-{version}-py3-none-any.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or []:
            rel = f.as_posix()
            parts = rel.split("/")
            if ".." in parts or "__pycache__" in parts or (parts[0].endswith(".dist-info")
                                                           and parts[-1] in ("RECORD",
                                                                             "INSTALLER",
                                                                             "REQUESTED",
                                                                             "direct_url.json")):
                continue
            data = Path(str(f.locate())).read_bytes()
            if parts[0].endswith(".dist-info"):
                rel = "/".join([info, *parts[1:]])
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            writer.writerow([rel, f"sha256={digest.decode()}", len(data)])
        writer.writerow([f"{info}/RECORD", "", ""])
        z.writestr(f"{info}/RECORD", record.getvalue())
    return path


def bench_files(dest: Path, smoke: bool) -> Path:
    """/tmp/bench's initial content: scripts and wheels."""
    d = dest / "bench"
    for sub in ("wheels/pip", "wheels/pytest"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "run.sh").write_text(RUN_SH)
    (d / "setup.sh").write_text(SETUP_SH)
    (d / "gen.py").write_text(GEN_PY)
    for name in PYTEST_DISTS:
        wheel_from_installed(name, d / "wheels/pytest")
    for name in (["iniconfig", "pluggy"] if smoke else PIP_DISTS):
        wheel_from_installed(name, d / "wheels/pip")
    for p in [d, *d.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() or p.suffix == ".sh" else 0o644)
    return d


def parse_time(out: str, where: str) -> tuple[float, float]:
    """(wall, user+sys) from run.sh's last line."""
    try:
        wall, user, sys_ = (float(x) for x in out.strip().splitlines()[-1].split())
    except (ValueError, IndexError):
        raise RuntimeError(f"{where}: unexpected output {out[-500:]!r}") from None
    return wall, user + sys_


def cgroup_cpu(cid: str) -> float:
    """CPU seconds of a runsc container's host cgroup (/cpuos/<id>, as oci_spec names it)."""
    for p in (Path(f"/sys/fs/cgroup/cpuacct/cpuos/{cid}/cpuacct.usage"),
              Path(f"/sys/fs/cgroup/cpuos/{cid}/cpu.stat")):
        try:
            text = p.read_text()
        except OSError:
            continue
        if p.name == "cpuacct.usage":
            return int(text) / 1e9
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "usage_usec":
                return int(v) / 1e6
    raise RuntimeError(f"no cgroup CPU figure for {cid}")


def proc_cpu(pid: int) -> float:
    """CPU seconds (user+system, all threads) of a host process."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


# ---- places -----------------------------------------------------------------------------

class Place:
    name = ""

    def setup(self, files: int, tests: int) -> None:
        raise NotImplementedError

    def step(self, workload: str, n: str = "") -> tuple[float, float, float]:
        """(wall inside, CPU, daemon CPU) of one run of ``workload`` (``n``: its SIZES)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Native(Place):
    name = "native"

    def __init__(self, ctx: Context, files: Path) -> None:
        self.base = ctx.tmp / "native"
        self.upper, self.work, self.merged = (self.base / x for x in ("upper", "work", "m"))
        for p in (self.upper, self.work, self.merged):
            p.mkdir(parents=True)
        (self.upper / "tmp").mkdir()
        os.chmod(self.upper / "tmp", 0o1777)
        shutil.copytree(files, self.upper / "tmp/bench")
        for p in [self.upper / "tmp/bench", *(self.upper / "tmp/bench").rglob("*")]:
            os.lchown(p, 1000, 1000)
        self.lower = ctx.rootfs

    def _run(self, *argv: str) -> str:
        m = shlex.quote(str(self.merged))
        script = (f"mount -t overlay overlay -o lowerdir={shlex.quote(str(self.lower))},"
                  f"upperdir={shlex.quote(str(self.upper))},"
                  f"workdir={shlex.quote(str(self.work))} {m} && mount --rbind /dev {m}/dev "
                  f"&& mount -t proc proc {m}/proc && exec chroot --userspec=1000:1000 {m} "
                  + " ".join(shlex.quote(a) for a in ["env", "-i", *ENV, *argv]))
        rc, out, err = PROCS.run(["unshare", "--mount", "--propagation", "private", "--",
                                  "/bin/sh", "-c", script], timeout=900)
        if rc != 0:
            raise RuntimeError(f"native {argv}: rc={rc} {err.decode(errors='replace')[-800:]}")
        return out.decode()

    def setup(self, files: int, tests: int) -> None:
        self._run("bash", "/tmp/bench/setup.sh", str(files), str(tests))

    def step(self, workload: str, n: str = "") -> tuple[float, float, float]:
        wall, cpu = parse_time(self._run("bash", "/tmp/bench/run.sh", workload, n),
                               "native")
        return wall, cpu, 0.0


class Raw(Place):
    name = "raw"

    def __init__(self, ctx: Context, files: Path, like: tuple[Any, str]) -> None:
        raw = ctx.raw
        raw.match(*like)
        shutil.copytree(files, raw.agent_dir / "bench-inside")  # at /opt/cpuos inside
        self.raw = raw
        self.cid = raw.new_id("inside")
        netns = raw.netns() if raw.networked else None
        self.sdir = raw.bundle(self.cid, ["sleep", "infinity"], hostname=self.cid, netns=netns)
        raw.run_detached(self.cid, self.sdir, network=netns is not None)

    def _exec(self, *argv: str, timeout: float = 900) -> str:
        rc, out, err = PROCS.run(runsc_exec_argv(self.raw.root, self.cid, "env", "-i", *ENV,
                                                 *argv), timeout=timeout)
        if rc != 0:
            raise RuntimeError(f"raw {argv}: rc={rc} {err.decode(errors='replace')[-800:]}")
        return out.decode()

    def setup(self, files: int, tests: int) -> None:
        self._exec("cp", "-r", "/opt/cpuos/bench-inside", "/tmp/bench")
        self._exec("bash", "/tmp/bench/setup.sh", str(files), str(tests))

    def step(self, workload: str, n: str = "") -> tuple[float, float, float]:
        c0 = cgroup_cpu(self.cid)
        out = self._exec("bash", "/tmp/bench/run.sh", workload, n)
        c1 = cgroup_cpu(self.cid)
        wall, _ = parse_time(out, "raw")
        return wall, c1 - c0, 0.0

    def close(self) -> None:
        self.raw.delete(self.cid)


class Cpuos(Place):
    def __init__(self, name: str, d: Any, files: Path) -> None:
        self.name, self.d = name, d
        # never paused for idleness (lifecycle.idle) while other places take their turn
        self.sbx = Sandbox.create(template="python", timeout="60m", idle_timeout=0,
                                  **d.sdk_kwargs())
        self.sbx.files.upload_dir(files, "/tmp/bench")

    def _exec(self, *argv: str) -> str:
        r = self.sbx.exec(["env", "-i", *ENV, *argv], timeout="15m")
        if r.exit_code != 0:
            raise RuntimeError(f"{self.name} {argv}: exit {r.exit_code}: {r.stderr[-800:]}")
        return r.stdout

    def setup(self, files: int, tests: int) -> None:
        self._exec("bash", "/tmp/bench/setup.sh", str(files), str(tests))

    def step(self, workload: str, n: str = "") -> tuple[float, float, float]:
        pid = self.d.proc.pid
        c0, d0 = self.sbx.metrics()["cpu_seconds"], proc_cpu(pid)
        out = self._exec("bash", "/tmp/bench/run.sh", workload, n)
        c1 = self.sbx.metrics()["cpu_seconds"]
        # the step is over once what it did is on record (the daemon parses a busy
        # sandbox's trace points once it quiets down: their cost is the daemon's CPU here,
        # and lands on no other place's step)
        self.sbx.audit.list(limit=1, after=1 << 62)
        d1 = proc_cpu(pid)
        wall, _ = parse_time(out, self.name)
        return wall, c1 - c0, d1 - d0

    def close(self) -> None:
        kill_quietly(self.sbx)


# ---- the case ---------------------------------------------------------------------------

def measure(ctx: Context) -> dict[str, Any]:
    on_d = ctx.daemon(DAEMON)
    off_d = ctx.extra_daemon(OFF)
    reps = ctx.pick(7, 3, 1)
    files_n, tests_n = ctx.pick(5000, 5000, 200), ctx.pick(400, 400, 20)
    sizes = ctx.pick(SIZES, SIZES, SMOKE_SIZES)
    out: dict[str, Any] = {"reps": reps, "repo_files": files_n, "tests": tests_n,
                           "sizes": sizes, "load_before": list(os.getloadavg())}
    files = bench_files(ctx.tmp / "inside-files", ctx.mode == "smoke")
    out["wheels"] = sorted(p.name for p in (files / "wheels/pip").iterdir())
    places: list[Place] = []
    try:
        on, off = Cpuos("on", on_d, files), Cpuos("off", off_d, files)
        places = [Native(ctx, files), Raw(ctx, files, (on_d, on.sbx.id)), on, off]
        for p in places:
            console.print(f"  setting up {p.name} …")
            p.setup(files_n, tests_n)
        with on_d.client() as c:
            out["audit_runtime"] = c.get("/health").json().get("audit")
        with off_d.client() as c:
            out["audit_runtime_off"] = c.get("/health").json().get("audit")
        # an empty step's CPU in each place (the exec and bash around the workload)
        noop: dict[str, list[float]] = {p.name: [] for p in places}
        samples: dict[str, dict[str, dict[str, list[float]]]] = {
            w: {p.name: {"wall": [], "cpu": [], "daemon_cpu": []} for p in places}
            for w in WORKLOADS}
        for p in places:  # warm the page cache, matplotlib's font cache... (smoke: not)
            for w in WORKLOADS if ctx.mode != "smoke" else ():
                try:
                    p.step(w, sizes.get(w, ""))
                except Exception as e:
                    raise RuntimeError(f"{w} in {p.name} (warmup): {e}") from e
            for _ in range(ctx.pick(3, 3, 1)):
                noop[p.name].append(p.step("noop")[1])
        out["noop_cpu"], out["samples"] = noop, samples  # (kept if a later step fails)
        for rep in range(reps):
            order = places[rep % len(places):] + places[:rep % len(places)]
            for w in WORKLOADS:
                for p in order:
                    try:
                        wall, cpu, dcpu = p.step(w, sizes.get(w, ""))
                    except Exception as e:
                        raise RuntimeError(f"{w} in {p.name} (rep {rep + 1}): {e}") from e
                    s = samples[w][p.name]
                    s["wall"].append(wall)
                    s["cpu"].append(cpu)
                    s["daemon_cpu"].append(dcpu)
            console.print(f"  rep {rep + 1}/{reps} (native/raw/on/off, s): " + "; ".join(
                w + " " + "/".join(f"{samples[w][p]['wall'][-1]:.2f}" for p in PLACES)
                for w in WORKLOADS))
    finally:
        for p in reversed(places):
            try:
                p.close()
            except Exception as e:
                console.print(f"[yellow]closing {p.name}: {e!r}[/]")
        ctx.drop_daemon(off_d)
    out["load_after"] = list(os.getloadavg())
    return out


def net_cpu(e: dict[str, Any], w: str, place: str) -> list[float]:
    """A place's CPU per run of ``w`` less its empty step's (native: bash's own count)."""
    xs = e["samples"][w][place]["cpu"]
    if place == "native":
        return list(xs)
    base = median(e["noop_cpu"][place])
    return [max(1e-6, x - base) for x in xs]


def paired(e: dict[str, Any], w: str, a: str, b: str, what: str) -> float:
    if what == "cpu":
        xa, xb = net_cpu(e, w, a), net_cpu(e, w, b)
    else:
        xa, xb = e["samples"][w][a][what], e["samples"][w][b][what]
    return median([x / y for x, y in zip(xa, xb, strict=True) if y > 0])


def report(e: dict[str, Any]) -> list[Row]:
    t = table(f"19. code inside ({e['reps']} reps): wall time inside, median; ratios: "
              "median of paired samples, wall / sandbox CPU",
              ["", "native", "raw", "on", "off", "raw/native", "on/raw", "off/raw", "on/off"])
    rows: list[Row] = []
    for w in WORKLOADS:
        s = e["samples"][w]
        med = {p: median(s[p]["wall"]) for p in PLACES}
        r = {(a, b): (paired(e, w, a, b, "wall"), paired(e, w, a, b, "cpu"))
             for a, b in (("raw", "native"), ("on", "raw"), ("off", "raw"), ("on", "off"))}
        t.add_row(w, *(f"{med[p]:.3f}" for p in PLACES),
                  *(f"{x:.2f}/{c:.2f}" for x, c in r.values()))
        on_raw, on_off = r[("on", "raw")], r[("on", "off")]
        rows.append({"metric": f"{w}: cpuos audit on vs raw runsc", "ours": f"{med['on']:.3f} s",
                     "floor": f"{med['raw']:.3f} s", "target": f"<= {TARGET_RAW}x",
                     "met": "yes" if on_raw[0] <= TARGET_RAW else "no",
                     "note": f"paired {on_raw[0]:.2f}x wall, {on_raw[1]:.2f}x sandbox CPU; "
                             f"native {med['native']:.3f} s"})
        rows.append({"metric": f"{w}: audit on vs off", "ours": f"{med['on']:.3f} s",
                     "floor": f"{med['off']:.3f} s", "target": f"<= {TARGET_OFF}x",
                     "met": "yes" if on_off[0] <= TARGET_OFF else "no",
                     "note": f"paired {on_off[0]:.2f}x wall, {on_off[1]:.2f}x sandbox CPU; "
                             f"daemon CPU per run {median(s['on']['daemon_cpu']):.3f} s vs "
                             f"{median(s['off']['daemon_cpu']):.3f} s"})
    console.print(t)
    console.print("  " + "; ".join(f"{w}: {label}" for w, label in WORKLOADS.items()))
    if e.get("sizes", SIZES) != SIZES:
        console.print("  [yellow]sizes of this run (not the names'):[/] " + ", ".join(
            f"{w} {n}" for w, n in e["sizes"].items()))
    console.print("  empty step's CPU (subtracted): " + ", ".join(
        f"{p} {median(xs) * 1000:.0f} ms" for p, xs in e["noop_cpu"].items() if p != "native")
        + f"; load average before {e['load_before'][0]:.2f}, after {e['load_after'][0]:.2f}; "
        f"audit: on {e.get('audit_runtime')!r}, off {e.get('audit_runtime_off')!r}")
    rows.append(info_row("inside: repo files / tests / wheels",
                         f"{e['repo_files']} / {e['tests']} / {len(e['wheels'])}", "—"))
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
