"""cpuos benchmarks: our figure next to the raw-backend (runsc) floor measured in the same run.

    sudo .venv/bin/python bench/run.py [--quick | --smoke] [--only snapshots|basic|SECTION,...]
                                       [--microvm-tcg]

Runs the cases of bench/cases/ (one module per benchmark; each also runs by itself) on its
own cpuosds, one after the other (cpuosd.testing.new_daemon: own CPUOS_HOME, shared
template cache; cold, template-snapshot and warm-pool configurations), always tears them
down, and deletes every runsc container it made itself (a separate ``--root`` for the raw
runs), even on Ctrl-C or an exception. Prints one table per benchmark plus a summary, and
writes every sample to .cache/bench/results*.json. See bench/README.md for what each figure
means.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cases import (audit, browser, create, density, e2b_sdk, exec_roundtrip, files, inside,
                   interactive, limits, microvm, network, pause, pool, ports, run_code, size,
                   snap_create, stream)
from cases._common import OUT, Case, execute

from cpuosd.testing import e2e_unavailable

CASES: dict[str, Case] = {c.SECTION: c for c in (  # the report's order (their numbers)
    create, exec_roundtrip, stream, files, snap_create, pool, pause, size, microvm, network,
    ports, audit, browser, limits, run_code, interactive, density, e2b_sdk, inside)}
# the order they run in: grouped by the daemon configuration they need
RUN_ORDER = ["create", "exec", "stream", "files", "interactive", "snap-create", "pause", "size",
             "run-code", "e2b", "ports", "audit", "inside", "browser", "limits", "pool", "density",
             "microvm", "network"]
GROUPS = {"basic": ["create", "exec", "stream", "files"],
          "snapshots": ["snap-create", "pool", "pause", "size"]}


def parse_only(value: str | None) -> list[str]:
    if not value:
        return list(CASES)
    want: set[str] = set()
    for name in (x.strip() for x in value.split(",") if x.strip()):
        if name in GROUPS:
            want.update(GROUPS[name])
        elif name in CASES:
            want.add(name)
        else:
            raise SystemExit(f"--only: unknown section {name!r}; choose from "
                             f"{', '.join([*GROUPS, *CASES])}")
    return [x for x in CASES if x in want]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    size_ = ap.add_mutually_exclusive_group()
    size_.add_argument("--quick", action="store_true",
                       help="fewer iterations, smaller transfers")
    size_.add_argument("--smoke", action="store_true",
                       help="tiny N: proves every case runs (the test suite runs it); its "
                            "figures mean nothing (written to results-smoke.json)")
    ap.add_argument("--microvm-tcg", action="store_true", help=microvm.TCG_HELP)
    ap.add_argument("--only", metavar="SECTIONS",
                    help="comma-separated sections or groups: "
                         + ", ".join([*GROUPS, *CASES]) + " (default: all)")
    args = ap.parse_args()
    only = parse_only(args.only)
    why = e2e_unavailable()
    if why:
        print(f"cannot run the benchmarks: {why}", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"

    def out(R: dict[str, Any]) -> Path:
        # an incomplete, partial (--only) or smoke run does not overwrite the last full
        # results
        if not R["meta"]["complete"]:
            return OUT / "results-partial.json"
        if mode == "smoke":
            return OUT / "results-smoke.json"
        if only != list(CASES):
            return OUT / ("results-only-" + "+".join(only) + ".json")
        return OUT / "results.json"

    return execute([CASES[x] for x in RUN_ORDER if x in only], [CASES[x] for x in only],
                   mode, args, out)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr)
        sys.exit(130)
