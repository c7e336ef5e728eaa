"""Commands: start one (argv or shell line), stream its output, report its exit, enforce
its timeout.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import fcntl
import os
import re
import selectors
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from . import protocol as P
from .conn import Conn
from .files import _errcode
from .reaper import kill_tree
from .transport import Closed

if TYPE_CHECKING:
    from .agent import Agent

EXEC_MARK = "CPUOS_EXEC_ID"


DRAIN_AFTER_EXIT = 0.25  # seconds to wait for pipe EOF once the main process exited


F_SETPIPE_SZ = 1031


PIPE_SIZE = 1 << 20


# A shell line made only of these, whose first word is not a shell builtin, runs without
# bash (saves a bash start, ~6 ms under gVisor); if the program is not found, bash runs it.
SIMPLE = re.compile(r"^[A-Za-z0-9_./,:+@%-]+( +[A-Za-z0-9_./,:=+@%-]+)*$")


SHELL_WORDS = {"cd", "export", "source", ".", "exit", "set", "unset", "alias", "exec", "eval",
               "read", "ulimit", "umask", "wait", "trap", "shopt", "type", "hash", "command",
               "builtin", "declare", "local", "let", "times", "jobs", "fg", "bg", "history"}


def _argv_for(h: P.Header) -> tuple[list[str], list[str] | None]:
    """(argv to try first, fallback argv) for an exec request."""
    shell = h.get("shell")
    if isinstance(shell, str):
        full = ["/bin/bash", "-c", shell]
        if SIMPLE.fullmatch(shell) and shell.split()[0] not in SHELL_WORDS:
            return shell.split(), full
        return full, None
    argv = h.get("argv")
    if isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv):
        return argv, None
    raise ValueError("exec needs 'shell' (a string) or 'argv' (a non-empty list of strings)")


class Exec:
    def __init__(self, agent: Agent, conn: Conn, sid: int, h: P.Header) -> None:
        self.agent, self.conn, self.sid, self.h = agent, conn, sid, h
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed_reason: str | None = None
        self._stdin_buf: list[bytes | None] = []
        self._stdin_cv = threading.Condition()

    def start(self) -> None:
        h = self.h
        try:
            argv, fallback = _argv_for(h)
        except ValueError as e:
            self.conn.send({"t": "err", "id": self.sid, "code": P.E_INVALID, "message": str(e)})
            return
        env = {k: v for k, v in (h.get("env") or {}).items()
               if isinstance(k, str) and isinstance(v, str)}
        self.mark = f"{EXEC_MARK}={self.sid}-{time.monotonic_ns()}"
        env[EXEC_MARK] = self.mark.split("=", 1)[1]
        cwd = h.get("cwd") or "/work"
        use_stdin = bool(h.get("stdin"))
        spawned_at = time.monotonic()
        while True:
            try:
                self.proc = subprocess.Popen(
                    argv, cwd=cwd, env=env,
                    stdin=subprocess.PIPE if use_stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, bufsize=0,
                )
                break
            except OSError as e:
                if fallback is not None and not os.path.isdir(cwd):
                    fallback = None
                if fallback is not None:
                    argv, fallback = fallback, None
                    continue
                self.conn.send({"t": "err", "id": self.sid, "code": _errcode(e),
                                "message": f"cannot start {argv[0]!r} in {cwd!r}: {e.strerror}"})
                return
        for f in (self.proc.stdout, self.proc.stderr):
            try:  # bigger pipes: fewer, larger reads and frames for chatty commands
                fcntl.fcntl(f.fileno(), F_SETPIPE_SZ, PIPE_SIZE)  # type: ignore[union-attr]
            except OSError:
                pass
        self.started = time.monotonic()
        self.done_ev, self.status_box = self.agent.reaper.register(self.proc.pid, spawned_at)
        self.conn.open_stream(self.sid)
        self.agent.execs[self.sid] = self
        self.conn.send({"t": "started", "id": self.sid, "pid": self.proc.pid})
        if use_stdin:
            threading.Thread(target=self._stdin_pump, daemon=True).start()
        threading.Thread(target=self._run, name=f"exec-{self.sid}", daemon=True).start()

    # stdin frames arrive on the reader thread; a pump thread writes them (a full pipe must
    # never block the reader).
    def feed_stdin(self, data: bytes | None) -> None:
        with self._stdin_cv:
            self._stdin_buf.append(data)
            self._stdin_cv.notify()

    def _stdin_pump(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        while True:
            with self._stdin_cv:
                while not self._stdin_buf:
                    self._stdin_cv.wait()
                data = self._stdin_buf.pop(0)
            try:
                if data is None:
                    self.proc.stdin.close()
                    return
                self.proc.stdin.write(data)
            except OSError:
                return

    def kill(self, reason: str) -> None:
        if self.proc is None or self.done_ev.is_set():
            return
        if self.killed_reason is None:
            self.killed_reason = reason
        kill_tree(self.proc.pid, self.mark.encode())

    def _run(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        timeout = self.h.get("timeout")
        deadline = self.started + float(timeout) if timeout else None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 1)
        sel.register(proc.stderr, selectors.EVENT_READ, 2)
        open_fds = 2
        exited_at: float | None = None
        try:
            while open_fds:
                now = time.monotonic()
                if exited_at is None and self.done_ev.is_set():
                    exited_at = now
                if exited_at is not None and now - exited_at > DRAIN_AFTER_EXIT:
                    break  # background processes keep the pipes; the command itself is done
                if deadline is not None and exited_at is None and now >= deadline:
                    self.kill("timeout")
                    deadline = None
                wait = 0.05
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - now))
                for key, _ in sel.select(wait):
                    f = key.fileobj
                    try:
                        data = os.read(f.fileno(), PIPE_SIZE)  # type: ignore[union-attr]
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(f)
                        open_fds -= 1
                        continue
                    self.conn.send_data(self.sid, {"t": "out", "id": self.sid, "fd": key.data},
                                        data)
            if not self.done_ev.wait(timeout=None if deadline is None else
                                     max(0.0, deadline - time.monotonic())):
                self.kill("timeout")
                self.done_ev.wait()
            status = self.status_box[0]
            code = os.waitstatus_to_exitcode(status)
            sig = -code if code < 0 else None
            # done before the host hears of it: a quiesce right after must not see it
            self.agent.execs.pop(self.sid, None)
            self.conn.send({
                "t": "exit", "id": self.sid,
                "exit_code": 128 + sig if sig else code, "signal": sig,
                "timed_out": self.killed_reason == "timeout",
                "killed": self.killed_reason is not None,
                "duration": time.monotonic() - self.started,
            })
        except Closed:
            self.kill("disconnected")
        finally:
            sel.close()
            for f in (proc.stdout, proc.stderr):
                f.close()
            self.conn.close_stream(self.sid)
            self.agent.execs.pop(self.sid, None)
