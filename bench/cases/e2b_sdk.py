"""Benchmark 18: the E2B-compatible surface, driven by E2B's own Python SDK (``e2b``, as a
user would: E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY), beside cpuos's SDK in the same
run on the same daemon and sandbox:

* ``commands.run("true")`` round trip (E2B runs it as ``/bin/bash -l -c true``) beside the
  cpuos SDK's ``exec(["/bin/bash", "-l", "-c", "true"])`` — the same work inside, so the
  difference is the surface's overhead (target p50 ≤ 3 ms) — and ``exec("true")``;
* ``Sandbox.create()`` → first ``commands.run("true")`` beside the cpuos SDK's create →
  first ``exec(["/bin/bash", "-l", "-c", "true"])`` (template snapshot, CPUOS_POOL_SIZE=0;
  alternating; creates vary by hundreds of ms on a loaded host: read p50 of many).

    .venv/bin/python bench/cases/e2b_sdk.py [--quick | --smoke]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox

from cases._common import (FROM_SNAPSHOT, Context, Row, case_main, console, kill_quietly,
                           median, ms, now, target_row, timing_table)

SECTION = KEY = "e2b"
TITLE = "18. E2B SDK on cpuos"
DAEMON = FROM_SNAPSHOT
LOGIN_TRUE = ["/bin/bash", "-l", "-c", "true"]  # what E2B's commands.run("true") runs


def _daemon_cpu(d: Any) -> float:
    """CPU seconds (user + system) of the daemon's process so far."""
    f = Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _e2b_env(d: Any) -> None:
    os.environ.update(E2B_API_URL=d.url + "/e2b", E2B_SANDBOX_URL=d.url + "/e2b",
                      E2B_API_KEY=d.key)




def _create_then(d: Any, sdk: str) -> tuple[float, float]:
    """(create, create → first command result) of one new sandbox, by either SDK."""
    if sdk == "e2b":
        import e2b

        t0 = now()
        s = e2b.Sandbox.create(timeout=300)
        try:
            t1 = now()
            if s.commands.run("true").exit_code != 0:
                raise RuntimeError("e2b commands.run('true') failed")
            t2 = now()
        finally:
            s.kill()
        return t1 - t0, t2 - t0
    t0 = now()
    c = Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs())
    try:
        t1 = now()
        if c.exec(LOGIN_TRUE).exit_code != 0:
            raise RuntimeError("exec(bash -l -c true) failed")
        t2 = now()
    finally:
        kill_quietly(c)
    return t1 - t0, t2 - t0


