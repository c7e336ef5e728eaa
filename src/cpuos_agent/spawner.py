"""Starting commands.

In root mode (``privs.py``) the agent's real uid is 0 and a command must run with the
user's uid in every slot; a child that inherited real uid 0 could take euid 0 back (dash
and bash even do so on their own). Changing uids in the child rules out vfork: under
gVisor a fork of the agent costs ~15 ms, doubling the exec round trip. So commands are
started by the *spawner*: a small process of the agent's (forked from it at start, before
it read its key or started a thread), all of whose ids are the user's, which starts each
command with vfork (``subprocess``) and reports its exit status. The agent asks it over
a socketpair (SCM_RIGHTS for the command's stdin/stdout/stderr), having first moved it
into the exec's cgroup, so the command starts there.

Commands can signal the spawner (same uid) but not the agent: a spawner that is killed,
stopped or gone silent is killed and replaced, and the commands it started (reparented
to the agent) are reaped by the agent. Nothing polls for that: the agent is the
spawner's parent, so its reaper hears of a stop (``waitpid`` with WUNTRACED) and of an
exit, and the spawner's end of the event socket closing says it is gone.

An idle sandbox has no spawner: once nothing has run for ``idle_exit`` seconds the agent
closes its end of the request socket and the spawner exits (~7 MiB of host memory per
sandbox); the next command forks a new one from the agent first (a fork of the agent:
40-100 ms here under gVisor, once per busy spell).

In legacy mode (the agent is the user) commands are started by the agent itself.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import array
import ctypes
import errno
import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import privs

if TYPE_CHECKING:
    from .cgroups import Cgroup, Cgroups
    from .reaper import Reaper

MAX_REQUEST = 1 << 18  # an exec request's argv and env (the frame header is at most 64 KiB)
MAX_REPLY = 1 << 12
REPLY_WAIT = 10.0  # s: a spawner that has not answered by then is replaced
IDLE_EXIT = 120.0  # s with nothing running after which the spawner exits (the host's
# identity message may say otherwise: CPUOS_SPAWNER_IDLE_EXIT; 0: never)
CHECK_EVERY = 0.2  # s: how often a waiting spawn looks whether the spawner was stopped


def popen(argvs: list[list[str]], cwd: str, env: dict[str, str], fds: tuple[int, int, int]
          ) -> int:
    """Start the first argv that can be started (a later one only if cwd is a directory:
    otherwise the error is about cwd); its pid. Raises the last OSError."""
    import subprocess  # (the spawner's, or a legacy agent's: not resident in a root agent)

    for i, argv in enumerate(argvs):
        try:
            p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=fds[0], stdout=fds[1],
                                 stderr=fds[2], start_new_session=True, close_fds=True)
        except OSError:
            if i + 1 < len(argvs) and os.path.isdir(cwd):
                continue
            raise
        p.returncode = 0  # reaped by whoever reaps (never by Popen: a recycled pid...)
        return p.pid
    raise ValueError("nothing to start")


def _send(sock: socket.socket, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds \
        else []
    sock.sendmsg([data], anc)


def _recv(sock: socket.socket, size: int, nfds: int = 0, buf: bytearray | None = None
          ) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (at most ``size`` bytes; into ``buf``, reused, if given: a fresh buffer
    of MAX_REQUEST bytes per request is an mmap, then an mremap and a munmap when the bytes
    object shrinks to the message, each a costly change of the address space in gVisor)."""
    fds = array.array("i")
    anc_size = socket.CMSG_LEN(max(1, nfds) * fds.itemsize)
    data: bytes | bytearray
    if buf is None:
        data, anc, _, _ = sock.recvmsg(size, anc_size)
    else:
        n, anc, _, _ = sock.recvmsg_into([memoryview(buf)[:size]], anc_size)
        data = buf[:n]
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


