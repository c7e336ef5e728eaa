"""Benchmark 1: Sandbox.create + exec('true') on a cold-booting daemon vs a foreground
``runsc run`` (+ ``delete``) of /bin/true with the same rootfs, flags and OCI config.

    .venv/bin/python bench/cases/create.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (COLD_BOOT, Context, Row, case_main, console, create_exec_true,
                           info_row, median, ms, timing_table)

SECTION = KEY = "create"
TITLE = "1. create → first exec (cold boot: no template snapshot, no pool)"
DAEMON = COLD_BOOT


def measure(ctx: Context) -> dict[str, Any]:
    """One untimed warmup of each, then ours and the floor alternate so host noise hits
    both alike."""
    d, raw, n = ctx.daemon(COLD_BOOT), ctx.raw, ctx.pick(10, 3, 1)
    ours: list[float] = []
    f_run: list[float] = []
    f_del: list[float] = []
    f_total: list[float] = []
    for i in range(n + 1):
        sid, _, t = create_exec_true(d)
        if i == 0:
            raw.match(d, sid)
        a, b, c = raw.run_true()
        if i == 0:
            continue  # warmup
        ours.append(t)
        f_run.append(a)
        f_del.append(b)
        f_total.append(c)
        console.print(f"  create {i}/{n}: ours {ms(t)}, raw run+delete {ms(c)}")
    return {"n": n, "ours_s": ours, "floor_run_s": f_run, "floor_delete_s": f_del,
            "floor_run_delete_s": f_total}


def report(c: dict[str, Any]) -> list[Row]:
    timing_table(f"1. create → first exec result (N={c['n']}, after 1 warmup)",
                 [("ours: Sandbox.create + exec('true')", c["ours_s"]),
                  ("floor: runsc run /bin/true + delete", c["floor_run_delete_s"]),
                  ("  of which runsc run (foreground)", c["floor_run_s"]),
                  ("  of which runsc delete", c["floor_delete_s"])])
    return [info_row("create → first exec, p50", ms(median(c["ours_s"])),
                     ms(median(c["floor_run_delete_s"])))]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
