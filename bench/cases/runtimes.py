"""Agent workloads on each gVisor build, beside native, in one run (issue: current gVisor).

    .venv/bin/python bench/cases/runtimes.py [--smoke] [--runtimes pinned,debian]

Runtimes, each measured through its own cpuosd (support.daemon.new_daemon; public SDK
only, no daemon internals):

* ``pinned``  the runsc the project builds (scripts/build-runsc.sh), systrap platform;
* ``debian``  Debian's runsc 2022-12-19 on ptrace (``/usr/bin/runsc``; skipped, and said so,
  when it is not installed);
* ``native``  the same template root filesystem under ``chroot`` as uid 1000, for the
  workload rows only.

Rows (targets from the issue):

* workloads, wall time of the median run: ``import numpy, pandas, matplotlib.pyplot``
  (<= 1.5x native), 100 fork/execs of ``/bin/true`` from bash (<= 3x native),
  ``python3 -c pass`` 20 times (<= 2x native). One driver script times each workload from
  inside (the same script runs natively), so the SDK's round trip is not in these figures;
* exec ``true`` round trip p50 through the SDK, beside the in-sandbox spawn floor
  (``subprocess.run(["/bin/true"])`` from a resident Python process) (<= floor + 2 ms);
* create from the template snapshot (pool off) -> first exec result, p50 (<= 100 ms);
* pause / resume of a sandbox holding a 100 MiB heap, p50 (<= 250 ms / <= 150 ms);
* host memory per idle sandbox: the drop of the host's MemAvailable with N idle sandboxes
  up (N=100; 2 in smoke mode), divided by N (<= 20 MiB).

``--smoke`` runs every row with tiny N (the test suite runs it, so the case cannot rot);
its figures mean nothing. Results go to ``.cache/bench/runtimes[-smoke].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox
from support.daemon import Daemon, e2e_unavailable, new_daemon, wait_until

from cases._common import OUT, median, ms, now, template_rootfs

DEBIAN_RUNSC = "/usr/bin/runsc"

# Times each workload from inside the machine it runs on (sandbox or chroot); prints JSON.
# argv: reps, then "smoke" for small workloads without a warm-up (a smoke run proves the
# case runs; its figures mean nothing)
DRIVER = r"""
import json, subprocess, sys, time
reps = int(sys.argv[1])
smoke = sys.argv[2:] == ["smoke"]
def timed(argv, n=1):
    t0 = time.perf_counter()
    for _ in range(n):
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0
mods, forks, passes = ("numpy", 10, 2) if smoke else ("numpy, pandas, matplotlib.pyplot", 100, 20)
work = {
    "import": lambda: timed(["python3", "-c", f"import {mods}"]),
    "fork100": lambda: timed(["bash", "-c", f"for i in $(seq {forks}); do /bin/true; done"]),
    "pass20": lambda: timed(["python3", "-c", "pass"], passes),
}
out = {k: [] for k in work}
for k, f in work.items() if not smoke else ():
    f()  # warm the page cache
for _ in range(reps):
    for k, f in work.items():
        out[k].append(f())
print(json.dumps(out))
"""

SPAWN_FLOOR = r"""
import json, subprocess, sys, time
n = int(sys.argv[1])
for _ in range(5):
    subprocess.run(["/bin/true"])
lat = []
for _ in range(n):
    t0 = time.perf_counter()
    subprocess.run(["/bin/true"])
    lat.append(time.perf_counter() - t0)
print(json.dumps(lat))
"""

HEAP = r"""
import os, sys, time
heap = bytearray(os.urandom(1 << 20) * 100)
open(sys.argv[1], "w").close()
while True:
    time.sleep(3600)
