"""The agent's reaper: a status it has reaped is never overtaken by a lost spawner's
settlement (SIGKILL) while it is on its way to the waiter.

Run in a child interpreter: the reaper reaps every child of its process, which would
take the statuses of other tests' subprocesses here."""

from __future__ import annotations

import subprocess
import sys

SCENARIO = r'''
import os, subprocess, threading, time
from cpuos_agent import reaper as reaper_mod

reaped, go_on = threading.Event(), threading.Event()
real_waitpid = os.waitpid
child = None

def slow_waitpid(pid, options):
    got = real_waitpid(pid, options)
    if child is not None and got[0] == child.pid:
        reaped.set()  # reaped: /proc/<pid> is gone, the waiter not told yet
        go_on.wait(10)
    return got

reaper_mod.os.waitpid = slow_waitpid
r = reaper_mod.Reaper()
spawned_at = time.monotonic()
child = subprocess.Popen(["sh", "-c", "read x; exit 3"], stdin=subprocess.PIPE)
ev, box = r.register(child.pid, spawned_at)
child.stdin.close()  # (it exits now: child is known by then)
assert reaped.wait(10), "the reaper never reaped the child"
assert not os.path.exists(f"/proc/{child.pid}")
settler = threading.Thread(target=r.settle_lost)  # (its spawner is gone, say)
settler.start()
early = ev.wait(0.3)  # (it must wait for the reaper's step, not settle it as killed)
go_on.set()
settler.join(10)
assert ev.wait(10)
print("early" if early else "waited", os.waitstatus_to_exitcode(box[0]))
'''


def test_a_reaped_status_is_not_settled_as_killed() -> None:
    p = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["waited", "3"], p.stdout
