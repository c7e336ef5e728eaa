"""The one owner of the daemon's child processes: spawn, wait, signal, reap.

Every program the daemon starts (runsc, the microVM jailer, QEMU's boot probe, ``ip`` and
``nft``, a template build and the steps it runs) goes through ``spawn`` (``run`` and
``run_sync`` for one-shot commands, bounded in time); nothing else in cpuosd starts a
process (``tests/unit/test_procs_owner.py`` holds every module to that). The
child is forked, opened as a pidfd and registered in one step under ``LOCK``, so no other
waiter can take its exit status and no pid of it is trusted after it could have been
reused (signals go through the pidfd). Its exit is seen on the pidfd (readable once the
process has exited) and collected with ``waitid(P_PIDFD)``.

cpuosd is a child subreaper (``become_subreaper``): a detached runsc leaves its sandbox and
gofer processes to us, QEMU is left to us by its jailer. ``reap_orphans`` reaps those
adopted orphans, and only them: a pid registered here is never touched by it, and it holds
``LOCK`` while it looks, so a child being spawned (in any thread) is registered before it
can be seen. ``adopt`` takes an orphan we must watch (a microVM's QEMU) into the registry;
``kill_orphans`` ends orphans nobody will end otherwise (what a runsc killed half-way had
started).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from .homedir import CHILD_UMASK

log = logging.getLogger("cpuosd.procs")
PR_SET_CHILD_SUBREAPER = 36
OUTPUT_CAP = 16 << 20  # what run() keeps of a child's stdout (runsc list with many sandboxes)
KILLED = -signal.SIGKILL  # run_sync's status for a child it killed at its timeout
DEVNULL = subprocess.DEVNULL

LOCK = threading.Lock()
_owned: dict[int, Child] = {}


class Child:
    """A child process known by its pidfd. ``returncode`` is set once it has exited
    (negative: killed by that signal), by whoever notices first."""

    def __init__(self, pid: int, pidfd: int, argv: Sequence[str],
                 popen: subprocess.Popen[bytes] | None) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.argv = list(argv)
        self.returncode: int | None = None
        self._popen = popen  # kept alive: its __del__ must not waitpid() our child
        self._waiters: list[asyncio.Future[int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = threading.Event()

    # -- exit --------------------------------------------------------------------------
    def poll(self) -> int | None:
        """Collect the exit status if the child has exited (never blocks)."""
        with LOCK:
            return self._collect()

    def _collect(self) -> int | None:
        """(LOCK held) the exit status, collected now if the child has exited."""
        if self.returncode is not None:
            return self.returncode
        try:
            res = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # someone reaped it behind our back: status lost
            log.error("child %d (%s) was reaped by someone else", self.pid, self.argv[0])
            self._finish(-255)
            return self.returncode
        if res is None:
            return None
        self._finish(res.si_status if res.si_code == os.CLD_EXITED else -res.si_status)
        return self.returncode

    def _finish(self, code: int) -> None:
        """(LOCK held) record the exit, close the pidfd, wake waiters."""
        self.returncode = code
        if self._popen is not None:
            self._popen.returncode = code  # Popen will not wait for it again
        _owned.pop(self.pid, None)
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.pidfd)
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self._done.set()
        for fut in self._waiters:
            loop = fut.get_loop()
            if not fut.done():
                loop.call_soon_threadsafe(_set_result, fut, code)
        self._waiters.clear()

    def _on_readable(self) -> None:
        self.poll()

    async def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises TimeoutError (the child keeps running) after timeout."""
        if self.returncode is not None:
            return self.returncode
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        with LOCK:
            if self.returncode is not None:
                return self.returncode
            self._waiters.append(fut)
            if self._loop is None:
                self._loop = loop
                loop.add_reader(self.pidfd, self._on_readable)
        self.poll()  # it may have exited before the reader was armed
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            with LOCK:
                if fut in self._waiters and fut.done():
                    self._waiters.remove(fut)

    def wait_sync(self, timeout: float | None = None) -> int | None:
        """For threads: the exit status, or None after timeout. It waits on a duplicate of
        the pidfd: another thread may collect the child meanwhile (``reap_orphans`` takes
        registered children nobody waits for asynchronously) and close the pidfd, whose
        number a new descriptor can take before the wait begins; polling that stalled
        the thread until the timeout (nft and ip, 30 s, after many sandboxes ended at
        once: a daemon's stop took ~30 s)."""
        if self.poll() is not None:
            return self.returncode
        import select

        p = select.poll()
        with LOCK:
            if self.returncode is not None:
                return self.returncode
            fd = os.dup(self.pidfd)
        try:
            p.register(fd, select.POLLIN)
            p.poll(None if timeout is None else int(timeout * 1000))
        finally:
            os.close(fd)
        return self.poll()

    # -- signals -----------------------------------------------------------------------
    def send_signal(self, sig: int) -> None:
        """Signal the child by its pidfd (a no-op once it has exited: never another
        process that got its pid)."""
        with LOCK:
            if self.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's process group (it leads one: spawned with a new session)."""
        with LOCK:
            if self.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)  # the pid is ours until we collect it


def _set_result(fut: asyncio.Future[int], code: int) -> None:
    if not fut.done():
        fut.set_result(code)