# ---- the spawner process ----------------------------------------------------------------
def _spawner_main(req: socket.socket, events: socket.socket, uid: int,
                  pdeathsig: bool = True) -> None:
    """The spawner's life (never returns): requests on ``req`` (each answered there), exit
    statuses of what it started on ``events``. It owns nothing secret and holds no
    capability; it ends when the agent's end of ``req`` closes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if pdeathsig:  # (it fires when the forking *thread* ends: see Spawner.fork)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        privs.become_user(uid)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no command may read it or its fds
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        keep = sorted((req.fileno(), events.fileno()))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 16)
    except BaseException:
        os._exit(71)
    import subprocess  # noqa: F401  (popen's, loaded now rather than on the first spawn)
    kids = threading.Semaphore(0)  # released after each start: no wakeup while none runs

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                kids.acquire()
                continue
            except InterruptedError:
                continue
            try:
                _send(events, {"exit": pid, "status": status})
            except OSError:
                os._exit(0)

    threading.Thread(target=reap, daemon=True).start()
    buf = bytearray(MAX_REQUEST)
    while True:
        try:
            msg, fds = _recv(req, MAX_REQUEST, 3, buf)
        except (OSError, ValueError):
            os._exit(0)
        if msg is None:
            os._exit(0)
        reply: dict[str, Any]
        try:
            if len(fds) != 3:
                raise ValueError("three fds expected")
            pid = popen(msg["argvs"], msg["cwd"], msg["env"], (fds[0], fds[1], fds[2]))
            reply = {"pid": pid}
            kids.release()
        except OSError as e:
            reply = {"errno": e.errno or 0, "strerror": e.strerror or str(e)}
        except (KeyError, TypeError, ValueError) as e:
            reply = {"errno": 22, "strerror": f"bad spawn request: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            _send(req, reply)
        except OSError:
            os._exit(0)


# ---- the agent's side -------------------------------------------------------------------
class Spawner:
    """The agent's handle on its spawner process (root mode only)."""

    def __init__(self, uid: int = privs.SANDBOX_UID) -> None:
        self.uid = uid
        self.pid = 0
        self.sock: socket.socket | None = None  # requests and their answers
        self.reaper: Reaper | None = None
        self.cgroups: Cgroups | None = None
        self.restarts = 0
        self.idle_exits = 0
        self._lock = threading.Lock()  # one spawn at a time (the spawner moves cgroups)
        self._events: socket.socket | None = None
        self._gone = threading.Event()
        # idle exit: whether a command runs (the agent's), since when nothing has
        self.busy: Callable[[], bool] = lambda: True
        self.idle_exit = IDLE_EXIT
        self._idle_cv = threading.Condition()
        self._idle_since: float | None = None
        self._exited_idle = False

    def fork(self) -> None:
        """Start a spawner process (at start: before any thread and before the key is
        read; later: to replace one)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ea, eb = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        main_thread = threading.current_thread() is threading.main_thread()
        pid = os.fork()
        if pid == 0:
            a.close()
            ea.close()
            # the parent-death signal follows the thread that forked: only a fork from
            # the main thread may ask for it (a later one, from an exec's thread, would
            # be killed when that exec ends); the agent is PID 1, so its death ends every
            # process of the sandbox anyway
            _spawner_main(b, eb, self.uid, main_thread)
            os._exit(0)
        b.close()
        eb.close()
        for x in (a, ea):
            x.set_inheritable(False)
        self.sock, self._events, self.pid = a, ea, pid
        self._gone = threading.Event()
        if self.reaper is not None:
            self.reaper.kick()
            self._start_reader()

    def attach(self, reaper: Reaper, cgroups: Cgroups | None,
               busy: Callable[[], bool] | None = None) -> None:
        """Exit statuses go to reaper from now on; commands start in their exec's cgroup;
        a stop of the spawner, which reaper sees, ends it. ``busy``: whether a command of
        the agent's runs (without it the spawner never exits when idle)."""
        self.reaper, self.cgroups = reaper, cgroups
        reaper.on_stop = self._on_stop
        if busy is not None:
            self.busy = busy
            threading.Thread(target=self._idle_loop, name="spawner-idle", daemon=True).start()
            self.idle()
        if self.sock is not None:
            self._start_reader()

    def set_idle_exit(self, seconds: float) -> None:
        with self._idle_cv:
            self.idle_exit = seconds
            self._idle_cv.notify()

    def idle(self) -> None:
        """A command ended (or none ran yet): the spawner exits after ``idle_exit`` seconds
        in which none started."""
        with self._idle_cv:
            self._idle_since = time.monotonic()
            self._idle_cv.notify()

    def _idle_loop(self) -> None:
        """Sleeps (no timeout) while commands run or there is no spawner; once,
        ``idle_exit`` after the last one ended, ends the spawner."""
        while True:
            with self._idle_cv:
                while self._idle_since is None or self.sock is None or self.idle_exit <= 0:
                    self._idle_cv.wait()
                left = self._idle_since + self.idle_exit - time.monotonic()
                if left > 0:
                    self._idle_cv.wait(left)
                    continue
                self._idle_since = None
            self._exit_if_idle()

    def _exit_if_idle(self) -> None:
        with self._lock:  # (no spawn under way)
            if self.sock is None or self._gone.is_set() or self.busy():
                return
            # its recv ends: it exits, and its event socket's end closes (our reader
            # settles what is left); it started nothing that still runs
            self.sock.close()
            self.sock = None
            self._exited_idle = True
            self.idle_exits += 1
        from .memguard import give_back  # (the agent's: not loaded before the spawner's fork)

        give_back()  # the sandbox goes idle

    def _on_stop(self, pid: int) -> None:
        """A child of the agent stopped: if it is the spawner, it cannot report exits any
        more: it is killed (what it started is reparented to the agent and reaped there;
        the next spawn forks a new one). Other children (orphans) are left alone."""
        if pid == self.pid and not self._gone.is_set():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _start_reader(self) -> None:
        threading.Thread(target=self._read, args=(self._events, self._gone),
                         name="spawner", daemon=True).start()

    def _read(self, events: socket.socket | None, gone: threading.Event) -> None:
        """Exit statuses as the spawner reports them; its end closing: it is gone."""
        try:
            while events is not None:
                msg, fds = _recv(events, MAX_REPLY)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    break
                pid, status = msg.get("exit"), msg.get("status")
                if isinstance(pid, int) and isinstance(status, int) and self.reaper:
                    self.reaper.deliver(pid, status)
        except (OSError, ValueError):
            pass
        gone.set()
        if events is not None:
            events.close()
        if self.reaper is not None:
            # what it started is now the agent's to reap (reparented to PID 1); statuses it
            # reaped but never reported are settled as killed
            self.reaper.settle_lost()

    def _stopped(self) -> bool:
        try:  # (os.open/read: 3 system calls, where a buffered open() makes 9)
            fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            try:
                state = os.read(fd, 4096).rsplit(b")", 1)[1].split()[0]
            finally:
                os.close(fd)
        except (OSError, IndexError):
            return True
        return state in (b"T", b"t", b"Z", b"X")

    def _retire(self) -> None:
        """Kill the spawner and let go of it (the next spawn forks a new one). What it
        started is reparented to the agent, which reaps it."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _replace(self) -> None:
        self._retire()
        self.restarts += 1
        self.fork()

    def spawn(self, argvs: list[list[str]], cwd: str, env: dict[str, str],
              fds: tuple[int, int, int], cgroup: Cgroup | None
              ) -> tuple[int, threading.Event]:
        """Start a command through the spawner (in cgroup, if given); its pid, and the event
        set once the spawner that started it is gone (``lost``). Raises
        OSError: the command could not be started, or the spawner was stopped or killed
        before it answered (it is replaced; the command is not retried: it may have
        started, and the caller kills what is in its cgroup)."""
        req = {"argvs": argvs, "cwd": cwd, "env": env}
        with self._lock:
            with self._idle_cv:
                self._idle_since = None  # (the agent calls idle() when it has ended)
            if self.sock is None and self._exited_idle:
                self._exited_idle = False
                # what the new spawner runs is loaded here, before the fork: a thread of
                # ours importing it meanwhile would leave its import lock held there
                import subprocess  # noqa: F401
                self.fork()
            for _ in range(3):
                if self.sock is None or self._gone.is_set() or self._stopped():
                    self._replace()
                sock = self.sock
                assert sock is not None
                moved = False
                try:
                    if cgroup is not None and self.cgroups is not None:
                        self.cgroups.enter(cgroup, self.pid)
                        moved = True
                    try:
                        _send(sock, req, fds)
                    except OSError:
                        self._gone.set()  # it was gone before it got the request
                        continue
                    reply = self._wait_reply(sock)
                finally:
                    if moved and self.cgroups is not None:
                        try:
                            self.cgroups.leave(self.pid)
                        except OSError:
                            pass
                if reply is None:
                    self._replace()
                    raise OSError(errno.EAGAIN, "the command spawner was stopped or killed "
                                  "from inside the sandbox before it reported the start (it "
                                  "was replaced; what had started was killed)")
                if isinstance(reply.get("pid"), int):
                    return int(reply["pid"]), self._gone
                e = reply.get("errno")
                raise OSError(e if isinstance(e, int) else 0,
                              str(reply.get("strerror") or "cannot start"))
        raise OSError(errno.EAGAIN, "the command spawner keeps dying")

    def _wait_reply(self, sock: socket.socket) -> dict[str, Any] | None:
        """The spawner's answer, read here (no thread in between); None if it died, was
        stopped, or did not answer within REPLY_WAIT."""
        deadline = time.monotonic() + REPLY_WAIT
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        while time.monotonic() < deadline:
            if poll.poll(CHECK_EVERY * 1000):
                try:
                    msg, fds = _recv(sock, MAX_REPLY)
                except (OSError, ValueError):
                    return None
                for fd in fds:
                    os.close(fd)
                return msg
            if self._stopped():
                return None
        return None
