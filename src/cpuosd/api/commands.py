"""Background commands: ``/sandboxes/{id}/commands``.

A background command runs on inside the sandbox after the request that started it, after
its client is gone and across a daemon restart; the sandbox's agent keeps its output in a
ring (``buffer`` bytes, default 1 MiB), readable from any offset it still holds. Ids are
the command's pid inside the sandbox.

- ``POST /sandboxes/{id}/commands``: start one (``cmd``, ``env``, ``cwd``, ``timeout``:
  default none, the sandbox's life bounds it; ``buffer``; ``stdin``: keep a pipe to its
  stdin, default true) -> its record (201).
- ``GET /sandboxes/{id}/commands``: the records (running and recently ended).
- ``GET /sandboxes/{id}/commands/{pid}``: one record.
- ``GET /sandboxes/{id}/commands/{pid}/output?offset=0&follow=true``: its output as frames
  (``application/x-cpuos-frames``, cpuos_agent.protocol): ``attached``, ``out``..., then
  ``exit`` (follow) or ``eof`` (no follow), or ``error``. ``offset=-1``: from the end.
- ``POST /sandboxes/{id}/commands/{pid}/stdin?close=false``: the body goes to its stdin,
  as fast as the command reads it; ``close``: then close its stdin.
- ``POST /sandboxes/{id}/commands/{pid}/signal``: ``{"signal": "TERM"}`` (name or number;
  KILL ends its whole process tree) -> its record.
- ``GET /sandboxes/{id}/commands/{pid}/wait?timeout=60``: its record once it ended, or
  after timeout seconds (``running`` still true).

And for a foreground exec started with ``stdin_stream`` (``POST /sandboxes/{id}/exec``):
``POST /sandboxes/{id}/execs/{exec_id}/stdin?close=true`` streams its stdin while its
output streams back on the exec's own response.
"""

from __future__ import annotations

import signal as signal_mod
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from cpuos_agent import protocol as P

from ..agentconn import TransportError
from ..errors import ApiError, invalid
from ..events import SandboxEvent
from ..lifecycle import commands as C
from ..lifecycle.manager import Live, Manager
from ..paths import check_path
from .deps import ManagerDep, Ws
from .models import SignalRequest, StartCommand

router = APIRouter(tags=["commands"])

class CommandInfo(BaseModel):
    pid: int = Field(description="its pid inside the sandbox: the command's id")
    cmd: str
    running: bool
    started_at: float | None = None
    ended_at: float | None = None
    out_start: int = Field(description="the oldest output offset still held")
    out_end: int = Field(description="the offset the next output byte will have")
    buffer: int = Field(description="bytes of output kept")
    stdin: bool = Field(description="its stdin pipe is open")
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool | None = None
    killed: bool | None = None
    duration: float | None = None


class CommandList(BaseModel):
    commands: list[CommandInfo]


class ExecStdinResult(BaseModel):
    exec_id: str
    sent: int = Field(description="bytes of this request passed on to the command")
    closed: bool


class StdinResult(BaseModel):
    pid: int
    written: int = Field(description="bytes of this request written to its stdin")
    closed: bool


def _signal(v: str | int) -> int:
    if isinstance(v, int):
        if 0 < v < 65:
            return v
    else:
        name = v.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        num = getattr(signal_mod.Signals, name, None) if name.isidentifier() else None
        if num is not None:
            return int(num)
        if v.strip().isdigit() and 0 < int(v) < 65:
            return int(v)
    raise invalid(f"bad signal {str(v)[:40]!r}", field="signal")


FRAMES: dict[int | str, dict[str, Any]] = {200: {"content": {P.CONTENT_TYPE: {}},
                "description": "frames (cpuos_agent.protocol): attached (pid, start, end, "
                "offset, running), out (fd 1|2, off; raw bytes)..., then exit (exit_code, "
                "signal, timed_out, killed, duration, next) or eof (next) or error (code, "
                "message)"}}


