"""cpuosd as a child subreaper.

`runsc run --detach` leaves the sandbox and gofer processes behind; they are
reparented to the nearest subreaper, or to PID 1. When a checkpoint or a kill
ends them, `runsc delete` waits until they have been reaped — and a slow PID 1
(seen here: 1.2-1.4 s) makes every pause that slow. So the daemon adopts them
(PR_SET_CHILD_SUBREAPER) and reaps its zombie children itself, leaving alone
the children that asyncio is waiting for (``managed``).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("cpuosd.reaper")
PR_SET_CHILD_SUBREAPER = 36

# pids of subprocesses whose exit status someone awaits (never reaped here)
managed: set[int] = set()


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except OSError:
        return False


def _children() -> set[int]:
    out: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/children") as f:
                out.update(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def reap_orphans() -> int:
    """Reap every zombie child that no one else awaits; returns how many."""
    n = 0
    for pid in _children() - managed:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z" or pid in managed:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                n += 1
        except ChildProcessError:
            pass
    return n
