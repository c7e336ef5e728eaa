"""Benchmark 12: what the audit trail costs. Two daemons side by side, one with the full
audit trail (API rows and gVisor's runtime monitoring: every execve and open for writing
inside sent to the daemon), one with ``CPUOS_AUDIT=0`` (the floor), a sandbox on each,
sampled alternately:

- the exec round trip of ``/bin/true`` through the API, audit on versus off (target: at most
  10% added);
- the fork/exec workload inside (100 ``subprocess.run(["/bin/true"])`` timed by a resident
  Python process), runtime monitoring on versus off (target: at most 15% added), and
  whether every one of those execs reached the audit log;
- the rows per second the audit store sustains (HMAC chain, batched SQLite writes),
  beside the same rows written by plain batched ``executemany`` without the chain.

    .venv/bin/python bench/cases/audit.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cases._common import (FROM_SNAPSHOT, Context, Row, case_main, console, info_row, kill_quietly,
                           median, ms, now, pct, table, target_row)

from cpuos import Sandbox
from cpuosd.accounting.audit import BATCH, AuditLog

SECTION = KEY = "audit"
TITLE = "12. audit trail: cost of recording"
DAEMON = FROM_SNAPSHOT  # audit on (the default); the floor's daemon is started beside it
OFF = {**FROM_SNAPSHOT, "CPUOS_AUDIT": "0"}

FORK100 = """\
import json, subprocess, sys, time
n = int(sys.argv[1])
t0 = time.perf_counter()
for _ in range(n):
    subprocess.run(["/bin/true"], check=True)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""
DETAIL = {"source": "runtime", "argv": ["/usr/bin/python3", "-c", "print(1)"],
          "binary": "/usr/bin/python3.11", "cwd": "/work", "env": ["HOME", "PATH", "USER"],
          "pid": 42, "ppid": 7, "uid": 1000, "euid": 1000, "process": "python3"}


def fork100(sbx: Sandbox, n: int) -> float:
    r = sbx.exec(["python3", "/work/fork100.py", str(n)], timeout="5m")
    if r.exit_code != 0:
        raise RuntimeError(f"fork100 failed: {r.stderr[-500:]}")
    return float(json.loads(r.stdout)["seconds"])


def store_rate(tmp: Path, n: int) -> dict[str, Any]:
    """Rows per second through AuditLog (queue, HMAC chain, batched transactions), and the
    same number of rows by plain executemany in transactions of the same size."""
    d = tmp / "store"
    d.mkdir(parents=True, exist_ok=True)
    log = AuditLog(d / "audit.db", d / "audit.key", d / "audit.head")
    try:
        t0 = now()
        for i in range(n):
            log.record(f"sbx-{i % 8}", "command", DETAIL, workspace="ws-bench")
        log.flush(600)
        ours = now() - t0
        check = log.verify()
        rows = log.query(kinds=("command",), limit=1 << 30)
        dropped = sum(r["detail"]["count"] for r in log.query(kinds=("dropped",), limit=1000))
    finally:
        log.close()
    if len(rows) != n or dropped:  # a rate with rows left out would mean nothing
        raise RuntimeError(f"audit store kept {len(rows)} of {n} rows ({dropped} dropped)")
    db = sqlite3.connect(d / "plain.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE t (seq INTEGER PRIMARY KEY, time REAL, workspace TEXT, "
               "sandbox TEXT, kind TEXT, detail TEXT)")
    t0 = now()
    for start in range(0, n, BATCH):
        rows = [(float(i), "ws-bench", f"sbx-{i % 8}", "command", json.dumps(DETAIL))
                for i in range(start, min(n, start + BATCH))]
        db.execute("BEGIN")
        db.executemany("INSERT INTO t (time, workspace, sandbox, kind, detail) "
                       "VALUES (?,?,?,?,?)", rows)
        db.execute("COMMIT")
    floor = now() - t0
    db.close()
    return {"rows": n, "ours_s": ours, "floor_s": floor, "ours_rows_per_s": n / ours,
            "floor_rows_per_s": n / floor, "verified": check["ok"]}


