"""The guest protocol's messages, one typed structure each (what ``cpuos_agent.protocol``'s
``Kind`` names), and the kinds of the two other framed streams: the daemon's to its
clients (``Frame``) and the code interpreter's driver's (``InterpKind``).

A message is a JSON object on the wire, so each is a ``TypedDict``: the sender builds a
plain dict, type-checked. ``id`` (the stream) is set by the sender's stream (host) or
given explicitly (agent). The receiver trusts none of it: the agent checks every field
of a request it acts on, the host every field of an answer (an agent's answer is what
code inside the sandbox may have forged); so the handlers take ``protocol.Header`` and
these types document what a well-behaved peer sends.

Stdlib only, and not imported by the agent at run time (type checking only: every class
here would be memory in every sandbox; tests/unit/test_agent_imports.py checks).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict

from .protocol import ErrorCode, Kind


class _Msg(TypedDict):
    """``id``: the stream (every answer carries it; a host's stream sets it on what it
    sends, ``Stream.send``)."""
    id: NotRequired[int]


# ---- the session ---------------------------------------------------------------------


class Hello(_Msg):
    """agent -> host, the first frame of every connection (at most 4 KiB, no payload)."""
    t: Literal[Kind.HELLO]
    version: int  # protocol.PROTOCOL_VERSION
    pid: int
    uid: int  # the effective uid it acts as (the commands')
    ruid: int  # 0 in root mode
    transport: str
    key: str  # the per-sandbox agent key
    tracking: str  # "cgroup-v1", "cgroup-v2" or "tree-scan"


class Ping(_Msg):
    t: Literal[Kind.PING]


class Pong(_Msg):
    t: Literal[Kind.PONG]
    time: float


class Identity(_Msg):
    """New for every boot, restore and clone (identity.apply_identity)."""
    t: Literal[Kind.IDENTITY]
    hostname: NotRequired[str]
    machine_id: NotRequired[str]
    seed: NotRequired[str]
    time: NotRequired[float]
    ca: NotRequired[str | None]  # a PEM (anything else is ignored)
    net: NotRequired[dict[str, Any]]  # a VM's interface: address, gateway, prefix
    memory_limit: NotRequired[int]  # bytes (gVisor: memguard's limit)
    spawner_idle_exit: NotRequired[float]


class IdentityOk(_Msg):
    t: Literal[Kind.IDENTITY_OK]
    applied: list[str]


class Memory(_Msg):
    """host -> agent on id 0, unanswered: the host watches the sandbox's memory."""
    t: Literal[Kind.MEMORY]
    watched: bool
    high: bool


class Quiesce(_Msg):
    """Answered OK (then the agent hangs up) or ERR (commands or transfers running)."""
    t: Literal[Kind.QUIESCE]


class Credit(_Msg):
    t: Literal[Kind.CREDIT]
    n: int


class Kill(_Msg):
    t: Literal[Kind.KILL]
    reason: NotRequired[str]


class Ok(_Msg):
    """The answer to a request; its fields are the request's (stat, size, pid...)."""
    t: Literal[Kind.OK]


class Err(_Msg):
    t: Literal[Kind.ERR]
    code: ErrorCode
    message: str


# ---- commands ------------------------------------------------------------------------


class Exec(_Msg):
    """``shell`` (a bash line) or ``argv``; answered STARTED (pid), then OUT..., EXIT (a
    background one: STARTED with ``background`` and the stream ends)."""
    t: Literal[Kind.EXEC]
    shell: NotRequired[str]
    argv: NotRequired[list[str]]
    env: NotRequired[dict[str, str]]
    cwd: NotRequired[str]
    timeout: NotRequired[float | None]
    stdin: NotRequired[bool]
    background: NotRequired[bool]
    buffer: NotRequired[int | None]  # a background command's output ring, bytes
    pty: NotRequired[dict[str, int] | None]  # {cols, rows}: a terminal


def command(cmd: str | list[str]) -> Exec:
    """An exec of cmd: a shell line, or an argv."""
    return Exec(t=Kind.EXEC, shell=cmd) if isinstance(cmd, str) else Exec(t=Kind.EXEC, argv=cmd)


class Started(_Msg):
    t: Literal[Kind.STARTED]
    pid: int
    background: NotRequired[bool]


class Out(_Msg):
    """Output bytes in the payload; ``off`` in a background read (its offset)."""
    t: Literal[Kind.OUT]
    fd: int
    off: NotRequired[int]


class Exit(_Msg):
    t: Literal[Kind.EXIT]
    exit_code: int
    signal: int | None
    timed_out: bool
    killed: bool
    oom: NotRequired[bool]
    duration: float
    next: NotRequired[int]  # a background read's next offset


