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

# ---- the session ---------------------------------------------------------------------


class Hello(TypedDict):
    """agent -> host, the first frame of every connection (at most 4 KiB, no payload)."""
    t: Literal[Kind.HELLO]
    version: int  # protocol.PROTOCOL_VERSION
    pid: int
    uid: int  # the effective uid it acts as (the commands')
    ruid: int  # 0 in root mode
    transport: str
    key: str  # the per-sandbox agent key
    tracking: str  # "cgroup-v1", "cgroup-v2" or "tree-scan"


class Ping(TypedDict):
    t: Literal[Kind.PING]
    id: NotRequired[int]


class Pong(TypedDict):
    t: Literal[Kind.PONG]
    id: int
    time: float


class Identity(TypedDict, total=False):
    """New for every boot, restore and clone (identity.apply_identity)."""
    t: Literal[Kind.IDENTITY]
    hostname: str
    machine_id: str
    seed: str
    time: float
    ca: str
    net: dict[str, Any]  # a VM's interface: address, gateway, prefix
    memory_limit: int  # bytes (gVisor: memguard's limit)
    spawner_idle_exit: float


class IdentityOk(TypedDict):
    t: Literal[Kind.IDENTITY_OK]
    id: int
    applied: list[str]


class Memory(TypedDict):
    """host -> agent on id 0, unanswered: the host watches the sandbox's memory."""
    t: Literal[Kind.MEMORY]
    id: int
    watched: bool
    high: bool


class Quiesce(TypedDict):
    """Answered OK (then the agent hangs up) or ERR (commands or transfers running)."""
    t: Literal[Kind.QUIESCE]


class Credit(TypedDict):
    t: Literal[Kind.CREDIT]
    id: int
    n: int


class Kill(TypedDict):
    t: Literal[Kind.KILL]
    id: int
    reason: NotRequired[str]


class Ok(TypedDict, total=False):
    """The answer to a request; its fields are the request's (stat, size, pid...)."""
    t: Literal[Kind.OK]
    id: int


class Err(TypedDict):
    t: Literal[Kind.ERR]
    id: int
    code: ErrorCode
    message: str


# ---- commands ------------------------------------------------------------------------


class Exec(TypedDict, total=False):
    """``shell`` (a bash line) or ``argv``; answered STARTED (pid), then OUT..., EXIT (a
    background one: STARTED with ``background`` and the stream ends)."""
    t: Literal[Kind.EXEC]
    shell: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    timeout: float | None
    stdin: bool
    background: bool
    buffer: int | None  # a background command's output ring, bytes
    pty: dict[str, int] | None  # {cols, rows}: a terminal


class Started(TypedDict):
    t: Literal[Kind.STARTED]
    id: int
    pid: int
    background: NotRequired[bool]


class Out(TypedDict):
    """Output bytes in the payload; ``off`` in a background read (its offset)."""
    t: Literal[Kind.OUT]
    id: int
    fd: int
    off: NotRequired[int]


class Exit(TypedDict):
    t: Literal[Kind.EXIT]
    id: int
    exit_code: int
    signal: int | None
    timed_out: bool
    killed: bool
    oom: NotRequired[bool]
    duration: float
    next: NotRequired[int]  # a background read's next offset


class Stdin(TypedDict):
    """Bytes in the payload; ``close`` ends the stdin, ``ack`` asks for an OK."""
    t: Literal[Kind.STDIN]
    close: NotRequired[bool]
    ack: NotRequired[bool]


class StdinCredit(TypedDict):
    t: Literal[Kind.STDIN_CREDIT]
    id: int
    n: int


class StdinClosed(TypedDict):
    t: Literal[Kind.STDIN_CLOSED]
    id: int
    message: str


# ---- background commands and terminals ----------------------------------------------


class BgList(TypedDict):
    """Answered OK with ``n`` and the infos as a JSON array in the payload."""
    t: Literal[Kind.BG_LIST]


class BgInfo(TypedDict):
    t: Literal[Kind.BG_INFO]
    pid: int


class BgAttach(TypedDict):
    """Answered OK (pid, start, end, offset, running), OUT... then EXIT or EOF (next)."""
    t: Literal[Kind.BG_ATTACH]
    pid: int
    offset: int
    follow: bool


class BgResize(TypedDict):
    t: Literal[Kind.BG_RESIZE]
    pid: int
    cols: int
    rows: int


class BgSignal(TypedDict):
    t: Literal[Kind.BG_SIGNAL]
    pid: int
    signal: int


class BgWait(TypedDict):
    t: Literal[Kind.BG_WAIT]
    pid: int
    timeout: float


class BgStdin(TypedDict):
    """The stream becomes a stdin sender to the command (its STDIN frames)."""
    t: Literal[Kind.BG_STDIN]
    pid: int


# ---- files ---------------------------------------------------------------------------


class Write(TypedDict):
    """Then DATA... and EOF (``abort``: dropped); answered OK (stat) or ERR."""
    t: Literal[Kind.WRITE]
    path: str


class Data(TypedDict):
    """Bytes in the payload (a file, a tar, a dial's stream)."""
    t: Literal[Kind.DATA]
    id: NotRequired[int]


class Eof(TypedDict, total=False):
    t: Literal[Kind.EOF]
    id: int
    abort: bool  # host -> agent: drop the file being written
    next: int  # a background read's next offset


class Read(TypedDict):
    """Answered OK (size, exact), DATA..., EOF or ERR."""
    t: Literal[Kind.READ]
    path: str


class PathRequest(TypedDict):
    """STAT, MKDIR (answered OK with ``stat``), LIST (OK, ``n``, the entries as JSON in
    the payload), TAR (as a read)."""
    t: Literal[Kind.STAT, Kind.MKDIR, Kind.LIST, Kind.TAR]
    path: str


class Remove(TypedDict):
    t: Literal[Kind.REMOVE]
    path: str
    recursive: bool


class Untar(TypedDict):
    """An uploaded archive extracted into path; answered OK (``extracted``) or ERR."""
    t: Literal[Kind.UNTAR]
    archive: str
    path: str


class Watch(TypedDict):
    """Answered OK (``watches``), EVENTS... (JSON in the payload), EOF or ERR."""
    t: Literal[Kind.WATCH]
    path: str
    recursive: bool


class Events(TypedDict):
    t: Literal[Kind.EVENTS]
    id: int
    n: int
    overflow: bool


class Dial(TypedDict):
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


# ---- the code interpreter's driver (cpuos_agent.kernel), JSON lines over a dial -------


class InterpKind(StrEnum):
    STREAM = "stream"
    CUT = "cut"
    DISPLAY = "display"
    ERROR = "error"
    DONE = "done"
