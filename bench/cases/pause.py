"""Benchmark 7: pause / resume (+ first exec) of a sandbox holding a 100 MiB heap vs
``runsc checkpoint`` / ``restore`` of a raw container whose PID 1 is the same heap holder
(same rootfs and flags, no agent).

    .venv/bin/python bench/cases/pause.py [--quick | --smoke]
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox
from cpuosd.testing import Daemon

from cases._common import (FROM_SNAPSHOT, HEAP_HOLDER, Context, Row, case_main, console, du,
                           kill_quietly, median, ms, now, pause_resume_exec, start_heap_holder,
                           target_row, timing_table)

SECTION = KEY = "pause"
TITLE = "7. pause / resume with a 100 MiB heap"
DAEMON = FROM_SNAPSHOT

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


def check_heap_holder(sbx: Sandbox) -> None:
    r = sbx.exec("pgrep -f holder.py >/dev/null")
    if r.exit_code != 0:
        raise RuntimeError("the heap holder is gone after resume")


def measure(ctx: Context) -> dict[str, Any]:
    """One untimed warmup cycle of each, then ours and the floor alternate."""
    d, raw, n = ctx.daemon(FROM_SNAPSHOT), ctx.raw, ctx.pick(5, 2, 1)
    kw = d.sdk_kwargs()
    res: dict[str, list[float]] = {k: [] for k in (
        "ours_pause_s", "ours_resume_s", "ours_resume_exec_s", "floor_checkpoint_s",
        "floor_checkpoint_delete_s", "floor_restore_s", "floor_restore_exec_s")}
    sizes: list[int] = []
    floor_sizes: list[int] = []
    sbx = Sandbox.create(template="python", timeout="30m", **kw)
    cid = raw.new_id("heap")
    sdir: Path | None = None
    image: Path | None = None
    try:
        raw.match(d, sbx.id)
        sdir = raw.bundle(cid, ["/usr/bin/python3", "-c", HEAP_HOLDER, "/work/holder.ready"])
        start_heap_holder(sbx)
        raw.run_detached(cid, sdir)
        raw.wait_log(sdir, b"ready")
        for i in range(n + 1):
            paused = sbx
            sbx, (pause_s, resume_s, resume_exec_s) = pause_resume_exec(
                paused, kw, lambda _, p=paused: sizes.append(p.info().snapshot_bytes or 0))
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
            for k, v in (("ours_pause_s", pause_s), ("ours_resume_s", resume_s),
                         ("ours_resume_exec_s", resume_exec_s), ("floor_checkpoint_s", f1 - f0),
                         ("floor_checkpoint_delete_s", f2 - f0), ("floor_restore_s", f3 - f2),
                         ("floor_restore_exec_s", f4 - f2)):
                res[k].append(v)
            console.print(f"  pause/resume {i}/{n}: ours pause {ms(pause_s)}, resume "
                          f"{ms(resume_s)}, +exec {ms(resume_exec_s)}; raw checkpoint "
                          f"{ms(f1 - f0)}"
                          f" (+delete {ms(f2 - f0)}), restore {ms(f3 - f2)}, "
                          f"+exec {ms(f4 - f2)}")
    finally:
        kill_quietly(sbx)
        raw.delete(cid)
        if sdir is not None:
            shutil.rmtree(sdir, ignore_errors=True)
        if image is not None:
            shutil.rmtree(image, ignore_errors=True)
    parts = pause_breakdown(d, sbx.id)[1:]  # without the warmup
    if len(parts) == n:
        for i, k in enumerate(("quiesce", "checkpoint", "teardown")):
            res[f"ours_pause_{k}_s"] = [x[i] for x in parts]
    return {"n": n, "ours_snapshot_bytes": sizes, "floor_image_bytes": floor_sizes, **res}


def report(pr: dict[str, Any]) -> list[Row]:
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
    return [target_row("pause, 100 MiB heap, p50", median(pr["ours_pause_s"]),
                       median(pr["floor_checkpoint_s"]), 0.400, "≤ 400 ms"),
            target_row("resume, 100 MiB heap, p50", median(pr["ours_resume_s"]),
                       median(pr["floor_restore_s"]), 0.300, "≤ 300 ms"),
            target_row("resume + first exec, 100 MiB heap, p50",
                       median(pr["ours_resume_exec_s"]), median(pr["floor_restore_exec_s"]),
                       0.300, "≤ 300 ms")]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