def spawn(argv: Sequence[str], *, stdin: Any = subprocess.DEVNULL, stdout: Any = None,
          stderr: Any = None, pass_fds: Sequence[int] = (), new_session: bool = True,
          env: dict[str, str] | None = None, cwd: str | None = None,
          umask: int = CHILD_UMASK) -> Child:
    """Start argv; the child is ours (registered, by pidfd) before anything can reap it."""
    with LOCK:
        # children get the usual umask unless told (the daemon's is 077, cpuosd.homedir):
        # a template build's tree and the microVM jail are read by other users
        popen = subprocess.Popen(list(argv), stdin=stdin, stdout=stdout, stderr=stderr,
                                 pass_fds=tuple(pass_fds), start_new_session=new_session,
                                 env=env, cwd=cwd, close_fds=True, umask=umask)
        pidfd = os.pidfd_open(popen.pid)  # a zombie until we collect it: still that child
        child = Child(popen.pid, pidfd, argv, popen)
        _owned[popen.pid] = child
    return child


def adopt(pid: int, argv0: str) -> Child | None:
    """Take an adopted orphan (our child by reparenting, e.g. QEMU left by its jailer) into
    the registry, or None if pid is not such a child of ours now."""
    with LOCK:
        if pid in _owned:
            return _owned[pid]
        if _ppid(pid) != os.getpid():
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        if _ppid(pid) != os.getpid():  # exited and reaped and reused in between
            os.close(pidfd)
            return None
        child = Child(pid, pidfd, [argv0], None)
        _owned[pid] = child
    return child


def owned(pid: int) -> Child | None:
    with LOCK:
        return _owned.get(pid)


async def run(argv: Sequence[str], *, timeout: float, log_path: Path | None = None,
              null_stdio: bool = False, what: str | None = None,
              umask: int = CHILD_UMASK) -> tuple[int, bytes, bytes]:
    """Run argv to its end: (exit status, stdout, stderr). Output goes to temporary files
    (a detached runsc hands its stdio to the sandbox it starts, so a pipe would never reach
    EOF) or, with log_path, appended to that file (stderr is then its tail). With
    null_stdio the child's stdio is /dev/null and it writes log_path itself (a detached
    sandbox must not inherit a host file it could grow). On timeout the child's process
    group is killed and collected, and TimeoutError raised."""
    if null_stdio:
        assert log_path is not None
        child = spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, umask=umask)
        out_f: IO[bytes] | None = None
        err_f: IO[bytes] | None = None
    elif log_path is not None:
        with open(log_path, "ab") as logf:
            child = spawn(argv, stdout=logf, stderr=logf, umask=umask)
        out_f = err_f = None
    else:
        out_f = tempfile.TemporaryFile()
        err_f = tempfile.TemporaryFile()
        child = spawn(argv, stdout=out_f, stderr=err_f, umask=umask)
    try:
        try:
            rc = await child.wait(timeout)
        except BaseException:  # timeout, or our caller was cancelled: end it, collect it
            child.killpg()
            child.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.shield(child.wait(10))
            raise
        if out_f is not None and err_f is not None:
            out_f.seek(0)
            err_f.seek(0)
            return rc, out_f.read(OUTPUT_CAP), _tail(err_f)
        assert log_path is not None
        try:
            with open(log_path, "rb") as logf:
                return rc, b"", _tail(logf)
        except FileNotFoundError:
            return rc, b"", b""
    finally:
        for f in (out_f, err_f):
            if f is not None:
                f.close()


def run_sync(argv: Sequence[str], *, input: bytes | None = None, timeout: float = 600,
             env: dict[str, str] | None = None, cwd: str | Path | None = None,
             new_session: bool = True) -> tuple[int, bytes, bytes]:
    """run() for threads and scripts: (exit status, stdout, stderr); the child is killed
    after timeout (status ``KILLED``). ``new_session=False`` leaves it in our process group
    (a template build's steps: the daemon ends a build by signalling its group)."""
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f, \
            tempfile.TemporaryFile() as in_f:
        if input is not None:
            in_f.write(input)
            in_f.seek(0)
        child = spawn(argv, stdin=in_f if input is not None else subprocess.DEVNULL,
                      stdout=out_f, stderr=err_f, env=env,
                      cwd=None if cwd is None else str(cwd), new_session=new_session)
        rc = child.wait_sync(timeout)
        if rc is None:
            if new_session:
                child.killpg()
            child.kill()
            rc = child.wait_sync(10)
        out_f.seek(0)
        err_f.seek(0)
        return (KILLED if rc is None else rc), out_f.read(), err_f.read()


def _tail(f: IO[bytes], n: int = 4000) -> bytes:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - n))
    return f.read()


# ---- adopted orphans ------------------------------------------------------------------------
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


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def reap_orphans() -> int:
    """Reap every exited child that is not registered here (adopted orphans); returns how
    many. Registered children are collected by their own Child only."""
    n = 0
    with LOCK:
        for pid in _children():
            if pid in _owned:
                continue
            try:
                res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                continue
            if res is not None:
                n += 1
        # registered children whose exit nobody is waiting for: collect them too
        for child in list(_owned.values()):
            if child._loop is None and not child._waiters:
                child._collect()
    return n


def kill_orphans(match: Callable[[list[bytes]], bool], sig: int = signal.SIGKILL) -> list[int]:
    """Signal every adopted orphan (our child by reparenting, not registered here) whose
    argv ``match`` accepts; their pids. Under ``LOCK``, so none of them is reaped while we
    look: an unreaped child's pid is its own, never another process's."""
    hit: list[int] = []
    with LOCK:
        for pid in _children():
            if pid in _owned:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if match(argv):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                hit.append(pid)
    return hit


async def reap_loop(interval: float = 5.0) -> None:
    """Reap adopted orphans now and then (and at once on SIGCHLD where the loop can)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGCHLD, wake.set)
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval)
        wake.clear()
        await asyncio.to_thread(reap_orphans)
