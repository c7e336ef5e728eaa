"""Benchmark 3: stdout streaming to the SDK (``head -c <size> /dev/zero``) vs ``runsc exec``
of the same command piped to this process; ``dd bs=1M`` rows (info) show the transport
with a producer that writes 1 MiB per syscall.

    .venv/bin/python bench/cases/stream.py [--quick | --smoke]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox
from support.daemon import Daemon

from cases._common import (COLD_BOOT, MB, PROCS, Context, Row, MiB, case_main, console, mbps,
                           median, now, runsc_exec, throughput_table)

SECTION = KEY = "stream"
TITLE = "3. stdout streaming"
DAEMON = COLD_BOOT
TARGET = 200  # MB/s


def _ours(sbx: Sandbox, cmd: str, nbytes: int) -> float:
    t0 = now()
    r = sbx.exec(cmd, max_output=1 << 20, timeout="10m")
    dt = now() - t0
    if r.exit_code != 0 or r.stdout_total != nbytes:
        raise RuntimeError(f"{cmd!r} streamed {r.stdout_total} bytes, exit {r.exit_code}")
    return nbytes / dt / MB


def _floor(d: Daemon, sbx: Sandbox, argv: list[str], nbytes: int) -> float:
    with tempfile.TemporaryFile() as errf:
        t0 = now()
        p = PROCS.popen(runsc_exec(d, sbx.id, *argv), stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=errf, bufsize=0)
        assert p.stdout is not None
        got = 0
        fd = p.stdout.fileno()
        while b := os.read(fd, 1 << 20):
            got += len(b)
        rc = p.wait()
        dt = now() - t0
        PROCS.done(p)
        p.stdout.close()
        if rc != 0 or got != nbytes:
            errf.seek(0)
            raise RuntimeError(f"runsc exec {argv}: rc={rc} got={got}: "
                               f"{errf.read()[-500:].decode(errors='replace')}")
    return nbytes / dt / MB


def measure(ctx: Context) -> dict[str, Any]:
    """``head -c`` is the benchmark. ``dd bs=1M`` (info only) shows the same pipeline with
    a producer that writes 1 MiB per syscall instead of head's small buffer."""
    d, sbx = ctx.daemon(COLD_BOOT), ctx.sandbox()
    mibs, runs = ctx.pick(512, 128, 8), ctx.pick(3, 3, 1)
    nbytes = mibs * MiB
    res: dict[str, list[float]] = {"ours": [], "floor": [], "ours_dd": [], "floor_dd": []}
    head = ["head", "-c", f"{mibs}M", "/dev/zero"]
    dd = ["dd", "if=/dev/zero", "bs=1M", f"count={mibs}", "status=none"]
    for i in range(runs):
        res["ours"].append(_ours(sbx, " ".join(head), nbytes))
        res["floor"].append(_floor(d, sbx, head, nbytes))
        res["ours_dd"].append(_ours(sbx, " ".join(dd), nbytes))
        res["floor_dd"].append(_floor(d, sbx, dd, nbytes))
        console.print(f"  stream {i + 1}/{runs}: head: ours {mbps(res['ours'][-1])}, runsc "
                      f"exec pipe {mbps(res['floor'][-1])}; dd bs=1M: ours "
                      f"{mbps(res['ours_dd'][-1])}, runsc exec pipe {mbps(res['floor_dd'][-1])}")
    return {"bytes": nbytes, "runs": runs, **{f"{k}_MBps": v for k, v in res.items()}}


def report(s: dict[str, Any]) -> list[Row]:
    throughput_table(
        f"3. stdout streaming to the SDK ({s['bytes'] // MiB} MiB of zeros, "
        f"{s['runs']} runs; MB = 10^6 B)", s,
        (("ours: sbx.exec('head -c …', max_output=1 MiB)", "ours_MBps"),
         ("floor: runsc exec head -c … | host pipe", "floor_MBps"),
         ("(info) ours: sbx.exec('dd … bs=1M')", "ours_dd_MBps"),
         ("(info) floor: runsc exec dd … bs=1M | host pipe", "floor_dd_MBps")))
    rows = []
    for what, k in (("head -c", ""), ("dd bs=1M", "_dd")):
        o = median(s[f"ours{k}_MBps"])
        rows.append({"metric": f"stdout streaming ({what}), median", "ours": mbps(o),
                     "floor": mbps(median(s[f"floor{k}_MBps"])),
                     "target": f"≥ {TARGET} MB/s", "met": "yes" if o >= TARGET else "no"})
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
