"""Commands: ``exec`` starts one (argv or shell line), streams its output, reports its
exit, enforces its timeout; ``stdin`` feeds it (or a background command: ``bg_stdin``).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import selectors
import threading
import time
from typing import TYPE_CHECKING

from . import protocol as P
from .bg import Background
from .conn import Conn
from .privs import root_mode
from .protocol import ErrorCode, Kind
from .reaper import kill_tree
from .service import errcode
from .spawner import popen
from .terminal import set_winsize
from .transport import Closed

if TYPE_CHECKING:
    from .agent import Agent, Handler
    from .cgroups import Cgroup

EXEC_MARK = "CPUOS_EXEC_ID"


DRAIN_AFTER_EXIT = 0.25  # seconds to wait for pipe EOF once the main process exited


F_SETPIPE_SZ = 1031


PIPE_SIZE = 1 << 20
# A command writing its output in bulk in small writes (a read took GATHER_AT bytes or more,
# less than GATHER_MAX) is read again only GATHER s later: that read takes what it wrote
# meanwhile (its pipe holds PIPE_SIZE), so its output goes out in fewer, bigger messages.
# Every read, message and wakeup costs the sandbox (systrap's switches): ``head -c
# 64M /dev/zero`` (8 KiB writes) streamed 67 -> 115 MB/s straight from a node, 40 -> 100 MB/s
# through the API tier, the sandbox's CPU 16-21 -> 8-9 ms per MB (bench/README.md, many
# hosts). Output in small pieces (a line, a prompt) is sent at once, so is a read of
# GATHER_MAX or more (the command writes big pieces already: waiting would only let its pipe
# fill), and the command's exit ends the wait.
GATHER_AT = 16 << 10
GATHER_MAX = 256 << 10
GATHER = 0.002


# A shell line made only of these, whose first word is not a shell builtin, runs without
# bash (saves a bash start, ~6 ms under gVisor); if the program is not found, bash runs it.
SIMPLE = re.compile(r"^[A-Za-z0-9_./,:+@%-]+( +[A-Za-z0-9_./,:=+@%-]+)*$")


SHELL_WORDS = {"cd", "export", "source", ".", "exit", "set", "unset", "alias", "exec", "eval",
               "read", "ulimit", "umask", "wait", "trap", "shopt", "type", "hash", "command",
               "builtin", "declare", "local", "let", "times", "jobs", "fg", "bg", "history"}


def _argv_for(h: P.Header) -> list[list[str]]:
    """The argvs to try, in order, for an exec request."""
    shell = h.get("shell")
    if isinstance(shell, str):
        full = ["/bin/bash", "-c", shell]
        if SIMPLE.fullmatch(shell) and shell.split()[0] not in SHELL_WORDS:
            return [shell.split(), full]
        return [full]
    argv = h.get("argv")
    if isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv):
        return [argv]
    raise ValueError("exec needs 'shell' (a string) or 'argv' (a non-empty list of strings)")


# background commands: how many may run at once, and how many ended ones are remembered
MAX_BG_RUNNING = 64
MAX_BG_KEPT = 64
DEFAULT_BG_BUFFER = 1 << 20
MAX_BG_BUFFER = 64 << 20


StdinItem = tuple[Conn | None, int, bytes, bool, bool]  # (conn, stream, data, close, ack)


class Exec:
    """One command: started in a thread of its own (starting may wait on the spawner),
    registered at once (stdin and kill frames that arrive meanwhile are kept).

    A *background* command (``background`` in the request) is not the stream's: the
    stream gets ``started`` (with the pid) and ends; the process outlives the connection,
    its output goes to a ring (``bg.Background``) that readers attach to, by pid."""

    def __init__(self, agent: Agent, conn: Conn, sid: int, h: P.Header) -> None:
        self.agent, self.conn, self.sid, self.h = agent, conn, sid, h
        self.pid: int | None = None
        self.cgroup: Cgroup | None = None
        self.killed_reason: str | None = None
        self.done_ev = threading.Event()
        self.status_box: list[int] = []
        self._stdin_buf: list[StdinItem] = []
        self._stdin_cv = threading.Condition()
        self._stdin_w: int | None = None
        # requested and not yet spawned: what arrives is kept for when it is
        self.stdin_open = bool(h.get("stdin"))
        self.background = bool(h.get("background"))
        self.pty_fd: int | None = None  # a terminal's master (for resizes)
        self.bg: Background | None = None
        self._out: tuple[int, int] | None = None
        # written when the exit status arrives: the output loop sleeps on it and the pipes
        self._exit_r, self._exit_w = -1, -1
        self._exit_lock = threading.Lock()  # the reaper's thread writes, ours closes

    def start(self) -> None:
        try:
            self.argvs = _argv_for(self.h)
        except ValueError as e:
            self.conn.send({"t": Kind.ERR, "id": self.sid, "code": ErrorCode.INVALID,
                            "message": str(e)})
            return
        if self.background:
            running = sum(1 for b in self.agent.bg.values() if b.result is None)
            if running >= MAX_BG_RUNNING:
                self.conn.send({"t": Kind.ERR, "id": self.sid, "code": ErrorCode.LIMIT,
                                "message": f"{running} background commands are running "
                                f"(at most {MAX_BG_RUNNING})"})
                return
            cap = self.h.get("buffer")
            cap = cap if isinstance(cap, int) and 0 < cap <= MAX_BG_BUFFER \
                else DEFAULT_BG_BUFFER
            shell = self.h.get("shell")
            cmd = shell if isinstance(shell, str) else " ".join(self.argvs[0])
            self.bg = Background(self, cmd, cap)
        self.agent.execs[self.sid] = self
        if self.agent.memguard is not None:
            self.agent.memguard.wake()
        threading.Thread(target=self._main, name=f"exec-{self.sid}", daemon=True).start()

    def _main(self) -> None:
        try:
            err = self._spawn()
        except BaseException as e:  # never leave the exec registered
            err = {"code": ErrorCode.INTERNAL, "message": f"{type(e).__name__}: {e}"}
        if err is not None:
            self.agent.execs.pop(self.sid, None)
            if self.cgroup is not None and self.agent.cgroups is not None:
                self.agent.cgroups.kill(self.cgroup)  # whatever started, untracked: gone
                self.agent.cgroups.release(self.cgroup)
            try:
                self.conn.send({"t": Kind.ERR, "id": self.sid, **err})
            except Closed:
                pass
            return
        if self.bg is not None:
            # the agent's now, not the stream's: a disconnect or quiesce leaves it running
            self.agent.add_bg(self.bg)
            self.agent.execs.pop(self.sid, None)
            try:
                self.conn.send({"t": Kind.STARTED, "id": self.sid, "pid": self.pid,
                                "background": True})
            except Closed:
                pass
        else:
            try:
                self.conn.open_stream(self.sid)
                self.conn.send({"t": Kind.STARTED, "id": self.sid, "pid": self.pid})
            except Closed:
                self.kill("disconnected")
        if self.killed_reason is not None:  # a kill that came while it was starting
            self._kill_now()
        if self._stdin_w is not None:
            threading.Thread(target=self._stdin_pump, daemon=True).start()
        if self.agent.cgroups is not None:
            try:
                self.agent.cgroups.refill()  # the next exec's, while this one runs
            except OSError:
                pass
        self._run()

    def _spawn(self) -> dict[str, str] | None:
        """Start the command; None, or the error to send."""
        h = self.h
        env = {k: v for k, v in (h.get("env") or {}).items()
               if isinstance(k, str) and isinstance(v, str)}
        self.mark = f"{EXEC_MARK}={self.sid}-{time.monotonic_ns()}"
        env[EXEC_MARK] = self.mark.split("=", 1)[1]
        cwd = h.get("cwd") or "/work"
        if not isinstance(cwd, str):
            return {"code": ErrorCode.INVALID, "message": "cwd must be a string"}
        cgroups = self.agent.cgroups
        if cgroups is not None:
            try:
                self.cgroup = cgroups.take()
            except OSError:
                self.cgroup = None  # tracked by the process-tree scan instead
        term = h.get("pty")
        if isinstance(term, dict):
            # a terminal: the command's stdin, stdout and stderr are a pty's slave, in a
            # session of its own whose controlling terminal it is (setsid -c: job control,
            # ^C, SIGWINCH); its output is what the master reads, its input what we write
            master, slave = os.openpty()
            set_winsize(master, term.get("cols"), term.get("rows"))
            out_r, out_w = master, slave
            err_r, w = os.pipe2(os.O_CLOEXEC)
            os.close(w)  # nothing comes this way: EOF at once
            err_w, in_r = os.dup(slave), os.dup(slave)
            self._stdin_w, self.pty_fd = os.dup(master), os.dup(master)
            self.stdin_open = True
            self.argvs = [["setsid", "-w", "-c", *a] for a in self.argvs]
        else:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            if h.get("stdin"):
                in_r, self._stdin_w = os.pipe2(os.O_CLOEXEC)
            else:
                in_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        for fd in (out_r, err_r, self._stdin_w):
            if fd is None:
                continue
            try:  # bigger pipes: fewer, larger reads and frames for chatty commands
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass
        spawned_at = time.monotonic()
        fds = (in_r, out_w, err_w)
        lost: threading.Event | None = None
        try:
            if self.agent.spawner is not None:
                pid, lost = self.agent.spawner.spawn(self.argvs, cwd, env, fds, self.cgroup)
            elif root_mode():  # a child of ours would have real uid 0: never
                raise OSError(errno.EAGAIN, "no command spawner")
            else:
                pid = popen(self.argvs, cwd, env, fds)
        except OSError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            if self._stdin_w is not None:
                os.close(self._stdin_w)
                self._stdin_w = None
                self.stdin_open = False
            if self.pty_fd is not None:
                os.close(self.pty_fd)
                self.pty_fd = None
            if e.errno == errno.EAGAIN:  # a fork past the sandbox's process limit
                return {"code": ErrorCode.LIMIT, "message": f"cannot start {self.argvs[0][0]!r}: "
                        f"the sandbox is at its process limit (pids)"}
            return {"code": errcode(e), "message":
                    f"cannot start {self.argvs[0][0]!r} in {cwd!r}: {e.strerror or e}"}
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.pid = pid
        self._out = (out_r, err_r)
        self._exit_r, self._exit_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.started = time.monotonic()
        self.done_ev, self.status_box = self.agent.reaper.register(self.pid, spawned_at,
                                                                   self._exited)
        if lost is not None and lost.is_set():
            # its spawner died after reaping it and before reporting it, and before we
            # registered (the reaper's settle_lost ran too early to see it)
            self.agent.reaper.settle_lost(only=pid)
        return None

    def _exited(self) -> None:
        with self._exit_lock:
            if self._exit_w >= 0:  # (closed: the output loop is over)
                os.write(self._exit_w, b"x")

    # stdin frames arrive on the reader thread; a pump thread writes them (a full pipe must
    # never block the reader). Flow control: after each write the pump gives the sending
    # stream its bytes back (``stdin_credit``): the host keeps at most P.STDIN_WINDOW bytes
    # in flight per stream, so what waits here is bounded by the host, and a slow reader
    # inside slows the producer outside.
    def feed_stdin(self, conn: Conn | None, sid: int, data: bytes, close: bool = False,
                   ack: bool = False) -> None:
        """Queue data for the command's stdin (from stream sid of conn); ``close``: then
        close it; ``ack``: then answer the stream ``ok`` (``written``: bytes so far)."""
        with self._stdin_cv:
            if not self.stdin_open:
                pending = False
            else:
                self._stdin_buf.append((conn, sid, data, close, ack))
                self._stdin_cv.notify()
                pending = True
        if not pending:
            self._fail_stdin(conn, sid, "the command's stdin is closed" if self.pid
                             else "the command was started without stdin", ack)

    def drop_stdin(self, sid: int) -> None:
        """A stream the host gave up on: what it queued and was not written is dropped."""
        with self._stdin_cv:
            self._stdin_buf = [it for it in self._stdin_buf if it[1] != sid]

    def _stdin_end(self) -> None:
        with self._stdin_cv:
            self._stdin_buf.append((None, 0, b"", True, False))
            self._stdin_cv.notify()

    def _stdin_pump(self) -> None:
        fd = self._stdin_w
        assert fd is not None
        written = 0
        failed: str | None = None
        try:
            while True:
                with self._stdin_cv:
                    while not self._stdin_buf:
                        self._stdin_cv.wait()
                    conn, sid, data, close, ack = self._stdin_buf.pop(0)
                if data:
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view):]
                    except OSError as e:
                        failed = f"writing to the command's stdin: {e.strerror or e}"
                        self._fail_stdin(conn, sid, failed, ack)
                        return
                    written += len(data)
                    if conn is not None:
                        with contextlib.suppress(Closed):
                            conn.send({"t": Kind.STDIN_CREDIT, "id": sid, "n": len(data)})
                if ack and conn is not None:
                    with contextlib.suppress(Closed):
                        conn.send({"t": Kind.OK, "id": sid, "written": written,
                                   "closed": close})
                if close:
                    return
        finally:
            with self._stdin_cv:
                self.stdin_open = False
                rest, self._stdin_buf = self._stdin_buf, []
            os.close(fd)
            for conn, sid, _, _, ack in rest:
                self._fail_stdin(conn, sid, failed or "the command's stdin is closed", ack)

    @staticmethod
    def _fail_stdin(conn: Conn | None, sid: int, message: str, ack: bool) -> None:
        """Tell stream sid its stdin is gone (``stdin_closed``: its sender stops waiting for
        credit); an ``ack`` it asked for is an error."""
        if conn is None:
            return
        with contextlib.suppress(Closed):
            conn.send({"t": Kind.STDIN_CLOSED, "id": sid, "message": message})
            if ack:
                conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.INVALID, "message": message})

    def kill(self, reason: str) -> None:
        if self.done_ev.is_set():
            return
        if self.killed_reason is None:
            self.killed_reason = reason
        if self.pid is not None:
            self._kill_now()

    def _kill_now(self) -> None:
        """Every process of the exec: its cgroup, or (without one) its process tree."""
        assert self.pid is not None
        cgroups = self.agent.cgroups
        if self.cgroup is not None and cgroups is not None:
            cgroups.kill(self.cgroup)
        else:
            kill_tree(self.pid, self.mark.encode())

    def _run(self) -> None:
        """Output until the pipes close (or, once the command exited, DRAIN_AFTER_EXIT more:
        background processes may hold them), then the exit. Event-driven: it sleeps on the
        pipes and on the exit notice, woken only by output, the exit or its deadline."""
        assert self._out is not None
        out_r, err_r = self._out
        timeout = self.h.get("timeout")
        deadline = self.started + float(timeout) if timeout else None
        sel = selectors.DefaultSelector()
        sel.register(out_r, selectors.EVENT_READ, 1)
        sel.register(err_r, selectors.EVENT_READ, 2)
        sel.register(self._exit_r, selectors.EVENT_READ, 0)
        open_fds = 2
        exited_at: float | None = None
        try:
            while open_fds:
                now = time.monotonic()
                if exited_at is None and self.done_ev.is_set():
                    exited_at = now
                    sel.unregister(self._exit_r)
                if exited_at is not None and now - exited_at > DRAIN_AFTER_EXIT:
                    break  # background processes keep the pipes; the command itself is done
                if deadline is not None and exited_at is None and now >= deadline:
                    self.kill("timeout")
                    deadline = None
                wait: float | None = None
                if exited_at is not None:
                    wait = max(0.0, exited_at + DRAIN_AFTER_EXIT - now)
                elif deadline is not None:
                    wait = max(0.0, deadline - now)
                for key, _ in sel.select(wait):
                    fd = key.fd
                    if key.data == 0:  # the exit notice
                        continue
                    try:
                        data = os.read(fd, PIPE_SIZE)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(fd)
                        open_fds -= 1
                        continue
                    if self.bg is not None:
                        self.bg.output(key.data, data)
                    else:
                        self.conn.send_data(self.sid, {"t": Kind.OUT, "id": self.sid,
                                                       "fd": key.data}, data)
                    if GATHER_AT <= len(data) < GATHER_MAX and exited_at is None:
                        self.done_ev.wait(GATHER)  # (its exit ends the wait)
            while not self.done_ev.wait(None if deadline is None
                                        else max(0.0, deadline - time.monotonic())):
                self.kill("timeout")
                deadline = None
            status = self.status_box[0]
            code = os.waitstatus_to_exitcode(status)
            sig = -code if code < 0 else None
            # done before the host hears of it: a quiesce right after must not see it
            self.agent.execs.pop(self.sid, None)
            result = {
                "exit_code": 128 + sig if sig else code, "signal": sig,
                "timed_out": self.killed_reason == "timeout",
                "killed": self.killed_reason is not None,
                # ended at the sandbox's memory limit (memguard, or a guest kernel's OOM
                # killer)
                "oom": self.killed_reason == "oom" or (
                    self.cgroup is not None and self.agent.cgroups is not None
                    and self.agent.cgroups.oom_killed(self.cgroup)),
                "duration": time.monotonic() - self.started,
            }
            if self.bg is not None:
                self.bg.finish(result)
            else:
                self.conn.send({"t": Kind.EXIT, "id": self.sid, **result})
        except Closed:
            self.kill("disconnected")
        finally:
            sel.close()
            for fd in (out_r, err_r):
                os.close(fd)
            with self._exit_lock:
                os.close(self._exit_r)
                os.close(self._exit_w)
                self._exit_r = self._exit_w = -1
            if self.pty_fd is not None:
                os.close(self.pty_fd)
                self.pty_fd = None
            if self.bg is None:
                self.conn.close_stream(self.sid)
            elif self.bg.result is None:  # ended without a status (an error of ours)
                self.bg.finish({"exit_code": -1, "signal": None, "timed_out": False,
                                "killed": True, "duration": time.monotonic() - self.started})
            self.agent.execs.pop(self.sid, None)
            if self._stdin_w is not None:
                self._stdin_end()  # a pump still waiting for stdin ends
            if self.cgroup is not None and self.agent.cgroups is not None:
                self.agent.cgroups.release(self.cgroup)
            if self.agent.memguard is not None:  # processes it left: guarded on
                self.agent.memguard.wake()
            if self.agent.spawner is not None:
                self.agent.spawner.idle()


# ---- the requests ---------------------------------------------------------------------
def exec_(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    Exec(agent, conn, sid, h).start()


def stdin(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    """Bytes for the stream's command, or for the background command the stream was made
    a stdin sender to (``bg_stdin``); ``close`` ends its stdin, ``ack`` asks for an ``ok``
    once written (and ends the sender)."""
    ex = agent.execs.get(sid) or agent.stdin_to.get(sid)
    if ex is not None:
        ack = h.get("ack") is True
        ex.feed_stdin(conn, sid, payload, close=h.get("close") is True, ack=ack)
        if ack:
            agent.stdin_to.pop(sid, None)


HANDLERS: dict[Kind, Handler] = {
    Kind.EXEC: exec_,
    Kind.STDIN: stdin,
}
