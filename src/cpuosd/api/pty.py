"""Terminals: ``/sandboxes/{id}/pty``.

A terminal is a background command (``/commands``: list, signal, wait, output all apply,
by its pid) whose stdin, stdout and stderr are a pseudo-terminal inside the sandbox, in a
session of its own whose controlling terminal that is (job control, ^C, full-screen
programs). It outlives its client: detach (close the WebSocket) and attach again.

- ``POST /sandboxes/{id}/pty``: ``{"cols": 120, "rows": 40, "cmd": null}`` (default: a
  login bash) -> its record (201).
- ``POST /sandboxes/{id}/pty/{pid}/resize``: ``{"cols", "rows"}``.
- ``WS /sandboxes/{id}/pty/{pid}/ws?offset=0`` (``Authorization: Bearer <key>``, or the
  console's session cookie from a page of the daemon's origin):
  binary messages from the server are its output (from ``offset``; -1: only what comes
  next); text messages are JSON: ``{"type": "attached", "start", "end", "offset"}`` first,
  ``{"type": "exit", "exit_code", "signal", ...}`` last, or ``{"type": "error", "code",
  "message"}`` (then the socket closes; ``unavailable``: the sandbox stopped answering).
  From the client: binary messages are input (flow-controlled: a terminal that does not
  read holds the sender back); text ``{"type": "resize", "cols", "rows"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cpuos_agent.protocol import Kind

from ..agentconn import AgentGone, StdinClosed, TransportError, raise_for_agent_error
from ..errors import ApiError, api_error
from ..lifecycle import commands as C
from ..paths import check_path
from .auth import websocket_caller
from .commands import CommandInfo
from .deps import ManagerDep, Ws
from .models import Resize, StartPty

log = logging.getLogger("cpuosd.pty")
router = APIRouter(tags=["pty"])

MAX_INPUT = 1 << 20  # bytes in one input message
# WebSocket close codes: 4000 + the HTTP status of the error
CLOSE_BASE = 4000


@router.post("/sandboxes/{sid}/pty", status_code=201, response_model=CommandInfo)
async def create_pty(sid: str, body: StartPty, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    """Start a command on a new terminal of ``cols`` x ``rows``; attach with the
    WebSocket."""
    lv = await mgr.ready(ws, sid)
    cwd = None if body.cwd is None else check_path(body.cwd, "cwd")
    timeout = None if body.timeout is None else float(body.timeout)
    return await C.start(lv, body.cmd, body.env, cwd, timeout, body.buffer, True,
                         pty={"cols": body.cols, "rows": body.rows})


@router.post("/sandboxes/{sid}/pty/{pid}/resize")
async def resize_pty(sid: str, pid: int, body: Resize, mgr: ManagerDep, ws: Ws
                     ) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid)
    await C.resize(lv, pid, body.cols, body.rows)
    return {"pid": pid, "cols": body.cols, "rows": body.rows}


async def _close(websocket: WebSocket, e: ApiError) -> None:
    with contextlib.suppress(Exception):
        await websocket.send_text(json.dumps({"type": "error", "code": e.code,
                                              "message": e.message}))
    with contextlib.suppress(Exception):
        await websocket.close(CLOSE_BASE + e.status, e.message[:120])


@router.websocket("/sandboxes/{sid}/pty/{pid}/ws")
async def pty_socket(websocket: WebSocket, sid: str, pid: int, m: ManagerDep,
                     offset: int = 0) -> None:
    found = websocket_caller(websocket.scope)  # the key, or the console's session cookie
    if found is None:
        await websocket.close(CLOSE_BASE + 401, "missing or invalid API key")
        return
    ws = found[1]
    try:
        lv = await m.ready(ws, sid)
        out, head = await C.attach(lv, pid, max(-1, offset), m._spawn)
    except (ApiError, TransportError) as e:
        await websocket.accept()
        await _close(websocket, api_error(e))
        return
    try:
        inp = await C.open_stdin(lv, pid, m._spawn)
    except (ApiError, TransportError):
        inp = None  # it ended (or closed its input): its output can still be read
    await websocket.accept()
    await websocket.send_text(json.dumps({
        "type": "attached", "pid": pid, "start": head.get("start"), "end": head.get("end"),
        "offset": head.get("offset"), "running": head.get("running") is True}))

    async def pump_out() -> None:
        pos = -1
        while True:
            h, payload = await out.get()
            t = h["t"]
            if t == Kind.OUT:
                off = C._int(h.get("off"))
                if off is None or off < pos:
                    raise ApiError("internal", "sandbox agent sent a malformed output frame")
                pos = off + len(payload)
                await websocket.send_bytes(payload)
            elif t == Kind.EXIT:
                await websocket.send_text(json.dumps({"type": "exit", **C.exit_fields(h)}))
                await websocket.close(1000)
                return
            else:
                raise_for_agent_error(h)
                raise ApiError("internal", f"unexpected agent frame {t!r}")

    async def pump_in() -> None:
        while True:
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("bytes")
            if data is not None:
                if inp is None or len(data) > MAX_INPUT:
                    continue
                with contextlib.suppress(StdinClosed):
                    await inp.send_stdin(data)
                continue
            try:
                ctl = json.loads(msg.get("text") or "")
            except ValueError:
                continue
            if isinstance(ctl, dict) and ctl.get("type") == "resize":
                cols, rows = ctl.get("cols"), ctl.get("rows")
                if isinstance(cols, int) and isinstance(rows, int) and 0 < cols <= 1000 \
                        and 0 < rows <= 1000:
                    await C.resize(lv, pid, cols, rows)

    tasks = [asyncio.ensure_future(pump_out()), asyncio.ensure_future(pump_in())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            err = t.exception()
            if isinstance(err, AgentGone):
                await _close(websocket, ApiError("unavailable",
                                                 C.gone_message(m.store, lv, err)))
            elif isinstance(err, ApiError | TransportError):
                await _close(websocket, api_error(err))
            elif err is not None and not isinstance(err, WebSocketDisconnect):
                log.warning("terminal %s of %s: %r", pid, sid, err)
                await _close(websocket, ApiError("internal", f"{type(err).__name__}"))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        C.close_stream(out, lv, m._spawn)
        if inp is not None:  # what was typed before the client left still goes in
            await C.release_stdin(inp, lv, m._spawn)
