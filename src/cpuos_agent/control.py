"""The session's own messages: ``ping``, ``identity``, ``memory``, ``quiesce``, ``credit``
and ``kill`` (which ends whatever the stream is: a command, a background read, a watch,
a stdin sender, a file read or tar, a dial).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import protocol as P
from .identity import apply_identity
from .protocol import ErrorCode, Kind
from .transport import Quiesce

if TYPE_CHECKING:
    from .agent import Agent, Handler
    from .conn import Conn


def ping(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    conn.send({"t": Kind.PONG, "id": sid, "time": time.time()})


def identity(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    applied = apply_identity(h)
    limit = h.get("memory_limit")
    if agent.memguard is not None and isinstance(limit, int):
        agent.memguard.set_limit(limit)
        applied.append("memory_limit")
    idle_exit = h.get("spawner_idle_exit")
    if (agent.spawner is not None and isinstance(idle_exit, (int, float))
            and 0 <= idle_exit <= 86400):
        agent.spawner.set_idle_exit(float(idle_exit))
        applied.append("spawner_idle_exit")
    conn.send({"t": Kind.IDENTITY_OK, "id": sid, "applied": applied})


def memory(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    """The host's watch on the sandbox's memory (memguard.py); unanswered."""
    if agent.memguard is not None:
        agent.memguard.host(h.get("watched") is True, h.get("high") is True)


def quiesce(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    if agent.execs or agent.writes or agent.dials:
        conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.EXISTS,
                   "message": "commands or file transfers are still running"})
        return
    conn.send({"t": Kind.OK, "id": sid})
    raise Quiesce()


def credit(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    conn.add_credit(sid, int(h.get("n", 0)))


def kill(agent: Agent, conn: Conn, sid: int, h: P.Header, payload: bytes) -> None:
    ex = agent.execs.get(sid)
    if ex is not None:
        ex.kill(str(h.get("reason") or "killed"))
    elif sid in agent.readers:
        agent.readers.pop(sid).cancel()
    elif sid in agent.watches:
        agent.watches.pop(sid).cancel()
    elif sid in agent.stdin_to:
        agent.stdin_to.pop(sid).drop_stdin(sid)
    else:  # a file read or a dial the host gave up on: its sender stops
        d = agent.dials.get(sid)
        if d is not None:
            d.close()
        conn.close_stream(sid)


HANDLERS: dict[Kind, Handler] = {
    Kind.PING: ping,
    Kind.IDENTITY: identity,
    Kind.MEMORY: memory,
    Kind.QUIESCE: quiesce,
    Kind.CREDIT: credit,
    Kind.KILL: kill,
}
