"""Benchmark 5: Sandbox.create + exec('true') restoring the template snapshot (daemon with
CPUOS_POOL_SIZE=0) vs a raw ``runsc restore --detach`` of a copy of the same image.

    .venv/bin/python bench/cases/snap_create.py [--quick | --smoke]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from support.daemon import Daemon

from cases._common import (FROM_SNAPSHOT, Context, RawRunsc, Row, case_main, console,
                           create_exec_true, du, median, mib, ms, now, target_row,
                           timing_table)

SECTION = "snap-create"
KEY = "snap_create"
TITLE = "5. create from the template snapshot → first exec"
DAEMON = FROM_SNAPSHOT


def bench(d: Daemon, raw: RawRunsc, n: int) -> dict[str, Any]:
    """The first create (untimed) makes the template snapshot; ours and the floor
    alternate. Also used by the microVM case (the gVisor figure of the same run)."""
    ours: list[float] = []
    ours_create: list[float] = []
    f_restore: list[float] = []
    f_exec: list[float] = []
    image = agent = None
    for i in range(n + 1):
        sid, t_create, t_exec = create_exec_true(d)
        if image is None or agent is None:
            raw.match(d, sid)
            # the raw floor restores a copy of the daemon's template image, with a copy of
            # the agent package at /opt/cpuos (the restored agent keeps polling for its
            # socket, which nobody serves)
            src, src_agent = d.template_image("python")
            image = raw.tmp / "template-image"
            shutil.copytree(src, image)
            agent = raw.tmp / "agent-copy"
            shutil.copytree(src_agent, agent)
        cid = raw.new_id("restore")
        # the daemon's image has a network namespace (cpuosd.network): so has the floor's
        # restore, made ahead like the daemon's spare namespaces
        ns = raw.netns() if raw.networked else None
        sdir = raw.bundle(cid, agent_dir=agent, netns=ns)
        try:
            t3 = now()
            raw.restore(cid, sdir, image, network=ns is not None)
            t4 = now()
            raw.exec_true(cid)
            t5 = now()
        finally:
            raw.delete(cid)
            shutil.rmtree(sdir, ignore_errors=True)
            if ns is not None:
                raw.drop_netns(ns)
        if i == 0:
            continue  # warmup (ours made the template snapshot)
        ours.append(t_exec)
        ours_create.append(t_create)
        f_restore.append(t4 - t3)
        f_exec.append(t5 - t3)
        console.print(f"  snapshot create {i}/{n}: ours create+exec {ms(t_exec)} "
                      f"(create {ms(t_create)}); raw restore {ms(t4 - t3)}, "
                      f"+exec {ms(t5 - t3)}")
    assert image is not None
    return {"n": n, "image_bytes": du(image)[0], "ours_s": ours, "ours_create_s": ours_create,
            "floor_restore_s": f_restore, "floor_restore_exec_s": f_exec}


def measure(ctx: Context) -> dict[str, Any]:
    return bench(ctx.daemon(FROM_SNAPSHOT), ctx.raw, ctx.pick(10, 3, 1))


def report(sc: dict[str, Any]) -> list[Row]:
    timing_table(
        f"5. create from the template snapshot → first exec result (N={sc['n']}, after 1 "
        f"warmup; CPUOS_POOL_SIZE=0; image {mib(sc['image_bytes'])})",
        [("ours: Sandbox.create + exec('true')", sc["ours_s"]),
         ("  of which Sandbox.create", sc["ours_create_s"]),
         ("floor: runsc restore --detach (same image)", sc["floor_restore_s"]),
         ("floor: runsc restore --detach + runsc exec true", sc["floor_restore_exec_s"])])
    o, floor_s = median(sc["ours_s"]), median(sc["floor_restore_s"])
    row = target_row("create from snapshot → first exec, p50", o, floor_s, 1.2 * floor_s,
                     f"≤ 1.2× floor ({ms(1.2 * floor_s)})")
    row["note"] = (f"{o / floor_s:.2f}× runsc restore; "
                   f"{o / median(sc['floor_restore_exec_s']):.2f}× restore + exec")
    return [row]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
