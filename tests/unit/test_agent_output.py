"""The agent's output loop (cpuos_agent.exec.Exec._run) gathers bulk output: after a read of
GATHER_AT bytes or more (less than GATHER_MAX) it leaves the pipes alone for GATHER, so what
the command writes meanwhile goes out in one message; output in small pieces is sent at
once, so is what follows a read of GATHER_MAX or more, and the command's exit ends the
wait. Driven here on real pipes, the agent's own loop and Conn, with
GATHER made long (30 s) so that nothing depends on timing."""

from __future__ import annotations

import fcntl
import functools
import os
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cpuos_agent import exec as agent_exec
from cpuos_agent import protocol as P
from cpuos_agent.agent import Agent
from cpuos_agent.conn import Conn
from cpuos_agent.exec import Exec
from cpuos_agent.protocol import Kind
from support.agent_link import HostEnd

SID = 5
LONG = 30.0  # GATHER in these tests: far longer than any of their waits


class _Agent(Agent):
    """What an exec's output loop uses of the agent, without the agent's threads."""

    def __init__(self) -> None:  # (no spawner, cgroups or guard: nothing runs here)
        self.execs = {}
        self.spawner = None
        self.cgroups = None
        self.memguard = None


class _Link(HostEnd):
    """The host's end: the payload of each ``out`` message, and the exit."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.exit = threading.Event()
        self.cv = threading.Condition()

    def frame(self, h: P.Header, payload: bytes) -> None:
        with self.cv:
            if h["t"] == Kind.OUT:
                self.out.append(payload)
            elif h["t"] == Kind.EXIT:
                self.exit.set()
            self.cv.notify_all()

    def until(self, cond: Callable[[], bool], timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(cond, timeout)

    def received(self) -> int:
        return sum(len(b) for b in self.out)


class _Command:
    """An exec whose output loop runs on pipes the test writes (the command's side)."""

    def __init__(self) -> None:
        self.link = _Link()
        conn = Conn(self.link)
        conn.open_stream(SID)
        self.ex = Exec(_Agent(), conn, SID, {"t": Kind.EXEC, "argv": ["x"]})
        out_r, self.out_w = os.pipe2(os.O_CLOEXEC)
        err_r, self.err_w = os.pipe2(os.O_CLOEXEC)
        fcntl.fcntl(out_r, agent_exec.F_SETPIPE_SZ, agent_exec.PIPE_SIZE)
        self.out_r = out_r
        self.ex._out = (out_r, err_r)
        self.ex._exit_r, self.ex._exit_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.ex.started = time.monotonic()
        self.loop = threading.Thread(target=self.ex._run, daemon=True)
        self.loop.start()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.out_w, view):]

    def unread(self) -> int:
        """Bytes in the stdout pipe that the loop has not read."""
        return int(struct.unpack("i", fcntl.ioctl(self.out_r, termios.FIONREAD, b"\0" * 4))[0])

    def exit(self) -> None:
        """The command ends: its pipes close, the reaper reports its status."""
        for fd in (self.out_w, self.err_w):
            os.close(fd)
        self.out_w = self.err_w = -1
        self.ex.status_box.append(0)
        self.ex.done_ev.set()
        self.ex._exited()

    def close(self) -> None:
        if self.out_w >= 0:
            self.exit()
        self.loop.join(10)


@pytest.fixture
def command(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Command]:
    monkeypatch.setattr(agent_exec, "GATHER", LONG)
    c = _Command()
    try:
        yield c
    finally:
        c.close()


def test_bulk_output_written_after_a_big_read_goes_out_in_one_message(command: _Command
                                                                      ) -> None:
    big = agent_exec.GATHER_AT + 4096
    command.write(b"a" * big)
    assert command.link.until(lambda: command.link.received() == big, 10)
    command.write(b"b" * 20000)
    # the loop leaves the pipe alone (without the gathering it reads this at once)
    assert not command.link.until(lambda: command.link.received() > big, 0.5)
    assert command.unread() == 20000
    command.write(b"c" * 20000)
    command.exit()  # (ends the wait: the rest is read at once)
    assert command.link.exit.wait(10)
    assert command.link.out[-1] == b"b" * 20000 + b"c" * 20000
    assert command.link.received() == big + 40000


def test_a_read_of_big_pieces_is_not_followed_by_a_wait(command: _Command) -> None:
    big = agent_exec.GATHER_MAX
    command.write(b"a" * big)
    assert command.link.until(lambda: command.link.received() == big, 10)
    command.write(b"b" * 20000)  # (read at once: its pipe could fill meanwhile)
    assert command.link.until(lambda: command.link.received() == big + 20000, 10)


def _count_is(link: _Link, n: int) -> bool:
    return len(link.out) == n


def test_small_pieces_are_sent_at_once(command: _Command) -> None:
    for i in range(1, 4):
        command.write(b"line %d\n" % i)
        assert command.link.until(functools.partial(_count_is, command.link, i), 10), i
    assert command.link.out == [b"line 1\n", b"line 2\n", b"line 3\n"]


def test_the_commands_exit_ends_the_wait(command: _Command) -> None:
    big = agent_exec.GATHER_AT
    command.write(b"a" * big)
    assert command.link.until(lambda: command.link.received() == big, 10)
    command.exit()
    assert command.link.exit.wait(10)  # not after GATHER (30 s)
