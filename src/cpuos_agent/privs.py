"""Who the agent runs as, and what no command can do to it.

*Root mode* (the backends start the agent with real uid 0 and a small bounding set): the
agent keeps real and saved uid 0 and works with the sandbox user's effective uid and gid
(files it creates are the user's, permission checks are the user's), with no effective
capability. Commands run under the sandbox user's uid in every slot (the spawner,
``spawner.py``, starts them). A process may signal another only if its real or effective
uid is the other's real or saved uid (kill(2)): no command can signal, stop or kill the
agent, nor ptrace it. gVisor has no init protection (a SIGKILL or SIGSTOP from inside the
pid namespace reaches PID 1, unlike Linux), so this is what keeps the agent alive there.
A thread raises its effective uid to 0 for a moment (``privileged``) only for what needs
it: cgroups (``cgroups.py``), the hostname, the RNG, the clock; never for a path a command
could have placed.

*Legacy mode* (started as the sandbox user, e.g. a microVM guest built before root mode):
the agent is the user; catchable signals are still shielded, and Linux's init protection
covers SIGKILL and SIGSTOP for a guest's PID 1.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Iterator

SANDBOX_UID = int(os.environ.get("CPUOS_UID", "1000"))

# (setresuid, setresgid) syscall numbers: the raw syscall changes the calling thread's
# credentials only (glibc's wrappers change every thread's)
_SYSCALLS = {"x86_64": (117, 119), "aarch64": (147, 149)}
_NR = _SYSCALLS.get(os.uname().machine)
_libc = ctypes.CDLL(None, use_errno=True)
_UNCHANGED = ctypes.c_long(-1)


_PID1 = os.getpid() == 1  # at import: the agent runs as its sandbox's init


def root_mode() -> bool:
    """The agent as its sandbox's PID 1, started as real root, on an architecture whose
    per-thread syscalls we know. (Run anywhere else, e.g. as a host process in a test, it
    never mounts, forks a spawner or changes ids.)"""
    return _PID1 and os.getuid() == 0 and _NR is not None


def _thread_euid(euid: int) -> None:
    assert _NR is not None
    if _libc.syscall(ctypes.c_long(_NR[0]), _UNCHANGED, ctypes.c_long(euid), _UNCHANGED) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def drop_to_user(uid: int = SANDBOX_UID) -> None:
    """Root mode, once, before any thread: real and saved ids stay 0, effective ids and the
    groups become the user's; the effective capabilities are cleared by that (the
    permitted set is kept: ``privileged`` raises it again)."""
    os.setgroups([uid])
    os.setresgid(0, uid, 0)
    os.setresuid(0, uid, 0)


def become_user(uid: int = SANDBOX_UID) -> None:
    """All ids the user's, no capability left (the spawner; it runs single-threaded)."""
    if os.getuid() == 0 and os.geteuid() == 0:
        os.setgroups([uid])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid):
        raise OSError("could not become the sandbox user")


@contextlib.contextmanager
def privileged() -> Iterator[None]:
    """Effective uid 0 (and so the permitted capabilities) for this thread only, for the
    block. Use it only on paths no command can write (a cgroup tree, /proc/sys) and for
    calls that take no path. If dropping back fails the agent exits: no thread may go on
    as root."""
    before = os.geteuid()  # this thread's
    if not root_mode() or before == 0:
        yield
        return
    _thread_euid(0)
    try:
        yield
    finally:
        try:
            _thread_euid(before)
        except OSError:
            os._exit(70)


# The signals a command could send to make a process exit or stop. A handler (rather than
# SIG_IGN) is reset to the default on exec, so commands get the usual dispositions.
# SIGKILL and SIGSTOP cannot be caught (root mode is what covers them); the fault signals
# keep their default (a real fault must not loop through a handler), as do those whose
# default is to ignore.
def _noop(signum: int, frame: object) -> None:
    pass


_LEAVE = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT, signal.SIGWINCH,
          signal.SIGURG, signal.SIGPIPE, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
          signal.SIGILL, signal.SIGTRAP, signal.SIGSYS, signal.SIGABRT}


def shield_signals() -> None:
    """Every catchable signal that would end, stop or interrupt the agent is handled (a
    no-op) or ignored (SIGPIPE: Python's default; subprocess restores it for children)."""
    for sig in signal.valid_signals():
        if sig in _LEAVE:
            continue
        try:
            signal.signal(sig, _noop)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
