"""Where a running daemon is: ``kill -USR1 <pid>`` writes every thread's Python stack to its
stderr (faulthandler: works even when the event loop is stuck), ``kill -USR2 <pid>`` every
asyncio task's (a daemon that does not stop, or a request that hangs, says where it
waits). Installed by ``cpuosd`` before it serves (every role)."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
import sys
import time
from types import FrameType

TASK_FRAMES = 12  # frames shown per task (the innermost)


def install() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGUSR2, _tasks)


def _tasks(signum: int, frame: FrameType | None) -> None:
    """(A Python handler: it runs in the main thread, between two steps of the loop.)"""
    loop = asyncio._get_running_loop()
    out = io.StringIO()
    out.write(f"--- cpuosd asyncio tasks at {time.strftime('%H:%M:%S')} ---\n")
    if loop is None:
        out.write("(no event loop running)\n")
    else:
        for t in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
            out.write(f"{t.get_name()}: {t.get_coro()!r}\n")
            t.print_stack(limit=TASK_FRAMES, file=out)
    out.write("--- end of tasks ---\n")
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()
