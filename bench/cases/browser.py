"""Benchmark 13: create a ``browser`` sandbox → its first screenshot (issue 16; target ≤ 1 s),
beside the floor measured in the same run: create → first exec of the same template (the
sandbox restored from its snapshot, chromium already running in it, before any CDP work).
Also: a screenshot of a sandbox that has taken one already (the helper's own cost).

First with a daemon that restores the template snapshot for each create (CPUOS_POOL_SIZE=0:
no warm pool refilling in the background during the measurement), then with a warm pool of
browser sandboxes (CPUOS_POOL_SIZE=1, CPUOS_POOL_TEMPLATES=browser; before each sample the
pool is full again). The sandboxes' network is off (support.daemon).
Needs the browser template built (``cpuosd template build browser``).

    .venv/bin/python bench/cases/browser.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox
from cpuosd.templates.builder import template_info
from support.daemon import TEMPLATES

from cases._common import (FROM_SNAPSHOT, Context, Row, case_main, console, kill_quietly,
                           median, ms, now, target_row, timing_table)
from cases.pool import wait_pool

SECTION = KEY = "browser"
TITLE = "13. browser: create → first screenshot"
DAEMON = FROM_SNAPSHOT
POOLED = {"CPUOS_POOL_SIZE": "1", "CPUOS_POOL_TEMPLATES": "browser"}
TARGET = 1.0  # s, create → first screenshot, p50
PNG = b"\x89PNG\r\n\x1a\n"


def measure(ctx: Context) -> dict[str, Any]:
    if template_info(TEMPLATES, "browser") is None:
        raise RuntimeError(f"the browser template is not built in {TEMPLATES} "
                           "(cpuosd template build browser)")
    d = ctx.daemon(DAEMON)
    kw = d.sdk_kwargs()
    n = ctx.pick(10, 5, 1)
    # untimed warmups first (the first create makes the template snapshot); a smoke run
    # (it proves the case runs, its figures mean nothing) has none
    warm = ctx.pick(1, 1, 0)
    keys = ("ours_s", "ours_create_s", "floor_s", "floor_create_s", "warm_shot_s")
    out: dict[str, Any] = {"n": n, "warmup": warm, **{k: [] for k in keys}}
    for i in range(warm + n):
        t0 = now()
        s = Sandbox.create(template="browser", timeout="10m", **kw)
        try:
            t1 = now()
            png = s.browser.screenshot()
            t2 = now()
            if not png.startswith(PNG):
                raise RuntimeError(f"not a PNG: {png[:40]!r}")
            s.browser.screenshot()
            t3 = now()
        finally:
            kill_quietly(s)
        t4 = now()
        f = Sandbox.create(template="browser", timeout="10m", **kw)
        try:
            t5 = now()
            r = f.exec("true")
            t6 = now()
            if r.exit_code != 0:
                raise RuntimeError(f"exec true: {r}")
        finally:
            kill_quietly(f)
        if i < warm:
            continue
        for k, v in zip(keys, (t2 - t0, t1 - t0, t6 - t4, t5 - t4, t3 - t2), strict=True):
            out[k].append(v)
        console.print(f"  {i + 1 - warm}/{n}: create + screenshot {ms(t2 - t0)} "
                      f"(create {ms(t1 - t0)}); create + exec {ms(t6 - t4)}; "
                      f"warm screenshot {ms(t3 - t2)}")
    out["pool"] = pooled(ctx, n, warm)
    return out


def pooled(ctx: Context, n: int, warm: int) -> dict[str, Any]:
    """Create (from a full warm pool) + first screenshot."""
    d = ctx.daemon(POOLED)
    kw = d.sdk_kwargs()
    out: dict[str, Any] = {"n": n, "misses": 0, "ours_s": [], "ours_create_s": []}
    for i in range(warm + n):
        ready = wait_pool(d, 1, set())
        t0 = now()
        s = Sandbox.create(template="browser", timeout="10m", **kw)
        try:
            t1 = now()
            png = s.browser.screenshot()
            t2 = now()
            if not png.startswith(PNG):
                raise RuntimeError(f"not a PNG: {png[:40]!r}")
        finally:
            kill_quietly(s)
        if i < warm:
            continue
        out["misses"] += s.id not in ready
        out["ours_s"].append(t2 - t0)
        out["ours_create_s"].append(t1 - t0)
        console.print(f"  pool {i + 1 - warm}/{n}: create + screenshot {ms(t2 - t0)} "
                      f"(create {ms(t1 - t0)}){'' if s.id in ready else ' (pool miss)'}")
    return out


def report(r: dict[str, Any]) -> list[Row]:
    timing_table(
        f"13. browser: create → first screenshot (N={r['n']}, after {r.get('warmup', 1)} "
        "warmup; CPUOS_POOL_SIZE=0, from the template snapshot)",
        [("ours: Sandbox.create('browser') + browser.screenshot()", r["ours_s"]),
         ("  of which Sandbox.create", r["ours_create_s"]),
         ("floor: Sandbox.create('browser') + exec('true')", r["floor_s"]),
         ("  of which Sandbox.create", r["floor_create_s"]),
         ("(info) a second screenshot of the same page", r["warm_shot_s"])])
    o, f = median(r["ours_s"]), median(r["floor_s"])
    row = target_row("browser create → first screenshot, p50", o, f, TARGET,
                     f"≤ {ms(TARGET)}")
    row["note"] = (f"{ms(o - f)} over create + exec; warm screenshot p50 "
                   f"{ms(median(r['warm_shot_s']))}")
    p = r["pool"]
    timing_table(
        f"13. browser: create from a warm pool → first screenshot (N={p['n']}, after "
        f"{r.get('warmup', 1)} warmup; CPUOS_POOL_SIZE=1 CPUOS_POOL_TEMPLATES=browser; "
        f"{p['misses']} pool misses)",
        [("ours: Sandbox.create('browser') + browser.screenshot()", p["ours_s"]),
         ("  of which Sandbox.create", p["ours_create_s"])])
    po = median(p["ours_s"])
    prow = target_row("browser create from warm pool → first screenshot, p50", po, f, TARGET,
                      f"≤ {ms(TARGET)}")
    prow["note"] = (f"create p50 {ms(median(p['ours_create_s']))}; floor: create from the "
                    f"snapshot + exec; {p['misses']} pool misses")
    return [row, prow]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