def measure(ctx: Context) -> dict[str, Any]:
    import e2b

    d = ctx.daemon(FROM_SNAPSHOT)
    _e2b_env(d)
    n, warm, nc = ctx.pick(300, 50, 3), ctx.pick(20, 10, 1), ctx.pick(40, 10, 1)
    out: dict[str, Any] = {"n": n, "warmup": warm, "n_create": nc}
    _create_then(d, "cpuos")  # untimed: makes the template snapshot
    res: dict[str, list[float]] = {k: [] for k in (
        "ours_create_s", "ours_create_run_s", "floor_create_s", "floor_create_exec_s")}
    for i in range(nc):  # alternating, so that load changes hit both alike
        c, t = _create_then(d, "e2b")
        res["ours_create_s"].append(c)
        res["ours_create_run_s"].append(t)
        c2, t2 = _create_then(d, "cpuos")
        res["floor_create_s"].append(c2)
        res["floor_create_exec_s"].append(t2)
        console.print(f"  create {i + 1}/{nc}: e2b → first run {ms(t)} (create {ms(c)}); "
                      f"cpuos → first exec {ms(t2)} (create {ms(c2)})")
    out.update(res)
    s = e2b.Sandbox.create(timeout=3600)
    try:
        c = Sandbox.connect(s.sandbox_id, **d.sdk_kwargs())  # the same sandbox
        for _ in range(warm):
            s.commands.run("true")
            c.exec(LOGIN_TRUE)
            c.exec("true")
        ours, floor, plain = [], [], []
        for _ in range(n):  # alternating
            t0 = now()
            r = s.commands.run("true")
            t1 = now()
            x = c.exec(LOGIN_TRUE)
            t2 = now()
            y = c.exec("true")
            t3 = now()
            if r.exit_code or x.exit_code or y.exit_code:
                raise RuntimeError("a command failed")
            ours.append(t1 - t0)
            floor.append(t2 - t1)
            plain.append(t3 - t2)
        # CPU per call (the client's, the daemon's) in blocks of each: what the surface costs,
        # whatever the host's load does to wall time
        cpu: dict[str, list[float]] = {"ours_client": [], "ours_daemon": [],
                                       "floor_client": [], "floor_daemon": []}
        block = max(1, n // 3)
        for _ in range(3):
            for name, fn in (("ours", lambda: s.commands.run("true")),
                             ("floor", lambda: c.exec(LOGIN_TRUE))):
                p0, d0 = time.process_time(), _daemon_cpu(d)
                for _ in range(block):
                    fn()
                cpu[f"{name}_client"].append((time.process_time() - p0) / block)
                cpu[f"{name}_daemon"].append((_daemon_cpu(d) - d0) / block)
        out["cpu_per_call_s"] = cpu
        c.close()
    finally:
        s.kill()
    out["ours_run_s"], out["floor_exec_login_s"], out["floor_exec_s"] = ours, floor, plain
    console.print(f"  e2b commands.run('true'): p50 {ms(median(ours))}; cpuos exec(bash -l -c "
                  f"true): p50 {ms(median(floor))}; exec('true'): p50 {ms(median(plain))}")
    return out


def report(e: dict[str, Any]) -> list[Row]:
    timing_table(
        f"18. E2B SDK on cpuos (N={e['n']} round trips after {e['warmup']} warmup, one "
        f"sandbox; N={e['n_create']} creates from the template snapshot, CPUOS_POOL_SIZE=0)",
        [("ours: e2b commands.run('true')  (bash -l -c true)", e["ours_run_s"]),
         ("floor: cpuos exec(['/bin/bash', '-l', '-c', 'true'])", e["floor_exec_login_s"]),
         ("  cpuos exec('true')  (bash -c true)", e["floor_exec_s"]),
         ("ours: e2b Sandbox.create → first commands.run", e["ours_create_run_s"]),
         ("  of which Sandbox.create", e["ours_create_s"]),
         ("floor: cpuos Sandbox.create → first exec (bash -l -c true)",
          e["floor_create_exec_s"]),
         ("  of which Sandbox.create", e["floor_create_s"])])
    ours, floor = median(e["ours_run_s"]), median(e["floor_exec_login_s"])
    # the overhead as the median of the paired differences (sample i of each was taken
    # back to back): steadier than the difference of two medians on a loaded host
    paired = median([a - b for a, b in zip(e["ours_run_s"], e["floor_exec_login_s"],
                                           strict=True)])
    r1 = target_row("e2b commands.run('true') round trip, p50", floor + paired, floor,
                    floor + 0.003, f"≤ floor + 3 ms ({ms(floor + 0.003)})")
    r1["note"] = (f"overhead {ms(paired)} (median of paired differences; p50s: ours "
                  f"{ms(ours)}, floor {ms(floor)})")
    cpu = e.get("cpu_per_call_s")
    if cpu:
        console.print("  CPU per call (median of 3 blocks): client "
                      f"{ms(median(cpu['ours_client']))} vs {ms(median(cpu['floor_client']))}; "
                      f"daemon {ms(median(cpu['ours_daemon']))} vs "
                      f"{ms(median(cpu['floor_daemon']))} (e2b vs cpuos)")
        r1["note"] += (f"; daemon CPU/call {ms(median(cpu['ours_daemon']))} vs "
                       f"{ms(median(cpu['floor_daemon']))}")
    oc, fc = median(e["ours_create_run_s"]), median(e["floor_create_exec_s"])
    cpaired = median([a - b for a, b in zip(e["ours_create_run_s"], e["floor_create_exec_s"],
                                            strict=True)])
    r2 = target_row("e2b create → first command, p50", fc + cpaired, fc, fc + 0.003,
                    f"≤ floor + 3 ms ({ms(fc + 0.003)})")
    r2["note"] = (f"overhead {ms(cpaired)} (median of paired differences; p50s: ours "
                  f"{ms(oc)}, floor {ms(fc)})")
    return [r1, r2]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
