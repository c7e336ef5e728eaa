"""Benchmark 16: interactive sandboxes. Keystroke echo through a terminal (one byte to a
login bash on ``sbx.pty``, timed until readline's echo of it comes back) beside the exec
round trip floor (``sbx.exec("true")`` in the same run); streamed stdin
(``sbx.exec("cat > /dev/null", stdin=<iterator of 1 MiB chunks>)``) beside ``runsc exec
<id> sh -c 'cat > /dev/null'`` fed from a host pipe; reattach to a background command and
to a terminal (a new handle from ``sbx.commands.connect(pid)`` / ``sbx.pty.connect(pid)``)
until its first output byte arrives.

    .venv/bin/python bench/cases/interactive.py [--quick | --smoke]
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (COLD_BOOT, MB, PROCS, Context, MiB, Row, case_main, console, mbps,
                           median, ms, now, runsc_exec, target_row, throughput_table,
                           timing_table)

SECTION = KEY = "interactive"
TITLE = "16. interactive"
DAEMON = COLD_BOOT
ECHO_OVER_FLOOR = 0.005  # s: keystroke echo p50 at most this over the exec round trip p50
STDIN_TARGET = 200  # MB/s
REATTACH_TARGET = 0.020  # s


class _First(Exception):
    pass


def _echo(ctx: Context, n: int) -> list[float]:
    sbx = ctx.sandbox()
    got = threading.Event()
    seen = bytearray()
    lock = threading.Lock()

    def on_data(b: bytes) -> None:
        with lock:
            seen.extend(b)
        got.set()

    t = sbx.pty.create(cols=80, rows=24, on_data=on_data, cmd=["/bin/bash", "--norc", "-i"])
    try:
        t.send_input("PS1='$ '\n")
        lat = []
        for i in range(n + 3):
            with lock:
                seen.clear()
            got.clear()
            t0 = now()
            t.send_input(b"x")
            while True:  # its echo (readline writes it back)
                if not got.wait(30):
                    raise RuntimeError("no echo from the terminal within 30 s")
                with lock:
                    if b"x" in seen:
                        break
                got.clear()
            dt = now() - t0
            if i >= 3:  # warmup
                lat.append(dt)
            t.send_input(b"\x15")  # ^U: the line is empty again (its redraw is not timed)
        return lat
    finally:
        t.kill()


def _exec_floor(ctx: Context, n: int) -> list[float]:
    sbx = ctx.sandbox()
    for _ in range(3):
        sbx.exec("true")
    lat = []
    for _ in range(n):
        t0 = now()
        sbx.exec("true")
        lat.append(now() - t0)
    return lat


def _stdin(ctx: Context, mibs: int) -> float:
    block = b"\0" * MiB
    t0 = now()
    r = ctx.sandbox().exec("cat > /dev/null", stdin=(block for _ in range(mibs)),
                           timeout="10m")
    dt = now() - t0
    if r.exit_code != 0:
        raise RuntimeError(f"streamed stdin: {r}")
    return mibs * MiB / dt / MB


def _stdin_floor(ctx: Context, mibs: int) -> float:
    d, sbx = ctx.daemon(COLD_BOOT), ctx.sandbox()
    block = b"\0" * MiB
    t0 = now()
    p = PROCS.popen(runsc_exec(d, sbx.id, "sh", "-c", "cat > /dev/null"),
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, bufsize=0)
    assert p.stdin is not None
    for _ in range(mibs):
        p.stdin.write(block)
    p.stdin.close()
    rc = p.wait()
    dt = now() - t0
    PROCS.done(p)
    if rc != 0:
        raise RuntimeError(f"runsc exec cat: rc={rc}")
    return mibs * MiB / dt / MB


def _reattach(ctx: Context, n: int) -> tuple[list[float], list[float]]:
    sbx = ctx.sandbox()
    h = sbx.exec("echo ready; sleep 3600", background=True)
    term = sbx.pty.create(on_data=None, cmd=["/bin/bash", "--norc", "-i"])
    term.send_input("echo ready\n")
    term.disconnect()
    cmd_lat, pty_lat = [], []

    def first(_text: str) -> None:
        raise _First()

    try:
        for i in range(n + 2):
            t0 = now()
            try:
                sbx.commands.connect(h.pid, on_stdout=first).wait()
                raise RuntimeError("the command ended")
            except _First:
                dt = now() - t0
            got = threading.Event()
            t1 = now()
            t = sbx.pty.connect(term.pid, on_data=lambda _b, ev=got: ev.set())
            if not got.wait(30):
                raise RuntimeError("no output from the terminal on attach")
            dt2 = now() - t1
            t.disconnect()
            if i >= 2:
                cmd_lat.append(dt)
                pty_lat.append(dt2)
    finally:
        h.kill()
        sbx.commands.kill(term.pid)
    return cmd_lat, pty_lat


def measure(ctx: Context) -> dict[str, Any]:
    ctx.daemon(COLD_BOOT)
    n = ctx.pick(200, 50, 3)
    runs, mibs = ctx.pick(3, 3, 1), ctx.pick(512, 128, 4)
    out: dict[str, Any] = {"n": n, "runs": runs, "stdin_bytes": mibs * MiB}
    out["ours_echo_s"] = _echo(ctx, n)
    out["floor_exec_s"] = _exec_floor(ctx, n)
    console.print(f"  keystroke echo p50 {ms(median(out['ours_echo_s']))}, exec round trip "
                  f"p50 {ms(median(out['floor_exec_s']))}")
    out["ours_stdin_MBps"], out["floor_stdin_MBps"] = [], []
    for i in range(runs):
        out["ours_stdin_MBps"].append(_stdin(ctx, mibs))
        out["floor_stdin_MBps"].append(_stdin_floor(ctx, mibs))
        console.print(f"  stdin {i + 1}/{runs}: ours {mbps(out['ours_stdin_MBps'][-1])}, "
                      f"runsc exec pipe {mbps(out['floor_stdin_MBps'][-1])}")
    out["ours_reattach_s"], out["ours_pty_reattach_s"] = _reattach(ctx, n)
    console.print(f"  reattach → first byte: command p50 "
                  f"{ms(median(out['ours_reattach_s']))}, terminal p50 "
                  f"{ms(median(out['ours_pty_reattach_s']))}")
    return out


def report(s: dict[str, Any]) -> list[Row]:
    timing_table(f"16. interactive: keystroke echo and reattach (N={s['n']})", (
        ("ours: a byte to a terminal → its echo back", s["ours_echo_s"]),
        ("floor: sbx.exec('true') round trip", s["floor_exec_s"]),
        ("ours: commands.connect(pid) → first output byte", s["ours_reattach_s"]),
        ("ours: pty.connect(pid) → first output byte", s["ours_pty_reattach_s"])))
    throughput_table(f"16. interactive: streamed stdin ({s['stdin_bytes'] // MiB} MiB of "
                     f"zeros, {s['runs']} runs; MB = 10^6 B)", s, (
        ("ours: sbx.exec('cat > /dev/null', stdin=iterator)", "ours_stdin_MBps"),
        ("floor: host pipe | runsc exec cat > /dev/null", "floor_stdin_MBps")))
    echo, floor = median(s["ours_echo_s"]), median(s["floor_exec_s"])
    stdin = median(s["ours_stdin_MBps"])
    rows = [target_row("keystroke echo through a terminal, p50", echo, floor,
                       floor + ECHO_OVER_FLOOR, "≤ exec floor + 5 ms"),
            {"metric": "streamed stdin, median", "ours": mbps(stdin),
             "floor": mbps(median(s["floor_stdin_MBps"])), "target": f"≥ {STDIN_TARGET} MB/s",
             "met": "yes" if stdin >= STDIN_TARGET else "no"}]
    for label, k in (("command", "ours_reattach_s"), ("terminal", "ours_pty_reattach_s")):
        rows.append(target_row(f"reattach to a {label} → first byte, p50", median(s[k]),
                               floor, REATTACH_TARGET, "≤ 20 ms"))
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
