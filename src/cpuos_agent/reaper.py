"""PID 1 duty: reap every child and hand exit statuses to their waiters; kill a command's
whole tree (process group, session, descendants, and orphans that carry its mark).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable

Waiter = tuple[threading.Event, list[int], Callable[[], None] | None]


class Reaper:
    """PID 1 duty: reap every child, hand exit statuses of our own spawns to their waiters.

    A child may exit before its waiter registers; such statuses are kept briefly with the
    time they were reaped, and a waiter accepts one only if it was reaped after its spawn
    began (so a recycled pid never hands over a stale status).

    No periodic wakeup: the thread blocks in ``waitpid`` while there is a child (in root
    mode the spawner always is one); with none it sleeps on a pipe written when one may
    appear: a spawn of ours (``kick``) or a SIGCHLD (an orphan reparented to us has
    exited: the interpreter's wakeup fd, set up here from the main thread). A child that
    stops is reported to ``on_stop`` (the spawner's handle: a stopped spawner is replaced).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, Waiter] = {}
        self._early: dict[int, tuple[float, int]] = {}
        self._kick_r, self._kick_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.on_stop: Callable[[int], None] | None = None
        # without the SIGCHLD wakeup (not the main thread: a test), look twice a second
        self._idle_wait: float | None = None if _wake_on_sigchld(self._kick_w) else 0.5
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def kick(self) -> None:
        """A child may exist now: wait for it."""
        with contextlib.suppress(OSError):  # full: a wakeup is pending anyway
            os.write(self._kick_w, b"k")

    def register(self, pid: int, spawned_at: float, notify: Callable[[], None] | None = None
                 ) -> tuple[threading.Event, list[int]]:
        """pid's exit status, when it comes: the event is set, the box holds it, and
        ``notify`` (if given) is called."""
        ev = threading.Event()
        box: list[int] = []
        with self._lock:
            early = self._early.pop(pid, None)
            if early is not None and early[0] >= spawned_at:
                box.append(early[1])
                ev.set()
            else:
                self._waiters[pid] = (ev, box, notify)
        self.kick()
        return ev, box

    def _run(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WUNTRACED)
            except ChildProcessError:  # no child at all: until one may exist
                select.select([self._kick_r], [], [], self._idle_wait)
                with contextlib.suppress(OSError):
                    os.read(self._kick_r, 4096)
                continue
            except InterruptedError:
                continue
            if os.WIFSTOPPED(status):
                cb = self.on_stop
                if cb is not None:
                    cb(pid)
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
        if w[2] is not None:
            w[2]()

    def settle_lost(self) -> None:
        """The spawner died: its children are ours now (the kernel reparents them to PID 1
        and we reap them), except those it reaped and never reported. Those no longer
        exist: they are settled as killed (SIGKILL)."""
        with self._lock:
            pids = list(self._waiters)
        for pid in pids:
            if not os.path.exists(f"/proc/{pid}"):
                self.deliver(pid, signal.SIGKILL)


def _noop(signum: int, frame: object) -> None:
    pass


def _wake_on_sigchld(fd: int) -> bool:
    """Have every SIGCHLD (and any other signal handled in Python) write a byte to fd, from
    whichever thread gets it. Only the main thread may set this up; False elsewhere."""
    try:
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _noop)  # a handler, reset to the default by exec
    except ValueError:
        return False
    return True


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
