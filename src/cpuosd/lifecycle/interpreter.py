"""The code interpreter, host side: a cell goes to the sandbox's kernel driver
(``cpuos_agent.interp_driver``, started by the ``code-interpreter`` template before its
snapshot, by the first run_code elsewhere) through
the agent's ``dial`` (a byte stream to the driver's unix socket inside the sandbox); the
driver's JSON lines come back, are checked and bounded, and go to the client as frames
(``cpuos_agent.protocol``):

* ``out`` (``fd`` 1|2; the text, UTF-8, in the payload), ``cut`` (``fd``, ``dropped``: a
  stream's middle was left out; its tail follows);
* ``item`` (``n``: the display item, ``main``: the cell's value, ``mime``; the content in
  the payload: PNG/JPEG bytes, or UTF-8 text): every figure, DataFrame, displayed value;
* ``exception`` (``ename``, ``evalue``; the traceback in the payload);
* then ``done`` (``status``, ``execution_count``, ``timed_out``, ``restarted``,
  ``duration``) or ``error`` (``code``, ``message``).

Nothing the driver sends is trusted (code in the sandbox can replace it): each line is
bounded, each field checked and rebuilt, the whole answer bounded in bytes and in time.
A client that leaves mid-cell closes the stream; the driver then interrupts the cell.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from cpuos_agent import protocol as P
from cpuos_agent.interp_driver import SOCK
from cpuos_agent.messages import Frame, InterpKind
from cpuos_agent.protocol import Kind

from ..agentconn import AgentGone, TransportError, raise_for_agent_error
from ..errors import ApiError, api_error, invalid
from ..events import SandboxEvent
from .common import Live
from .states import State
from .template_images import run_simple

if TYPE_CHECKING:
    from .manager import Manager

log = logging.getLogger("cpuosd.interpreter")

LANGUAGE_RE = re.compile(r"^[a-z][a-z0-9_+-]{0,31}$")
MAX_LINE = 8 << 20  # one driver line (a base64 PNG of up to ~4 MiB)
MAX_ANSWER = 256 << 20  # everything one cell may send back
MAX_ITEMS = 64
DEFAULT_TIMEOUT = 300.0
# after the cell's own timeout, the driver interrupts it and, if it ignores that, restarts
# the kernel (warming a new one takes seconds): the host waits this much longer
GRACE = 90.0
# s the answer waits, after the driver's done, for the end of its stream (the driver closes
# its connection right after): then the agent no longer counts the dial, and a pause or a
# fork made as soon as the answer is out does not find it "still running"
END_WAIT = 2.0
DIAL_TIMEOUT = 15.0
DRIVER_START = 180.0  # s a driver started on demand gets to have its kernel ready
STATUSES = {"ok", "error", "timeout", "died", "busy", "invalid"}
TEXT_MIMES = {"text/plain", "text/html", "text/markdown", "text/latex", "image/svg+xml",
              "application/json"}
BINARY_MIMES = {"image/png", "image/jpeg"}
# (an agent older than the driver's rename, in a sandbox paused before it, has only
# cpuos_agent/kernel.py: the driver is started by whichever name the agent copy has)
START_DRIVER = ("python3 -c 'import ipykernel, jupyter_client' 2>/dev/null || exit 3; "
                "cd /work 2>/dev/null || cd /; m=interp_driver; "
                "[ -e /opt/cpuos/cpuos_agent/interp_driver.py ] || m=kernel; "
                "PYTHONPATH=/opt/cpuos nohup python3 -s -m "
                "cpuos_agent.$m >/tmp/cpuos-kernel.log 2>&1 &")


async def _dial(mgr: Manager, lv: Live, req: dict[str, Any]) -> Any:
    """A stream to the driver with the request sent; starts the driver if none answers
    (a template without it in its snapshot, or one that code inside killed)."""
    payload = (json.dumps(req, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    if len(payload) > P.MAX_PAYLOAD:
        raise ApiError("too_large", f"the code is too large ({len(payload)} bytes; at most "
                       f"{P.MAX_PAYLOAD})")
    started = False
    deadline = 0.0
    while True:
        st = lv.chan.open()
        try:
            await st.send({"t": Kind.DIAL, "path": SOCK}, payload)
            h, _ = await st.get(DIAL_TIMEOUT)
            raise_for_agent_error(h)
            if h.get("t") != Kind.OK:
                raise ApiError("internal", f"unexpected agent answer {h.get('t')!r}")
            return st
        except ApiError as e:
            st.close()
            if e.code != "not_found":
                raise
        except TimeoutError:
            st.close()
            raise ApiError("timeout", "the sandbox's kernel driver did not answer") from None
        except BaseException:
            st.close()
            raise
        if not started:
            async with mgr._lock("kernel:" + lv.row.id):
                code, _ = await run_simple(lv, START_DRIVER, 30)
            if code == 3:
                raise invalid(f"template {lv.row.template!r} has no Python kernel: it needs "
                              "ipykernel and jupyter_client (the 'python' template has them)",
                              field="language")
            started, deadline = True, time.monotonic() + DRIVER_START
            log.info("%s: kernel driver started on demand", lv.row.id)
        if time.monotonic() > deadline:
            raise ApiError("timeout", f"the kernel did not start within {DRIVER_START:.0f}s")
        await asyncio.sleep(0.2)


async def _ended(st: Any, wait: float) -> None:
    """The end of a driver's stream after its done (what comes after it is not read),
    waited for at most ``wait`` s (then given up: the stream is closed as it is)."""
    deadline = time.monotonic() + wait
    with contextlib.suppress(TimeoutError, TransportError):
        while (left := deadline - time.monotonic()) > 0:
            h, _ = await st.get(left)
            if h["t"] != Kind.DATA:
                return


async def _lines(st: Any, deadline: float) -> AsyncGenerator[dict[str, Any], None]:
    """The driver's JSON lines, bounded in size, count and time."""
    buf = bytearray()
    total = 0
    while True:
        try:
            h, payload = await st.get(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise ApiError("timeout", "the kernel did not finish after its timeout and "
                           "the interrupt") from None
        if h["t"] == Kind.DATA:
            total += len(payload)
            if total > MAX_ANSWER:
                raise ApiError("too_large", "the kernel's answer is too large")
            buf += payload
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    break
                line = bytes(buf[:i])
                del buf[:i + 1]
                try:
                    msg = json.loads(line)
                except ValueError:
                    raise ApiError("internal", "the kernel driver sent a malformed line"
                                   ) from None
                if isinstance(msg, dict):
                    yield msg
            if len(buf) > MAX_LINE:
                raise ApiError("too_large", "the kernel driver sent an over-long line")
        elif h["t"] == Kind.EOF:
            return
        else:
            raise_for_agent_error(h)
            raise ApiError("internal", f"unexpected agent frame {h['t']!r}")


def _text(v: Any, limit: int) -> str:
    return v[:limit] if isinstance(v, str) else ""


def _frames_of(msg: dict[str, Any], items: list[int]) -> list[bytes]:
    """One driver message as client frames (checked fields only); [] for what is dropped."""
    t = msg.get("t")
    if t == InterpKind.STREAM:
        fd = 2 if msg.get("name") == "stderr" else 1
        data = _text(msg.get("text"), P.MAX_PAYLOAD // 4).encode("utf-8", "replace")
        return [P.encode({"t": Frame.OUT, "fd": fd}, data)] if data else []
    if t == InterpKind.CUT:
        n = msg.get("dropped")
        fd = 2 if msg.get("name") == "stderr" else 1
        return [P.encode({"t": Frame.CUT, "fd": fd,
                          "dropped": n if isinstance(n, int) and n >= 0 else 0})]
    if t == InterpKind.DISPLAY:
        bundle = msg.get("data")
        if not isinstance(bundle, dict) or items[0] >= MAX_ITEMS:
            return []
        n = items[0]
        items[0] += 1
        out = []
        for mime, v in bundle.items():
            if not isinstance(v, str):
                continue
            if mime in BINARY_MIMES:
                try:
                    # (Jupyter's base64 may be cut in lines)
                    raw = base64.b64decode(v.replace("\n", "").replace("\r", ""),
                                           validate=True)
                except (binascii.Error, ValueError):
                    continue
            elif mime in TEXT_MIMES:
                raw = v.encode("utf-8", "replace")
            else:
                continue
            if len(raw) <= P.MAX_PAYLOAD:
                out.append(P.encode({"t": Frame.ITEM, "n": n, "main": msg.get("main") is True,
                                     "mime": mime}, raw))
        return out
    if t == InterpKind.ERROR:
        tb = _text(msg.get("traceback"), 1 << 20).encode("utf-8", "replace")
        return [P.encode({"t": Frame.EXCEPTION, "ename": _text(msg.get("ename"), 200),
                          "evalue": _text(msg.get("evalue"), 4000)}, tb)]
    return []


def _done(msg: dict[str, Any], duration: float) -> dict[str, Any]:
    status = msg.get("status") if msg.get("status") in STATUSES else "error"
    count = msg.get("execution_count")
    dropped = msg.get("dropped_items")
    return {"t": Frame.DONE, "status": status,
            "execution_count": count if isinstance(count, int) and 0 <= count < 1 << 53
            else None,
            "timed_out": msg.get("timed_out") is True, "restarted": msg.get("restarted") is True,
            "dropped_items": dropped if isinstance(dropped, int) and dropped >= 0 else 0,
            "message": _text(msg.get("message"), 500), "duration": round(duration, 6)}


async def run_code(mgr: Manager, lv: Live, code: str, language: str, timeout: float | None
                   ) -> AsyncIterator[bytes]:
    """Start a cell; returns the frame stream for the HTTP response (errors before the
    cell runs raise ApiError: a proper HTTP status)."""
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    st = await _dial(mgr, lv, {"op": "run", "code": code, "language": language,
                                "timeout": timeout})
    eid = "run-" + secrets.token_hex(6)
    mgr.store.insert_exec(eid, lv.row.id, ["run_code", language, code[:1000]])
    # for the audit trail: the cell (its start, its hash and size), as a command
    what = {"exec_id": eid, "source": "run_code", "language": language,
            "code": code[:4096], "code_sha256": hashlib.sha256(code.encode()).hexdigest(),
            "code_bytes": len(code.encode())}
    return _cell_frames(mgr, lv, st, eid, timeout, what)


async def _cell_frames(mgr: Manager, lv: Live, st: Any, eid: str, timeout: float,
                       what: dict[str, Any]) -> AsyncIterator[bytes]:
    t0 = time.monotonic()
    done: dict[str, Any] | None = None
    err: dict[str, Any] | None = None
    counts = {1: 0, 2: 0}
    items = [0]
    try:
        yield P.encode({"t": Frame.STARTED, "exec_id": eid})
        lines = _lines(st, t0 + timeout + GRACE)
        async for msg in lines:
            if msg.get("t") == InterpKind.DONE:
                done = _done(msg, time.monotonic() - t0)
                break
            for fr in _frames_of(msg, items):
                if msg.get("t") == InterpKind.STREAM:
                    counts[2 if msg.get("name") == "stderr" else 1] += len(fr)
                yield fr
        await lines.aclose()
        if done is not None:
            await _ended(st, END_WAIT)
        if done is None:
            err = {"t": Frame.ERROR, "code": "unavailable",
                   "message": "the kernel driver ended without an answer"}
        elif done["status"] == "invalid":
            err = {"t": Frame.ERROR, "code": "invalid_argument",
                   "message": done["message"] or "the kernel refused the request"}
        elif done["status"] == "busy":
            err = {"t": Frame.ERROR, "code": "timeout",
                   "message": done["message"] or "the kernel was busy"}
    except AgentGone:
        row = mgr.store.get_sandbox(lv.row.id)
        why = f"sandbox is {row.state} ({row.reason})" if row and row.state != State.RUNNING \
            else "sandbox agent disconnected"
        err = {"t": Frame.ERROR, "code": "unavailable", "message": why}
    except (ApiError, TransportError) as e:
        e2 = api_error(e)
        err = {"t": Frame.ERROR, "code": e2.code, "message": e2.message}
    finally:
        if done is None or err is not None:
            # the client left or we gave up: the driver sees its socket close and
            # interrupts the cell
            with contextlib.suppress(Exception):
                mgr._spawn(lv.chan.send({"t": Kind.KILL, "id": st.id, "reason": "cancelled"}))
        st.close()
        mgr.store.finish_exec(
            eid, exit_code=0 if done and done["status"] == "ok" else 1,
            timed_out=int(bool(done and done["timed_out"])),
            error=(err or {}).get("message"), stdout_bytes=counts[1],
            stderr_bytes=counts[2])
        mgr.events.emit(SandboxEvent("command", lv.row.id, lv.row.workspace_id, None, fields={
            **what, "status": done["status"] if done else None,
            "timed_out": bool(done and done["timed_out"]), "error": (err or {}).get("message"),
            "duration": round(time.monotonic() - t0, 6), "stdout_bytes": counts[1],
            "stderr_bytes": counts[2]}))
    yield P.encode(err if err is not None else done or {})


async def restart_kernel(mgr: Manager, lv: Live, language: str) -> dict[str, Any]:
    st = await _dial(mgr, lv, {"op": "restart", "language": language, "timeout": 60})
    t0 = time.monotonic()
    try:
        async for msg in _lines(st, t0 + 60 + GRACE):
            if msg.get("t") == InterpKind.DONE:
                d = _done(msg, time.monotonic() - t0)
                await _ended(st, END_WAIT)
                if d["status"] == "invalid":
                    raise invalid(d["message"] or "the kernel refused", field="language")
                if d["status"] != "ok":
                    raise ApiError("unavailable", d["message"] or "the kernel did not restart")
                return {"restarted": True, "language": language, "duration": d["duration"]}
        raise ApiError("unavailable", "the kernel driver ended without an answer")
    finally:
        st.close()