def measure(ctx: Context) -> dict[str, Any]:
    on = ctx.daemon(DAEMON)
    off = ctx.extra_daemon(OFF)
    n, warm, runs = ctx.pick(300, 60, 3), ctx.pick(20, 10, 1), ctx.pick(10, 5, 2)
    per_run = ctx.pick(100, 100, 10)
    out: dict[str, Any] = {"n": n, "warmup": warm, "runs": runs, "execs_per_run": per_run}
    # sandboxes of the case's own (the daemon's shared one has other cases' history)
    s_on = Sandbox.create(template="python", timeout="60m", **on.sdk_kwargs())
    s_off = Sandbox.create(template="python", timeout="60m", **off.sdk_kwargs())
    try:
        health = []
        for d in (on, off):
            with d.client() as c:
                health.append(c.get("/health").json())
        out["audit_runtime"] = [h.get("audit") for h in health]  # on: monitored; off: None
        for _ in range(warm):
            s_on.exec(["/bin/true"])
            s_off.exec(["/bin/true"])
        lat_on: list[float] = []
        lat_off: list[float] = []
        for i in range(n):  # alternate, starting with each in turn
            for sbx, lat in ((s_on, lat_on), (s_off, lat_off))[::1 if i % 2 else -1]:
                t0 = now()
                r = sbx.exec(["/bin/true"])
                lat.append(now() - t0)
                if r.exit_code != 0:
                    raise RuntimeError(f"exec failed: {r}")
        out["on_exec_s"], out["off_exec_s"] = lat_on, lat_off
        console.print(f"  exec round trip: audit on p50 {ms(median(lat_on))}, "
                      f"off p50 {ms(median(lat_off))}")

        for sbx in (s_on, s_off):
            sbx.files.write("/work/fork100.py", FORK100)
            fork100(sbx, per_run)  # warmup
        f_on: list[float] = []
        f_off: list[float] = []
        # ... and the CPU time the sandbox's cgroup used for each run (the Sentry's work,
        # monitoring included: less swayed by a loaded host than the wall time)
        c_on: list[float] = []
        c_off: list[float] = []
        for i in range(runs):
            for sbx, xs, cs in ((s_on, f_on, c_on), (s_off, f_off, c_off))[
                    ::1 if i % 2 else -1]:
                cpu0 = sbx.metrics().get("cpu_seconds")
                xs.append(fork100(sbx, per_run))
                cpu1 = sbx.metrics().get("cpu_seconds")
                if cpu0 is not None and cpu1 is not None:
                    cs.append(cpu1 - cpu0)
        out["on_fork100_s"], out["off_fork100_s"] = f_on, f_off
        out["on_fork100_cpu_s"], out["off_fork100_cpu_s"] = c_on, c_off
        console.print(f"  {per_run} execs of /bin/true inside: monitored "
                      f"{ms(median(f_on))}, not {ms(median(f_off))}"
                      + (f"; sandbox CPU {ms(median(c_on))} vs {ms(median(c_off))}"
                         if c_on and c_off else ""))
        # did every exec of /bin/true reach the log (and was anything dropped)? Repeats are
        # coalesced (a row with ``count``): counted as the execs they stand for, once their
        # window has ended
        expected = (runs + 1) * per_run + n + warm  # fork100 runs and API execs of /bin/true

        def tally() -> tuple[int, int]:
            recorded = dropped = after_seq = 0
            with on.client() as c:
                while True:
                    page = c.get(f"/sandboxes/{s_on.id}/audit",
                                 params={"after": after_seq, "limit": 10000}).json()
                    for row in page["rows"]:
                        d = row["detail"]
                        if row["kind"] == "command" and d.get("argv") == ["/bin/true"] \
                                and d.get("source") == "runtime":
                            recorded += int(d.get("count") or 1)
                        elif row["kind"] == "dropped":
                            dropped += int(d.get("count") or 0)
                    if not page["rows"]:
                        break
                    after_seq = page["next_after"]
            return recorded, dropped

        deadline = now() + 30
        recorded, dropped = tally()
        while recorded + dropped < expected and now() < deadline:
            time.sleep(0.5)
            recorded, dropped = tally()
        out["runtime_rows"] = {"expected": expected, "recorded": recorded, "dropped": dropped}
        console.print(f"  runtime monitoring recorded {recorded} of {expected} execs of "
                      f"/bin/true ({dropped} dropped)")
    finally:
        kill_quietly(s_on)
        kill_quietly(s_off)
        ctx.drop_daemon(off)

    out["store"] = store_rate(ctx.tmp, ctx.pick(100_000, 30_000, 2_000))
    st = out["store"]
    console.print(f"  audit store: {st['ours_rows_per_s']:.0f} rows/s "
                  f"(plain executemany {st['floor_rows_per_s']:.0f} rows/s)")
    return out


