"""Background commands over the agent channel (cpuos_agent.bg): start, list, read output
from an offset, signal, wait, write stdin. The agent keeps the processes and their output
rings (they outlive a client and a daemon restart); the daemon keeps nothing per command but
the streams in flight, and checks and rebuilds everything the agent sends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from cpuos_agent import messages as M
from cpuos_agent import protocol as P
from cpuos_agent.messages import Frame
from cpuos_agent.protocol import Kind

from ..agentconn import AgentGone, Stream, TransportError, open_stream, raise_for_agent_error
from ..errors import ApiError, api_error
from ..store import Store
from .common import Live, _base_env
from .states import State

log = logging.getLogger("cpuosd.commands")

START_WAIT = 15.0  # s for the agent to start a command
CALL_WAIT = 30.0
STDIN_ACK_WAIT = 60.0  # s for the command to take the last of what was sent to its stdin
MAX_WAIT = 600.0  # s a wait request may ask for
MAX_CMD = 1000
MAX_COMMANDS = 256  # entries of a listing believed


def gone_message(store: Store, lv: Live, e: AgentGone) -> str:
    row = store.get_sandbox(lv.row.id)
    if row is not None and row.state != State.RUNNING:
        return f"sandbox is {row.state}" + (f" ({row.reason})" if row.reason else "")
    return e.message


def _int(v: Any, lo: int = 0, hi: int = 1 << 62) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def clean_info(d: Any) -> dict[str, Any]:
    """A command's record as the agent sent it, rebuilt from checked fields."""
    if not isinstance(d, dict) or _int(d.get("pid"), 1, 1 << 22) is None:
        raise ApiError("internal", "sandbox agent sent a malformed command record")
    cmd = d.get("cmd")
    running = d.get("running") is True
    out: dict[str, Any] = {
        "pid": d["pid"],
        "cmd": cmd[:MAX_CMD] if isinstance(cmd, str) else "",
        "running": running,
        "started_at": _num(d.get("started_at")),
        "ended_at": None if running else _num(d.get("ended_at")),
        "out_start": _int(d.get("out_start")) or 0,
        "out_end": _int(d.get("out_end")) or 0,
        "buffer": _int(d.get("buffer")) or 0,
        "stdin": d.get("stdin") is True,
        "exit_code": None, "signal": None, "timed_out": None, "killed": None,
        "duration": None,
    }
    if out["out_start"] > out["out_end"]:
        out["out_start"] = out["out_end"]
    if not running:
        code = _int(d.get("exit_code"), -1, 255)
        out.update(exit_code=-1 if code is None else code,
                   signal=_int(d.get("signal"), 1, 127),
                   timed_out=d.get("timed_out") is True, killed=d.get("killed") is True,
                   duration=_num(d.get("duration")))
    return out


def exit_fields(h: P.Header) -> dict[str, Any]:
    """An exit report of the agent's, rebuilt from checked fields."""
    code = _int(h.get("exit_code"), -1, 255)
    dur = _num(h.get("duration"))
    return {"exit_code": -1 if code is None else code, "signal": _int(h.get("signal"), 1, 127),
            "timed_out": h.get("timed_out") is True, "killed": h.get("killed") is True,
            "duration": round(dur, 6) if dur is not None and dur >= 0 else None}


class ExecStdin:
    """The streams of foreground execs started with ``stdin_stream``, by (sandbox, exec id),
    while they run; one stdin request at a time each (the Manager's: ``Manager.exec_stdin``)."""

    def __init__(self) -> None:
        self.streams: dict[tuple[str, str], Stream] = {}
        self._busy: set[tuple[str, str]] = set()

    def add(self, sandbox_id: str, eid: str, st: Stream) -> None:
        self.streams[(sandbox_id, eid)] = st

    def end(self, sandbox_id: str, eid: str, st: Stream) -> None:
        """The exec ended: a stdin request still sending to it stops at once."""
        self.streams.pop((sandbox_id, eid), None)
        st.stdin_closed = st.stdin_closed or "the command ended"
        st._stdin_ev.set()

    async def write(self, sandbox_id: str, eid: str, body: AsyncIterator[bytes], close: bool
                    ) -> dict[str, Any]:
        """Stream body into the stdin of a running foreground exec, as fast as the command
        reads it (at most P.STDIN_WINDOW bytes in flight); then close it if asked."""
        key = (sandbox_id, eid)
        st = self.streams.get(key)
        if st is None:
            raise ApiError("not_found", f"no running exec {eid!r} with a stdin stream here",
                           {"exec_id": eid})
        if key in self._busy:
            raise ApiError("conflict", f"another request is writing to the stdin of {eid}")
        self._busy.add(key)
        n0 = st.stdin_sent
        try:
            async for chunk in body:
                await st.send_stdin(chunk)
            if close:
                await st.send_stdin(b"", close=True)
        except AgentGone as e:
            raise ApiError("unavailable", e.message) from None
        finally:
            self._busy.discard(key)
        return {"exec_id": eid, "sent": st.stdin_sent - n0, "closed": close}