@router.post("/sandboxes/{sid}/commands", status_code=201, response_model=CommandInfo)
async def start_command(sid: str, body: StartCommand, mgr: ManagerDep, ws: Ws
                        ) -> dict[str, Any]:
    """Start a background command; it outlives this request, its client and a daemon
    restart."""
    lv = await mgr.ready(ws, sid)
    cwd = None if body.cwd is None else check_path(body.cwd, "cwd")
    timeout = None if body.timeout is None else float(body.timeout)
    # for the audit trail: what was started, where, with which variables (names only)
    what: dict[str, Any] = {"source": "api", "background": True,
                            **({"shell": body.cmd} if isinstance(body.cmd, str)
                               else {"argv": body.cmd}),
                            "cwd": cwd or lv.row.spec.workdir or "/work",
                            "env": sorted(body.env)}
    try:
        out = await C.start(lv, body.cmd, body.env, cwd, timeout, body.buffer, body.stdin)
    except (ApiError, TransportError) as e:
        _audit(mgr, lv, {**what, "error": e.message})
        raise
    _audit(mgr, lv, {**what, "pid": out["pid"]})
    return out


def _audit(mgr: Manager, lv: Live, fields: dict[str, Any]) -> None:
    mgr.events.emit(SandboxEvent("command", lv.row.id, lv.row.workspace_id, None,
                                 fields=fields))


@router.get("/sandboxes/{sid}/commands", response_model=CommandList)
async def list_commands(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid)
    return {"commands": await C.list_(lv)}


@router.get("/sandboxes/{sid}/commands/{pid}", response_model=CommandInfo)
async def command_info(sid: str, pid: int, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid)
    return await C.info(lv, pid)


@router.get("/sandboxes/{sid}/commands/{pid}/output", responses=FRAMES)
async def command_output(sid: str, pid: int, mgr: ManagerDep, ws: Ws,
                         offset: int = Query(0, ge=-1, description="the first byte's offset"
                                             " (-1: from the end: only what comes next)"),
                         follow: bool = Query(True, description="go on until it exits")
                         ) -> StreamingResponse:
    lv = await mgr.ready(ws, sid)
    out = await C.output(mgr.store, lv, pid, offset, follow, mgr._spawn)
    return StreamingResponse(out.frames(), media_type=P.CONTENT_TYPE,
                             headers={"Cache-Control": "no-store"})


@router.post("/sandboxes/{sid}/commands/{pid}/stdin", response_model=StdinResult)
async def command_stdin(sid: str, pid: int, request: Request, mgr: ManagerDep, ws: Ws,
                        close: bool = Query(False, description="then close its stdin")
                        ) -> dict[str, Any]:
    """The request body goes to the command's stdin, no faster than it reads it."""
    lv = await mgr.ready(ws, sid)
    return await C.write_stdin(lv, pid, request.stream(), close, mgr._spawn)


@router.post("/sandboxes/{sid}/commands/{pid}/signal", response_model=CommandInfo)
async def command_signal(sid: str, pid: int, body: SignalRequest, mgr: ManagerDep, ws: Ws
                         ) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid)
    sig = _signal(body.signal)
    _audit(mgr, lv, {"source": "api", "background": True, "pid": pid, "signal": sig})
    return await C.signal(lv, pid, sig)


@router.get("/sandboxes/{sid}/commands/{pid}/wait", response_model=CommandInfo)
async def command_wait(sid: str, pid: int, mgr: ManagerDep, ws: Ws,
                       timeout: float = Query(60.0, ge=0, le=C.MAX_WAIT)) -> dict[str, Any]:
    """Its record once it ended, or after ``timeout`` seconds (then ``running``)."""
    lv = await mgr.ready(ws, sid)
    return await C.wait(lv, pid, timeout)


@router.post("/sandboxes/{sid}/execs/{eid}/stdin", response_model=ExecStdinResult)
async def exec_stdin(sid: str, eid: str, request: Request, mgr: ManagerDep, ws: Ws,
                     close: bool = Query(True, description="then close its stdin")
                     ) -> dict[str, Any]:
    """The request body goes to the stdin of a running exec started with ``stdin_stream``
    (``POST /sandboxes/{id}/exec``; its ``started`` frame names the exec id), no faster than
    the command reads it; one such request at a time."""
    mgr.get(ws, sid)
    return await mgr.exec_stdin.write(sid, eid, request.stream(), close)
