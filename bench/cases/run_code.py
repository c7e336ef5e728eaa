"""Benchmark 15: the code interpreter (the ``code-interpreter`` template, whose snapshot holds
the warm kernel). ``run_code("1+1")`` round trip on a warm kernel beside ``exec("true")`` on
the same sandbox (the exec path's round trip, measured in the same run); and
Sandbox.create → first run_code result beside create → first exec result (template
snapshot, CPUOS_POOL_SIZE=0: the kernel is in the snapshot).

    .venv/bin/python bench/cases/run_code.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox

from cases._common import (FROM_SNAPSHOT, Context, Row, case_main, console, kill_quietly,
                           median, ms, now, target_row, timing_table)

SECTION = "run-code"
KEY = "run_code"
TITLE = "15. code interpreter"
DAEMON = FROM_SNAPSHOT
TEMPLATE = "code-interpreter"


def _create_then(d: Any, first: str) -> tuple[float, float]:
    """(create, create → first result) of one new sandbox; ``first``: run_code or exec."""
    t0 = now()
    sbx = Sandbox.create(template=TEMPLATE, timeout="5m", **d.sdk_kwargs())
    try:
        t1 = now()
        if first == "run_code":
            r = sbx.run_code("1+1")
            if r.text != "2":
                raise RuntimeError(f"run_code('1+1') gave {r!r}")
        else:
            x = sbx.exec("true")
            if x.exit_code != 0:
                raise RuntimeError(f"exec('true') failed: {x}")
        t2 = now()
    finally:
        kill_quietly(sbx)
    return t1 - t0, t2 - t0


def measure(ctx: Context) -> dict[str, Any]:
    d = ctx.daemon(FROM_SNAPSHOT)
    n, warm, nc = ctx.pick(300, 50, 3), ctx.pick(20, 10, 1), ctx.pick(10, 3, 1)
    out: dict[str, Any] = {"n": n, "warmup": warm, "n_create": nc}
    _create_then(d, "run_code")  # untimed: makes the template snapshot
    res: dict[str, list[float]] = {"ours_create_run_code_s": [], "ours_create_s": [],
                                   "floor_create_exec_s": [], "floor_create_s": []}
    for i in range(nc):  # alternating, so that load changes hit both alike
        c, t = _create_then(d, "run_code")
        res["ours_create_s"].append(c)
        res["ours_create_run_code_s"].append(t)
        c2, t2 = _create_then(d, "exec")
        res["floor_create_s"].append(c2)
        res["floor_create_exec_s"].append(t2)
        console.print(f"  create {i + 1}/{nc}: → first run_code {ms(t)} (create {ms(c)}); "
                      f"→ first exec {ms(t2)} (create {ms(c2)})")
    out.update(res)
    sbx = Sandbox.create(template=TEMPLATE, timeout="30m", **d.sdk_kwargs())
    ours, floor = [], []
    try:
        for _ in range(warm):
            sbx.run_code("1+1")
            sbx.exec("true")
        for _ in range(n):  # alternating
            t0 = now()
            r = sbx.run_code("1+1")
            t1 = now()
            sbx.exec("true")
            t2 = now()
            if r.text != "2":
                raise RuntimeError(f"run_code('1+1') gave {r!r}")
            ours.append(t1 - t0)
            floor.append(t2 - t1)
    finally:
        kill_quietly(sbx)
    out["ours_run_code_s"], out["floor_exec_s"] = ours, floor
    console.print(f"  run_code('1+1'): p50 {ms(median(ours))}; exec('true'): p50 "
                  f"{ms(median(floor))}")
    return out


def report(e: dict[str, Any]) -> list[Row]:
    timing_table(
        f"15. code interpreter (N={e['n']} round trips after {e['warmup']} warmup; "
        f"N={e['n_create']} creates from the code-interpreter template's snapshot, "
        f"CPUOS_POOL_SIZE=0)",
        [("ours: sbx.run_code('1+1'), warm kernel", e["ours_run_code_s"]),
         ("floor: sbx.exec('true'), same sandbox", e["floor_exec_s"]),
         ("ours: Sandbox.create → first run_code result", e["ours_create_run_code_s"]),
         ("  of which Sandbox.create", e["ours_create_s"]),
         ("floor: Sandbox.create → first exec result", e["floor_create_exec_s"]),
         ("  of which Sandbox.create", e["floor_create_s"])])
    rc, ex = median(e["ours_run_code_s"]), median(e["floor_exec_s"])
    c_rc = median(e["ours_create_run_code_s"])
    c_ex, c_only = median(e["floor_create_exec_s"]), median(e["ours_create_s"])
    r1 = target_row("run_code('1+1') round trip, warm, p50", rc, ex, 0.020, "≤ 20 ms")
    r1["note"] = f"{rc / ex:.2f}× exec('true')"
    r2 = target_row("create → first run_code, p50", c_rc, c_ex, c_only + 0.050,
                    f"≤ create + 50 ms ({ms(c_only + 0.050)})")
    r2["note"] = f"create {ms(c_only)}; first run_code after it {ms(c_rc - c_only)}"
    return [r1, r2]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