def _close_quietly(st: Stream, lv: Live, spawn: Any) -> None:
    st.close()
    with contextlib.suppress(Exception):
        spawn(lv.chan.send({"t": Kind.KILL, "id": st.id, "reason": "cancelled"}))


async def start(lv: Live, cmd: str | list[str], env: dict[str, str], cwd: str | None,
                timeout: float | None, buffer: int | None, stdin: bool,
                pty: dict[str, int] | None = None, record: bool = True) -> dict[str, Any]:
    """Start a background command (``pty``: {cols, rows}: on a terminal of its own); its
    record (``record`` false: only its pid, one agent round trip less)."""
    st = lv.chan.open()
    try:
        base = _base_env(lv.row)
        if pty is not None:
            base["TERM"] = "xterm-256color"
        msg: M.Exec = {**M.command(cmd), "env": {**base, **env},
                       "cwd": cwd or lv.row.spec.workdir or "/work",
                       "timeout": timeout, "stdin": stdin, "background": True,
                       "buffer": buffer, "pty": pty}
        await st.send(msg)
        try:
            h, _ = await st.get(START_WAIT)
        except TimeoutError:
            raise ApiError("timeout", "sandbox agent did not start the command") from None
        raise_for_agent_error(h)
        pid = _int(h.get("pid"), 1, 1 << 22)
        if h["t"] != Kind.STARTED or pid is None:
            raise ApiError("internal", f"unexpected agent answer {h['t']!r}")
    finally:
        st.close()
    return await info(lv, pid) if record else {"pid": pid}


async def info(lv: Live, pid: int) -> dict[str, Any]:
    h = await lv.chan.call({"t": Kind.BG_INFO, "pid": pid}, CALL_WAIT)
    return clean_info(h.get("info"))


async def list_(lv: Live) -> list[dict[str, Any]]:
    _, payload = await lv.chan.call_full({"t": Kind.BG_LIST}, CALL_WAIT)
    try:
        entries = json.loads(payload)
    except ValueError:
        entries = None
    if not isinstance(entries, list):
        raise ApiError("internal", "sandbox agent sent a malformed command list")
    out = [clean_info(e) for e in entries[:MAX_COMMANDS]]
    out.sort(key=lambda d: (d["started_at"] or 0.0, d["pid"]))
    return out


async def signal(lv: Live, pid: int, sig: int) -> dict[str, Any]:
    await lv.chan.call({"t": Kind.BG_SIGNAL, "pid": pid, "signal": sig}, CALL_WAIT)
    return await info(lv, pid)


async def resize(lv: Live, pid: int, cols: int, rows: int) -> None:
    await lv.chan.call({"t": Kind.BG_RESIZE, "pid": pid, "cols": cols, "rows": rows}, CALL_WAIT)


async def attach(lv: Live, pid: int, offset: int, spawn: Any) -> tuple[Stream, P.Header]:
    """A following read of the command's output (the agent's stream, and its ``ok``)."""
    return await _attach(lv, pid, offset, True, spawn)


async def _attach(lv: Live, pid: int, offset: int, follow: bool, spawn: Any
                  ) -> tuple[Stream, P.Header]:
    return await open_stream(
        lv.chan, {"t": Kind.BG_ATTACH, "pid": pid, "offset": offset, "follow": follow},
        CALL_WAIT, "answer", lambda st: _close_quietly(st, lv, spawn))


async def open_stdin(lv: Live, pid: int, spawn: Any) -> Stream:
    """A stream to the command's stdin (``Stream.send_stdin``), open until closed."""
    st = lv.chan.open()
    try:
        await st.send({"t": Kind.BG_STDIN, "pid": pid})
        try:
            h, _ = await st.get(CALL_WAIT)
        except TimeoutError:
            raise ApiError("timeout", "sandbox agent did not answer") from None
        raise_for_agent_error(h)
    except BaseException:
        _close_quietly(st, lv, spawn)
        raise
    return st


def close_stream(st: Stream, lv: Live, spawn: Any) -> None:
    _close_quietly(st, lv, spawn)


async def release_stdin(st: Stream, lv: Live, spawn: Any) -> None:
    """Let go of a stdin stream without losing what was sent on it (a client that typed
    and detached): the agent writes what it has queued, then forgets the stream."""
    try:
        await asyncio.wait_for(st.send_stdin(b"", ack=True), 5.0)
    except (ApiError, TransportError, TimeoutError):
        _close_quietly(st, lv, spawn)
        return
    st.close()


