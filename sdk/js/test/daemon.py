"""A real cpuosd for sdk/js's tests (support.daemon.new_daemon): prints one JSON line,
{"url", "key"} (or {"skip": reason} where the end-to-end tests cannot run), then waits
until its stdin closes and tears the daemon down: every sandbox killed, the daemon
stopped, leftovers removed. Leftovers found are printed to stderr and make the exit code 1.
Writing "failed" to stdin before closing it keeps the daemon's log
(.cache/test-artifacts/)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # for `support`

from support.daemon import e2e_unavailable, new_daemon


def _stop(*_: object) -> NoReturn:
    raise SystemExit(1)


def main() -> int:
    why = e2e_unavailable()
    if why:
        print(json.dumps({"skip": why}), flush=True)
        return 0
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    d = new_daemon()
    failed = True
    try:
        d.start()
        print(json.dumps({"url": d.url, "key": d.key}), flush=True)
        failed = "failed" in sys.stdin.read()
    finally:
        left = d.teardown(failed)
    if left:
        print(f"daemon.py: leftovers after teardown: {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
