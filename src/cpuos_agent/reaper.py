"""PID 1 duty: reap every child and hand exit statuses to their waiters; kill a command's
whole tree (process group, session, descendants, and orphans that carry its mark).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import os
import signal
import threading
import time


class Reaper:
    """PID 1 duty: reap every child, hand exit statuses of our own spawns to their waiters.

    A child may exit before its waiter registers; such statuses are kept briefly with the
    time they were reaped, and a waiter accepts one only if it was reaped after its spawn
    began (so a recycled pid never hands over a stale status).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, tuple[threading.Event, list[int]]] = {}
        self._early: dict[int, tuple[float, int]] = {}
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def register(self, pid: int, spawned_at: float) -> tuple[threading.Event, list[int]]:
        ev = threading.Event()
        box: list[int] = []
        with self._lock:
            early = self._early.pop(pid, None)
            if early is not None and early[0] >= spawned_at:
                box.append(early[1])
                ev.set()
            else:
                self._waiters[pid] = (ev, box)
        self._wake.set()
        return ev, box

    def _run(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            except InterruptedError:
                continue
            self.deliver(pid, status)

    def deliver(self, pid: int, status: int) -> None:
        """pid exited with status (reaped here, or by the spawner, which reports it)."""
        now = time.monotonic()
        with self._lock:
            w = self._waiters.pop(pid, None)
            if w is None:  # an orphan, or one of ours not yet registered
                self._early[pid] = (now, status)
                if len(self._early) > 256:
                    self._early = {p: v for p, v in self._early.items() if now - v[0] < 60}
                return
        w[1].append(status)
        w[0].set()

    def settle_lost(self) -> None:
        """The spawner died: its children are ours now (the kernel reparents them to PID 1
        and we reap them), except those it reaped and never reported. Those no longer
        exist: they are settled as killed (SIGKILL)."""
        with self._lock:
            pids = list(self._waiters)
        for pid in pids:
            if not os.path.exists(f"/proc/{pid}"):
                self.deliver(pid, signal.SIGKILL)


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parens
        rest = data[data.rfind(b")") + 2 :].split()
        if len(rest) < 2:
            continue
        kids.setdefault(int(rest[1]), []).append(int(name))
    return kids


def _session_and_group(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[4]), int(rest[3])  # session, pgrp
    except (OSError, IndexError, ValueError):
        return None


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def _members(root: int, mark: bytes) -> set[int]:
    """Every process of one exec: the root's descendants, its session and process group,
    and anything carrying the exec's environment mark (how a setsid-and-orphaned grandchild,
    reparented to PID 1, is still found)."""
    kids = _children_map()
    me = os.getpid()
    found = {root}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in (me, root):
            continue
        sg = _session_and_group(pid)
        if (sg is not None and root in sg) or _has_mark(pid, mark):
            found.add(pid)
    todo = list(found)
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in found and c != me:
                found.add(c)
                todo.append(c)
    return found


def kill_tree(root: int, mark: bytes) -> None:
    """Stop every process of the exec (stopped processes cannot fork), until no new one
    appears; then SIGKILL them all."""
    seen: set[int] = set()
    for _ in range(50):
        new = _members(root, mark) - seen
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        seen |= new
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