"""


def native(reps: int, smoke: bool) -> dict[str, list[float]]:
    """The workload driver in a chroot of the template's root, as uid 1000."""
    r = subprocess.run(["chroot", "--userspec=1000:1000", str(template_rootfs()),
                        "env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp",
                        "MPLCONFIGDIR=/tmp", "python3", "-c", DRIVER, str(reps),
                        *(["smoke"] if smoke else [])],
                       capture_output=True, timeout=600, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"native driver failed: {r.stderr.decode(errors='replace')[-800:]}")
    out: dict[str, list[float]] = json.loads(r.stdout)
    return out


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def measure(d: Daemon, args: argparse.Namespace) -> dict[str, Any]:
    kw = d.sdk_kwargs()
    res: dict[str, Any] = {}
    with Sandbox.create(template="python", timeout="30m", **kw) as sbx:
        # workloads
        sbx.files.write("/work/driver.py", DRIVER)
        r = sbx.exec(["python3", "/work/driver.py", str(args.reps),
                      *(["smoke"] if args.smoke else [])], timeout="20m",
                     env={"MPLCONFIGDIR": "/tmp"})
        if r.exit_code != 0:
            raise RuntimeError(f"driver failed in the sandbox: {r.stderr[-800:]}")
        res["workloads"] = json.loads(r.stdout)
        # exec round trip and the in-sandbox spawn floor
        for _ in range(5):
            sbx.exec("true")
        lat = []
        for _ in range(args.n_exec):
            t0 = now()
            r = sbx.exec("true")
            lat.append(now() - t0)
            if r.exit_code != 0:
                raise RuntimeError(f"exec true: {r}")
        res["exec_s"] = lat
        sbx.files.write("/work/spawn.py", SPAWN_FLOOR)
        r = sbx.exec(["python3", "/work/spawn.py", str(args.n_exec)], timeout="10m")
        if r.exit_code != 0:
            raise RuntimeError(f"spawn floor: {r.stderr[-800:]}")
        res["spawn_floor_s"] = json.loads(r.stdout)
        # pause / resume with a 100 MiB heap
        sbx.files.write("/work/heap.py", HEAP)
        sbx.exec("nohup python3 /work/heap.py /work/heap.ready >/dev/null 2>&1 &")
        wait_until(lambda: sbx.files.exists("/work/heap.ready"), "the 100 MiB heap")
        pauses, resumes = [], []
        sid = sbx.id
        for _ in range(args.n_pause):
            t0 = now()
            sbx.pause()
            t1 = now()
            resumed = Sandbox.resume(sid, **kw)
            t2 = now()
            pauses.append(t1 - t0)
            resumes.append(t2 - t1)
            if resumed.exec("pgrep -f heap.py >/dev/null").exit_code != 0:
                raise RuntimeError("the heap holder did not survive pause/resume")
            resumed.close()
        res["pause_s"], res["resume_s"] = pauses, resumes
    # create from the template snapshot (the daemon runs with the pool off)
    creates = []
    for i in range(args.n_create + 1):
        t0 = now()
        s = Sandbox.create(template="python", timeout="5m", **kw)
        try:
            r = s.exec("true")
            dt = now() - t0
        finally:
            s.kill()
            s.close()
        if r.exit_code != 0:
            raise RuntimeError(f"exec true after create: {r}")
        if i:  # the first one may make the template snapshot
            creates.append(dt)
    res["create_exec_s"] = creates
    # host memory per idle sandbox
    before = mem_available()
    idle = []
    try:
        for _ in range(args.n_idle):
            idle.append(Sandbox.create(template="python", timeout="30m", **kw))
        for s in idle:  # every one answers: really up, not still restoring
            if s.exec("true").exit_code != 0:
                raise RuntimeError("an idle sandbox did not answer")
        wait_settled()
        after = mem_available()
    finally:
        for s in idle:
            s.kill()
            s.close()
    res["idle_n"] = args.n_idle
    res["idle_bytes_per_sandbox"] = max(0, before - after) / max(1, args.n_idle)
    return res


def wait_settled() -> None:
    """Give page reclaim and the sandboxes' own start-up a moment: MemAvailable is read
    once it moved by less than 1 MiB over 0.5 s (bounded at 10 s)."""
    deadline = time.monotonic() + 10
    last = mem_available()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        cur = mem_available()
        if abs(cur - last) < (1 << 20):
            return
        last = cur