class Stdin(_Msg):
    """Bytes in the payload; ``close`` ends the stdin, ``ack`` asks for an OK."""
    t: Literal[Kind.STDIN]
    close: NotRequired[bool]
    ack: NotRequired[bool]


class StdinCredit(_Msg):
    t: Literal[Kind.STDIN_CREDIT]
    n: int


class StdinClosed(_Msg):
    t: Literal[Kind.STDIN_CLOSED]
    message: str


# ---- background commands and terminals ----------------------------------------------


class BgList(_Msg):
    """Answered OK with ``n`` and the infos as a JSON array in the payload."""
    t: Literal[Kind.BG_LIST]


class BgInfo(_Msg):
    t: Literal[Kind.BG_INFO]
    pid: int


class BgAttach(_Msg):
    """Answered OK (pid, start, end, offset, running), OUT... then EXIT or EOF (next)."""
    t: Literal[Kind.BG_ATTACH]
    pid: int
    offset: int
    follow: bool


class BgResize(_Msg):
    t: Literal[Kind.BG_RESIZE]
    pid: int
    cols: int
    rows: int


class BgSignal(_Msg):
    t: Literal[Kind.BG_SIGNAL]
    pid: int
    signal: int


class BgWait(_Msg):
    t: Literal[Kind.BG_WAIT]
    pid: int
    timeout: float


class BgStdin(_Msg):
    """The stream becomes a stdin sender to the command (its STDIN frames)."""
    t: Literal[Kind.BG_STDIN]
    pid: int


# ---- files ---------------------------------------------------------------------------


class Write(_Msg):
    """Then DATA... and EOF (``abort``: dropped); answered OK (stat) or ERR."""
    t: Literal[Kind.WRITE]
    path: str


class Data(_Msg):
    """Bytes in the payload (a file, a tar, a dial's stream)."""
    t: Literal[Kind.DATA]


class Eof(_Msg):
    t: Literal[Kind.EOF]
    abort: NotRequired[bool]  # host -> agent: drop the file being written
    next: NotRequired[int]  # a background read's next offset


class Read(_Msg):
    """Answered OK (size, exact), DATA..., EOF or ERR."""
    t: Literal[Kind.READ]
    path: str


class PathRequest(_Msg):
    """STAT, MKDIR (answered OK with ``stat``), LIST (OK, ``n``, the entries as JSON in
    the payload), TAR (as a read)."""
    t: Literal[Kind.STAT, Kind.MKDIR, Kind.LIST, Kind.TAR]
    path: str


class Remove(_Msg):
    t: Literal[Kind.REMOVE]
    path: str
    recursive: NotRequired[bool]  # (default true)


class Untar(_Msg):
    """An uploaded archive extracted into path; answered OK (``extracted``) or ERR."""
    t: Literal[Kind.UNTAR]
    archive: str
    path: str


class Watch(_Msg):
    """Answered OK (``watches``), EVENTS... (JSON in the payload), EOF or ERR."""
    t: Literal[Kind.WATCH]
    path: str
    recursive: bool


class Events(_Msg):
    t: Literal[Kind.EVENTS]
    n: int
    overflow: bool


class Dial(_Msg):
    """The request's bytes in the payload; answered OK, DATA..., EOF or ERR."""
    t: Literal[Kind.DIAL]
    path: str


# ---- the daemon's streams to its clients (application/x-cpuos-frames) ---------------


class Frame(StrEnum):
    """What a client stream (exec output, a file read, a watch, a background read, a
    run_code) carries; decoded by both SDKs."""

    STARTED = "started"  # exec_id
    ATTACHED = "attached"  # a background command's stream: pid, start, end, offset
    OUT = "out"  # fd (off); the bytes in the payload
    CUT = "cut"  # run_code: output dropped from the middle
    EXIT = "exit"
    DATA = "data"
    EOF = "eof"
    ERROR = "error"  # code, message (the stream failed)
    WATCHING = "watching"
    EVENTS = "events"
    ITEM = "item"  # run_code: a display item
    EXCEPTION = "exception"  # run_code: the cell raised
    DONE = "done"  # run_code: the cell ended


# ---- the code interpreter's driver (cpuos_agent.interp_driver), JSON lines over a dial


class InterpKind(StrEnum):
    STREAM = "stream"
    CUT = "cut"
    DISPLAY = "display"
    ERROR = "error"
    DONE = "done"


# What the host sends the agent (``cpuosd.agentconn``'s send, call and open_stream take
# only these).
Request = (Ping | Identity | Memory | Quiesce | Credit | Kill | Exec | Stdin | BgList | BgInfo
           | BgAttach | BgResize | BgSignal | BgWait | BgStdin | Write | Data | Eof | Read
           | PathRequest | Remove | Untar | Watch | Dial)