async def wait(lv: Live, pid: int, timeout: float) -> dict[str, Any]:
    timeout = min(max(timeout, 0.0), MAX_WAIT)
    h = await lv.chan.call({"t": Kind.BG_WAIT, "pid": pid, "timeout": timeout},
                           timeout + CALL_WAIT)
    return clean_info(h.get("info"))


async def write_stdin(lv: Live, pid: int, body: AsyncIterator[bytes], close: bool,
                      spawn: Any) -> dict[str, Any]:
    """Stream body into the command's stdin (flow-controlled end to end: the request body
    is read only as fast as the command takes it); then close it if asked."""
    st = lv.chan.open()
    done = False
    try:
        await st.send({"t": Kind.BG_STDIN, "pid": pid})
        h, _ = await st.get(CALL_WAIT)
        raise_for_agent_error(h)
        # the last piece carries the ack: a command that reads it and exits at once has
        # taken everything, which a separate ack arriving after its end could not say
        held = b""
        async for chunk in body:
            if not chunk:  # (the server's stream ends with an empty piece)
                continue
            if held:
                await st.send_stdin(held)
            held = chunk
        await st.send_stdin(held, close=close, ack=True)
        try:
            h, _ = await st.get(STDIN_ACK_WAIT)
        except TimeoutError:
            raise ApiError("timeout", f"the command took no stdin for {STDIN_ACK_WAIT:.0f}s"
                           ) from None
        raise_for_agent_error(h)
        done = True
        return {"pid": pid, "written": st.stdin_sent, "closed": close}
    except TimeoutError:
        raise ApiError("timeout", "sandbox agent did not answer") from None
    finally:
        if done:
            st.close()
        else:
            _close_quietly(st, lv, spawn)


class Output:
    """A command's output from an offset, as the API streams it (frames of
    cpuos_agent.protocol): ``attached`` (pid, start: the oldest offset still held, end,
    offset: where this read begins, running), ``out`` (fd 1|2, off: the offset of its first
    byte; raw bytes), then ``exit`` (with ``follow``: once the command ended and all of its
    output was sent; exit_code, signal, timed_out, killed, duration, next) or ``eof``
    (without: the end of what there was; ``next``), or ``error`` (code, message)."""

    def __init__(self, store: Store, lv: Live, st: Stream, head: P.Header, spawn: Any) -> None:
        self.store, self.lv, self.st, self.spawn = store, lv, st, spawn
        start, end = _int(head.get("start")) or 0, _int(head.get("end")) or 0
        offset = _int(head.get("offset")) or 0
        self.head: dict[str, Any] = {
            "t": Frame.ATTACHED, "pid": _int(head.get("pid"), 1, 1 << 22),
            "start": min(start, end), "end": end, "offset": min(max(offset, start), end),
            "running": head.get("running") is True}

    async def frames(self) -> AsyncIterator[bytes]:
        done = False
        pos: int = self.head["offset"]
        try:
            yield P.encode(self.head)
            while True:
                h, payload = await self.st.get()
                t = h["t"]
                if t == Kind.OUT:
                    fd, off = h.get("fd"), _int(h.get("off"))
                    if fd not in (1, 2) or off is None or off < pos:
                        raise ApiError("internal", "sandbox agent sent a malformed output "
                                       "frame")
                    pos = off + len(payload)
                    yield P.encode({"t": Frame.OUT, "fd": fd, "off": off}, payload)
                elif t == Kind.EXIT:
                    done = True
                    yield P.encode({"t": Frame.EXIT, **exit_fields(h), "next": pos})
                    return
                elif t == Kind.EOF:
                    done = True
                    yield P.encode({"t": Frame.EOF, "next": max(pos, _int(h.get("next")) or 0)})
                    return
                else:
                    raise_for_agent_error(h)
                    raise ApiError("internal", f"unexpected agent frame {t!r}")
        except AgentGone as e:
            yield P.encode({"t": Frame.ERROR, "code": "unavailable",
                            "message": gone_message(self.store, self.lv, e)})
        except (ApiError, TransportError) as e:
            err = api_error(e)
            yield P.encode({"t": Frame.ERROR, "code": err.code, "message": err.message})
        finally:
            if done:
                self.st.close()
            else:
                _close_quietly(self.st, self.lv, self.spawn)


async def output(store: Store, lv: Live, pid: int, offset: int, follow: bool, spawn: Any
                 ) -> Output:
    """Open a read of the command's output: errors up to here (no such pid) are HTTP
    errors; after, they are frames."""
    st, h = await _attach(lv, pid, offset, follow, spawn)
    return Output(store, lv, st, h, spawn)
