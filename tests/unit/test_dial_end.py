"""The agent's dial (a byte stream to a unix socket inside the sandbox: the interpreter's
driver) is no longer counted as running once the host can know it ended: it leaves
``agent.dials`` before its EOF is sent. A quiesce (pause, fork) the host sends after the EOF
then never finds it "still running" (the fork after a run_code in tests/e2e/test_interp.py
met that once in CI, the dial's thread not yet past its EOF)."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from pathlib import Path

from cpuos_agent import protocol as P
from cpuos_agent.agent import Agent
from cpuos_agent.conn import Conn
from cpuos_agent.dial import Dial
from cpuos_agent.protocol import Kind
from support.agent_link import HostEnd


class _Agent(Agent):
    """What a dial uses of the agent (its table of dials), without the agent's threads."""

    def __init__(self) -> None:  # (no key, reaper or guard: nothing runs here)
        self.dials = {}


class _Link(HostEnd):
    """The host's end: each frame the agent sends, with whether the dial is still counted
    at that moment."""

    def __init__(self, agent: Agent, sid: int) -> None:
        self.agent, self.sid = agent, sid
        self.seen: list[tuple[str, bool]] = []
        self.ended = threading.Event()

    def frame(self, h: P.Header, payload: bytes) -> None:
        self.seen.append((str(h["t"]), self.sid in self.agent.dials))
        if h["t"] in (Kind.EOF, Kind.ERR):
            self.ended.set()


def test_a_dial_leaves_the_agents_table_before_its_end_is_sent() -> None:
    d = Path(tempfile.mkdtemp(prefix="cpuos-dial-", dir="/tmp"))  # (a short socket path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(d / "s.sock"))
        srv.listen(1)

        def serve() -> None:  # the driver: reads the request, answers, closes
            c, _ = srv.accept()
            with c:
                c.recv(64)
                c.sendall(b'{"t":"done"}\n')

        threading.Thread(target=serve, daemon=True).start()
        agent = _Agent()
        link = _Link(agent, 7)
        Dial(agent, Conn(link), 7, {"t": Kind.DIAL, "path": str(d / "s.sock")},
             b'{"op":"run"}\n').start()
        assert link.ended.wait(10), link.seen
        assert link.seen[0] == (Kind.OK, True)  # counted while it runs
        assert (Kind.DATA, True) in link.seen
        assert link.seen[-1] == (Kind.EOF, False), link.seen  # not counted once it ends
        assert not agent.dials
    finally:
        srv.close()
        shutil.rmtree(d, ignore_errors=True)