def report(e: dict[str, Any]) -> list[Row]:
    t = table(f"12. audit trail: cost of recording (exec N={e['n']}; {e['runs']} runs of "
              f"{e['execs_per_run']} execs inside)", ["", "p50", "p99", "min"])
    for label, k in (("exec ['/bin/true'], audit on", "on_exec_s"),
                     ("exec ['/bin/true'], audit off (floor)", "off_exec_s"),
                     (f"{e['execs_per_run']} execs inside, monitored", "on_fork100_s"),
                     (f"{e['execs_per_run']} execs inside, not monitored (floor)",
                      "off_fork100_s")):
        xs = e[k]
        t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 99)), ms(min(xs)))
    console.print(t)
    st, rr = e["store"], e["runtime_rows"]
    console.print(f"  audit store: {st['rows']} rows in {st['ours_s']:.2f}s = "
                  f"{st['ours_rows_per_s']:.0f} rows/s (chain verified: {st['verified']}); "
                  f"plain executemany: {st['floor_rows_per_s']:.0f} rows/s")
    console.print(f"  runtime monitoring: {rr['recorded']} of {rr['expected']} execs of "
                  f"/bin/true recorded, {rr['dropped']} dropped")
    on, off = median(e["on_exec_s"]), median(e["off_exec_s"])
    f_on, f_off = median(e["on_fork100_s"]), median(e["off_fork100_s"])
    exec_row = target_row("exec round trip, audit on vs off, p50", on, off, off * 1.10,
                          "<= +10%")
    # each on sample beside the off sample taken next to it (the load the two saw is alike)
    paired = median([a / b for a, b in zip(e["on_exec_s"], e["off_exec_s"], strict=True)])
    fpaired = median([a / b for a, b in zip(e["on_fork100_s"], e["off_fork100_s"],
                                             strict=True)])
    exec_row["note"] = (f"{(on / off - 1) * 100:+.1f}% (median of paired ratios "
                        f"{(paired - 1) * 100:+.1f}%)")
    fork_row = target_row(f"{e['execs_per_run']} execs inside, monitored vs not, median",
                          f_on, f_off, f_off * 1.15, "<= +15%")
    fork_row["note"] = (f"{(f_on / f_off - 1) * 100:+.1f}% (median of paired ratios "
                        f"{(fpaired - 1) * 100:+.1f}%); {rr['recorded']} of "
                        f"{rr['expected']} execs recorded")
    if e.get("on_fork100_cpu_s") and e.get("off_fork100_cpu_s"):
        c_on, c_off = median(e["on_fork100_cpu_s"]), median(e["off_fork100_cpu_s"])
        fork_row["note"] += (f"; the sandbox's CPU time per run {ms(c_on)} vs {ms(c_off)} "
                             f"({(c_on / c_off - 1) * 100:+.1f}%)")
    return [exec_row, fork_row,
            info_row("audit store, rows/s", f"{st['ours_rows_per_s']:.0f}/s",
                     f"{st['floor_rows_per_s']:.0f}/s")]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
