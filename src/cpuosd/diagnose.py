"""Where a running daemon is: ``kill -USR1 <pid>`` writes every thread's Python stack to its
stderr (faulthandler: works even when the event loop is stuck), ``kill -USR2 <pid>`` every
asyncio task's (a daemon that does not stop, or a request that hangs, says where it
waits). Installed by ``cpuosd`` before it serves (every role)."""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import io
import signal
import sys
import time
from types import FrameType

TASK_FRAMES = 40  # frames shown per task (the innermost)


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
            out.write(f"{t.get_name()}:\n")
            for line in _awaiting(t.get_coro())[-TASK_FRAMES:]:
                out.write(f"  {line}\n")
    out.write("--- end of tasks ---\n")
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()


def _awaiting(coro: object) -> list[str]:
    """The chain of awaits of a suspended coroutine, outermost first (a task's own stack
    shows its outermost frame only): "file:line in function" each. Through async
    generators too (an ``asynccontextmanager``'s body: a lifespan's, whose exit is where a
    stop waits)."""
    lines: list[str] = []
    seen = 0
    while coro is not None and seen < 100:
        seen += 1
        frame = (getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                 or getattr(coro, "ag_frame", None))
        if frame is not None:
            code = frame.f_code
            lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        nxt = (getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
               or getattr(coro, "ag_await", None))
        if type(nxt).__name__ in ("async_generator_asend", "async_generator_athrow"):
            # (an anext()/athrow() of an async generator does not say which: the running
            # one among the frame's locals, or their ``gen``, as contextlib keeps it)
            nxt = _running_agen(frame) or nxt
        coro = nxt
    return lines


def _running_agen(frame: FrameType | None) -> object | None:
    if frame is None:
        return None
    for v in frame.f_locals.values():
        for x in (v, getattr(v, "gen", None)):
            if inspect.isasyncgen(x) and x.ag_running:
                return x
    return None