RUNTIMES = {
    "pinned": {},
    "debian": {"CPUOS_RUNSC": DEBIAN_RUNSC, "CPUOS_RUNSC_PLATFORM": "ptrace"},
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    why = e2e_unavailable()
    if why:
        raise SystemExit(f"runtimes bench cannot run: {why}")
    results: dict[str, Any] = {"smoke": args.smoke, "runtimes": {}, "skipped": {}}
    print(f"native: chroot {template_rootfs()} ...", flush=True)
    results["native"] = native(args.reps, args.smoke)
    for name in args.runtimes:
        env = RUNTIMES[name]
        if "CPUOS_RUNSC" in env and not os.access(env["CPUOS_RUNSC"], os.X_OK):
            results["skipped"][name] = f"{env['CPUOS_RUNSC']} is not installed"
            print(f"{name}: skipped ({results['skipped'][name]})", flush=True)
            continue
        d = new_daemon(CPUOS_POOL_SIZE="0", **env)
        ok = False
        try:
            d.start()
            with d.client() as c:
                health = c.get("/health").json()
            print(f"{name}: runsc {health.get('runsc_version')} on "
                  f"{health.get('platform')} ...", flush=True)
            res = measure(d, args)
            res["health"] = health
            results["runtimes"][name] = res
            ok = True
        finally:
            left = d.teardown(not ok)
            if left:
                raise RuntimeError(f"runsc containers left behind: {left}")
    return results


ROWS: list[tuple[str, str, str, float | None]] = [
    # key, label, unit, target (ratio to native, or absolute seconds / bytes)
    ("import", "import numpy, pandas, matplotlib.pyplot", "x native", 1.5),
    ("fork100", "100 fork/execs of /bin/true", "x native", 3.0),
    ("pass20", "python3 -c pass, 20 times", "x native", 2.0),
]


def report(R: dict[str, Any]) -> list[list[str]]:
    names = list(R["runtimes"])
    head = ["metric", *names, "native / floor", "target"]
    rows: list[list[str]] = [head]
    nat = R["native"]
    for key, label, _, target in ROWS:
        base = median(nat[key])
        cells = [label]
        for n in names:
            v = median(R["runtimes"][n]["workloads"][key])
            cells.append(f"{v:.3f} s ({v / base:.1f}x)")
        rows.append([*cells, f"{base:.3f} s", f"<= {target}x"])
    cells = ["exec true round trip p50 (spawn floor in the sandbox)"]
    for n in names:
        x = R["runtimes"][n]
        cells.append(f"{ms(median(x['exec_s']))} ({ms(median(x['spawn_floor_s']))})")
    rows.append([*cells, "-", "<= floor + 2 ms"])
    for key, label, limit in (("create_exec_s", "create from snapshot -> first exec p50",
                               "<= 100 ms"),
                              ("pause_s", "pause, 100 MiB heap, p50", "<= 250 ms"),
                              ("resume_s", "resume, 100 MiB heap, p50", "<= 150 ms")):
        rows.append([label, *[ms(median(R["runtimes"][n][key])) for n in names], "-",
                     limit])
    rows.append([f"host memory per idle sandbox (N={R['runtimes'][names[0]]['idle_n']})"
                 if names else "host memory per idle sandbox",
                 *[f"{R['runtimes'][n]['idle_bytes_per_sandbox'] / (1 << 20):.1f} MiB"
                   for n in names], "-", "<= 20 MiB"])
    return rows


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny N: proves the case runs")
    ap.add_argument("--runtimes", default="pinned,debian",
                    help="comma-separated: " + ", ".join(RUNTIMES))
    args = ap.parse_args(argv)
    args.runtimes = [x for x in args.runtimes.split(",") if x]
    for x in args.runtimes:
        if x not in RUNTIMES:
            ap.error(f"unknown runtime {x!r}")
    args.reps, args.n_exec, args.n_pause, args.n_create, args.n_idle = (
        (1, 3, 1, 1, 2) if args.smoke else (5, 100, 5, 10, 100))
    R = run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / ("runtimes-smoke.json" if args.smoke else "runtimes.json")
    out.write_text(json.dumps(R, indent=1))
    rows = report(R)
    print_table(rows)
    for name, why in R["skipped"].items():
        print(f"(runtime {name} skipped: {why})")
    print(f"samples: {out}")
    return 0


if __name__ == "__main__":
    shutil.which("chroot") or sys.exit("chroot is not installed")
    sys.exit(main())
