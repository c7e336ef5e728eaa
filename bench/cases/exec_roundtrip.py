"""Benchmark 2: exec round trip of `true` on a running sandbox, beside the floor (a
resident Python process in the same sandbox timing ``subprocess.run(["/bin/true"])``) and a
peer (one host ``runsc exec`` per command, as Google's ``gvisor`` PyPI package does).

    .venv/bin/python bench/cases/exec_roundtrip.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (COLD_BOOT, PROCS, Context, Row, case_main, console, info_row, median,
                           ms, now, pct, runsc_exec, table)

SECTION = KEY = "exec"
TITLE = "2. exec round trip"
DAEMON = COLD_BOOT

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


def measure(ctx: Context) -> dict[str, Any]:
    d, sbx = ctx.daemon(COLD_BOOT), ctx.sandbox()
    n, warm, peer_n = ctx.pick(300, 50, 3), ctx.pick(10, 10, 1), ctx.pick(30, 30, 2)
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


def report(e: dict[str, Any]) -> list[Row]:
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
    return [info_row("exec 'true' round trip, p50", ms(median(e["ours_shell_s"])), fl),
            info_row("exec ['/bin/true'] round trip, p50", ms(median(e["ours_argv_s"])), fl)]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
