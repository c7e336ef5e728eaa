"""Benchmark 6: Sandbox.create (+ first exec) served from a full warm pool (daemon with
CPUOS_POOL_SIZE=2) vs a new HTTP client's ``GET /health`` and one ``runsc exec /bin/true``
into the running sandbox.

    .venv/bin/python bench/cases/pool.py [--quick | --smoke]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

import httpx

from cpuos import Sandbox
from support.daemon import Daemon

from cases._common import (PROCS, Context, Row, case_main, console, info_row, kill_quietly,
                           median, ms, now, runsc_exec, runsc_procs, target_row,
                           timing_table)

SECTION = KEY = "pool"
TITLE = "6. create from the warm pool"
POOL_SIZE = 2
DAEMON = {"CPUOS_POOL_SIZE": str(POOL_SIZE)}


def connected_agents(d: Daemon, ids: Iterable[str]) -> set[str]:
    """Those of ``ids`` (sandboxes of d) whose agent is connected right now. The accepted
    end of an agent connection lives in the network namespace of the connecting gofer, so
    it shows (path, state 03 = connected) in that gofer's /proc/<pid>/net/unix, not in
    ours."""
    want = {str(d.agent_socket(sid)): sid for sid in ids}
    home = str(d.home).encode()
    found: set[str] = set()
    for pid, argv0, cmd in runsc_procs():
        if argv0 != "runsc-gofer" or home not in cmd:
            continue
        try:
            lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) >= 8 and f[5] == "03" and f[7] in want:
                found.add(want[f[7]])
    return found


def wait_pool(d: Daemon, size: int, mine: set[str], timeout: float = 180) -> set[str]:
    """Wait until ``size`` runsc containers besides ``mine`` run with their agent connected
    (the daemon puts a sandbox in the pool once its agent is back); returns their ids."""
    deadline = time.time() + timeout
    while True:
        ready = connected_agents(d, set(d.runsc_containers()) - mine)
        if len(ready) >= size:
            time.sleep(0.1)  # the daemon appends to the pool right after the connect
            return ready
        if time.time() > deadline:
            raise RuntimeError(f"warm pool did not fill: {len(ready)}/{size} ready; see {d.log}")
        time.sleep(0.05)


def measure(ctx: Context) -> dict[str, Any]:
    """Before each sample the pool is full; the create starts a refill (a restore) in the
    daemon, which runs during our exec. The floors are taken after the pool has refilled,
    on a quiet host: a new httpx client's GET /health (the SDK's create makes a new client
    and connection too) and one ``runsc exec /bin/true`` into the running sandbox."""
    d, n, size = ctx.daemon(DAEMON), ctx.pick(10, 3, 1), POOL_SIZE
    kw = d.sdk_kwargs()
    res: dict[str, list[float]] = {"ours_create_s": [], "ours_create_exec_s": [],
                                   "floor_http_s": [], "floor_runsc_exec_s": []}
    misses = 0
    for i in range(n + 1):
        pooled = wait_pool(d, size, set())
        t0 = now()
        sbx = Sandbox.create(template="python", timeout="5m", **kw)
        try:
            t1 = now()
            r = sbx.exec("true")
            t2 = now()
            if r.exit_code != 0:
                raise RuntimeError(f"exec true failed: {r}")
            hit = sbx.id in pooled
            wait_pool(d, size, {sbx.id})  # let the refill finish before the floors
            t3 = now()
            with httpx.Client(timeout=30, verify=False) as c:  # as the SDK's, for http URLs
                c.get(d.url + "/health").raise_for_status()
            t4 = now()
            rc, _, err = PROCS.run(runsc_exec(d, sbx.id, "/bin/true"), timeout=60)
            t5 = now()
            if rc != 0:
                raise RuntimeError(f"runsc exec failed: {err.decode(errors='replace')[-500:]}")
        finally:
            kill_quietly(sbx)
        if i == 0:
            continue  # warmup
        misses += not hit
        res["ours_create_s"].append(t1 - t0)
        res["ours_create_exec_s"].append(t2 - t0)
        res["floor_http_s"].append(t4 - t3)
        res["floor_runsc_exec_s"].append(t5 - t4)
        console.print(f"  pool create {i}/{n}: create {ms(t1 - t0)}, +exec {ms(t2 - t0)}"
                      f"{'' if hit else ' [yellow](not from the pool!)[/]'}; floor http "
                      f"{ms(t4 - t3)}, runsc exec {ms(t5 - t4)}")
    return {"n": n, "pool_size": size, "pool_misses": misses, **res}


def report(pl: dict[str, Any]) -> list[Row]:
    timing_table(
        f"6. create from the warm pool (CPUOS_POOL_SIZE={pl['pool_size']}, full before "
        f"each sample; N={pl['n']}, after 1 warmup; {pl['pool_misses']} not from the pool)",
        [("ours: Sandbox.create", pl["ours_create_s"]),
         ("ours: Sandbox.create + exec('true')", pl["ours_create_exec_s"]),
         ("floor: GET /health on a fresh connection", pl["floor_http_s"]),
         ("floor: runsc exec true into the running sandbox", pl["floor_runsc_exec_s"])])
    return [target_row("create from warm pool, p50", median(pl["ours_create_s"]),
                       median(pl["floor_http_s"]), 0.010, "≤ 10 ms"),
            info_row("create from warm pool + first exec, p50",
                     ms(median(pl["ours_create_exec_s"])),
                     ms(median(pl["floor_runsc_exec_s"])))]


if __name__ == "__main__":
    sys.exit(case_main(__name__))
