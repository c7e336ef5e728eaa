"""Benchmark 4: ``files.upload`` / ``files.download`` of random data vs ``runsc exec``
``cat`` with the file on stdin / stdout to a host file. Every download is checked (size and
SHA-256, untimed).

    .venv/bin/python bench/cases/files.py [--quick | --smoke]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (COLD_BOOT, MB, PROCS, Context, Row, MiB, case_main, console, mbps,
                           median, now, runsc_exec, sha256, throughput_table)

SECTION = KEY = "files"
TITLE = "4. file upload/download"
DAEMON = COLD_BOOT
TARGET = 150  # MB/s, each way


def measure(ctx: Context) -> dict[str, Any]:
    d, sbx = ctx.daemon(COLD_BOOT), ctx.sandbox()
    runs, size = ctx.pick(3, 3, 1), ctx.pick(100, 100, 4) * MiB
    src = ctx.tmp / "src.bin"
    with open(src, "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    want = sha256(src)
    dst = ctx.tmp / "dst.bin"
    res: dict[str, list[float]] = {"ours_up": [], "ours_down": [], "floor_up": [],
                                   "floor_down": []}

    def check(path: Path, what: str) -> None:
        if path.stat().st_size != size or sha256(path) != want:
            raise RuntimeError(f"{what}: downloaded file differs from the uploaded one")

    def timed(fn: Callable[[], None]) -> float:
        t0 = now()
        fn()
        return size / (now() - t0) / MB

    def ours_up() -> None:
        sbx.files.upload(src, "/work/bench_up.bin")

    def ours_down() -> None:  # what was uploaded
        sbx.files.download("/work/bench_up.bin", dst)

    # the floor: runsc exec cat, file on stdin / stdout to a host file
    def floor_up() -> None:
        with open(src, "rb") as f:
            rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "sh", "-c",
                                              "cat > /work/bench_floor.bin"),
                                   stdin=f, timeout=600)
        if rc != 0:
            raise RuntimeError(f"runsc exec cat >: {err.decode(errors='replace')[-500:]}")

    def floor_down() -> None:
        with open(dst, "wb") as f:
            rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "cat", "/work/bench_floor.bin"),
                                   stdout=f, timeout=600)
        if rc != 0:
            raise RuntimeError(f"runsc exec cat: {err.decode(errors='replace')[-500:]}")

    for i in range(runs):
        res["ours_up"].append(timed(ours_up))
        dst.unlink(missing_ok=True)
        res["ours_down"].append(timed(ours_down))
        check(dst, "files.download")
        res["floor_up"].append(timed(floor_up))
        dst.unlink(missing_ok=True)
        res["floor_down"].append(timed(floor_down))
        check(dst, "runsc exec cat")
        console.print(f"  files {i + 1}/{runs}: up ours {mbps(res['ours_up'][-1])} / floor "
                      f"{mbps(res['floor_up'][-1])}; down ours {mbps(res['ours_down'][-1])} / "
                      f"floor {mbps(res['floor_down'][-1])}")
    sbx.exec("rm -f /work/bench_up.bin /work/bench_floor.bin")
    src.unlink(missing_ok=True)
    dst.unlink(missing_ok=True)
    return {"bytes": size, "runs": runs, **{f"{k}_MBps": v for k, v in res.items()}}


def report(f: dict[str, Any]) -> list[Row]:
    throughput_table(
        f"4. files, {f['bytes'] // MiB} MiB random data ({f['runs']} runs; MB = 10^6 B)", f,
        (("ours: files.upload", "ours_up_MBps"),
         ("floor: runsc exec sh -c 'cat > f' < file", "floor_up_MBps"),
         ("ours: files.download", "ours_down_MBps"),
         ("floor: runsc exec cat f > file", "floor_down_MBps")))
    rows = []
    for way, k in (("upload", "up"), ("download", "down")):
        o = median(f[f"ours_{k}_MBps"])
        rows.append({"metric": f"file {way}, median", "ours": mbps(o),
                     "floor": mbps(median(f[f"floor_{k}_MBps"])),
                     "target": f"≥ {TARGET} MB/s", "met": "yes" if o >= TARGET else "no"})
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
