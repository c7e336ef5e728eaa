"""Benchmark 8: disk size of one paused sandbox, idle and with a 100 MiB heap: the daemon's
``snapshot_bytes`` and ``du`` of its snapshot directory, beside ``du`` of a raw checkpoint of
a container whose PID 1 is a Python process (idle / the same heap holder).

    .venv/bin/python bench/cases/size.py [--quick | --smoke]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox

from cases._common import (FROM_SNAPSHOT, HEAP_HOLDER, Context, Row, case_main, console, du,
                           info_row, kill_quietly, mib, start_heap_holder, table)

SECTION = KEY = "size"
TITLE = "8. snapshot size on disk"
DAEMON = FROM_SNAPSHOT

IDLE_HOLDER = """\
import sys, time
open(sys.argv[1], "w").close()
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def measure(ctx: Context) -> dict[str, Any]:
    d, raw = ctx.daemon(FROM_SNAPSHOT), ctx.raw  # one sample each: no N
    kw = d.sdk_kwargs()
    out: dict[str, Any] = {}
    for name, holder in (("idle", IDLE_HOLDER), ("heap", HEAP_HOLDER)):
        sbx = Sandbox.create(template="python", timeout="10m", **kw)
        try:
            raw.match(d, sbx.id)
            if name == "heap":
                start_heap_holder(sbx)
            sid = sbx.pause()
            info = sbx.info()
            if info.state != "paused":
                raise RuntimeError(f"sandbox {sid} is {info.state} after pause")
            apparent, allocated = du(d.snapshots_dir / sid)
        finally:
            kill_quietly(sbx)
        cid = raw.new_id(f"size-{name}")
        sdir = raw.bundle(cid, ["/usr/bin/python3", "-c", holder, "/work/holder.ready"])
        image = raw.tmp / f"{cid}-image"
        try:
            raw.run_detached(cid, sdir)
            raw.wait_log(sdir, b"ready")
            raw.checkpoint(cid, sdir, image)
            f_apparent, f_allocated = du(image)
        finally:
            raw.delete(cid)
            shutil.rmtree(sdir, ignore_errors=True)
            shutil.rmtree(image, ignore_errors=True)
        out[name] = {"snapshot_bytes": info.snapshot_bytes, "du_apparent": apparent,
                     "du_allocated": allocated, "floor_du_apparent": f_apparent,
                     "floor_du_allocated": f_allocated}
        console.print(f"  size {name}: snapshot_bytes {mib(info.snapshot_bytes or 0)}, du "
                      f"{mib(apparent)} (allocated {mib(allocated)}); raw image "
                      f"{mib(f_apparent)}")
    return out


def report(sz: dict[str, Any]) -> list[Row]:
    t = table("8. snapshot size on disk, one paused sandbox (MiB = 2^20 B)",
              ["", "snapshot_bytes", "du -sb", "du (allocated)"])
    rows = []
    for name, label in (("idle", "idle sandbox"), ("heap", "100 MiB heap")):
        x = sz[name]
        t.add_row(f"ours: {label}", mib(x["snapshot_bytes"] or 0), mib(x["du_apparent"]),
                  mib(x["du_allocated"]))
        t.add_row(f"floor: runsc checkpoint, python PID 1 ({name})", "—",
                  mib(x["floor_du_apparent"]), mib(x["floor_du_allocated"]))
        rows.append(info_row(f"snapshot size on disk, {label}", mib(x["du_allocated"]),
                             mib(x["floor_du_allocated"])))
    console.print(t)
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
