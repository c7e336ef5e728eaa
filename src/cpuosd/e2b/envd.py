"""envd's Connect services (``process.Process``, ``filesystem.Filesystem``) on cpuos's agent.

The Connect protocol itself (envelopes, end-of-stream, errors, JSON and binary codecs) is
the ``connectrpc`` library's ASGI server, with the service stubs generated from E2B's own
.proto files (``gen/``, ``scripts/gen_e2b_proto.py``). What is here maps each call onto the
features cpuos's own API uses — background commands (every E2B process is one: it has a
pid, is listed, outlives its client, takes stdin and signals, is reattached by Connect),
terminals, files, inotify watches — through the same functions, so the audit trail, the
limits and the agent's checks are the same.

The request's sandbox (checked by the router: its id and access token) is ``CURRENT``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import posixpath
import re
import secrets
import signal as signal_mod
import stat as stat_mod
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from cpuos_agent import protocol as P
from cpuos_agent.messages import Frame
from cpuos_agent.protocol import Kind

from ..agentconn import (AgentGone, Stream, TransportError, open_stream,
                         raise_for_agent_error)
from ..api.dirs import _clean_events
from ..errors import ApiError, api_error
from ..events import SandboxEvent
from ..lifecycle import commands as C
from ..lifecycle.common import Live
from .gen.filesystem import filesystem_pb as F
from .gen.filesystem.filesystem_connect import FilesystemASGIApplication
from .gen.process import process_pb as PP
from .gen.process.process_connect import ProcessASGIApplication
from .state import E2B, HOME, SETTLE, USER, E2BError, Target

CURRENT: ContextVar[Target] = ContextVar("e2b_target")
T = TypeVar("T")

OUTPUT_BUFFER = 4 << 20  # bytes of a process's output the agent keeps for its readers
MAX_TRACKED = 1024  # E2B process configs remembered per sandbox
MAX_DEPTH = 32
MAX_ENTRIES = 10000
KEEPALIVE = 50.0  # s, unless the client asks for another interval
MAX_WATCHERS = 64  # polled watchers per sandbox
MAX_WATCH_EVENTS = 10000  # held per polled watcher between polls
AGENT_WINDOW = 0.1  # s: the agent's coalescing window (50 ms) and its way here
CODES = {"not_found": Code.NOT_FOUND, "invalid_argument": Code.INVALID_ARGUMENT,
         "permission_denied": Code.PERMISSION_DENIED, "conflict": Code.FAILED_PRECONDITION,
         "already_exists": Code.ALREADY_EXISTS, "is_a_directory": Code.INVALID_ARGUMENT,
         "not_a_directory": Code.INVALID_ARGUMENT, "too_large": Code.RESOURCE_EXHAUSTED,
         "limit_exceeded": Code.RESOURCE_EXHAUSTED, "spending_cap": Code.RESOURCE_EXHAUSTED,
         "no_space": Code.RESOURCE_EXHAUSTED, "timeout": Code.DEADLINE_EXCEEDED,
         "unavailable": Code.UNAVAILABLE, "unauthorized": Code.UNAUTHENTICATED,
         "internal": Code.INTERNAL}
TEMP_RE = re.compile(r"/\.[^/]*\.cpuos-[0-9a-f]+\.tmp$")
EVENT_TYPES = {"create": F.EventType.CREATE, "modify": F.EventType.WRITE,
               "delete": F.EventType.REMOVE, "rename": F.EventType.RENAME}


def one(field: str, value: Any) -> Any:
    """A oneof's value (typed per field by the generated code; built here by name)."""
    return Oneof(field, value)


def connect_error(e: ApiError | E2BError | TransportError) -> ConnectError:
    if isinstance(e, TransportError):
        e = api_error(e)
    if isinstance(e, E2BError):
        return ConnectError(Code.UNAVAILABLE if e.status == 502 else Code.UNAUTHENTICATED
                            if e.status == 401 else Code.UNKNOWN, e.message)
    return ConnectError(CODES.get(e.code, Code.INTERNAL), e.message)


async def _call(fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return await fn()
    except (ApiError, E2BError, TransportError) as e:
        raise connect_error(e) from None


async def _guarded(gen: AsyncGenerator[T, None]) -> AsyncIterator[T]:
    """gen's items, cpuos's errors as Connect's; gen is closed when this is (a client
    that left: the agent's streams it holds are let go at once, not at garbage
    collection)."""
    try:
        async with contextlib.aclosing(gen):
            async for x in gen:
                yield x
    except (ApiError, E2BError, TransportError) as e:
        raise connect_error(e) from None


def check_user(ctx: RequestContext[Any, Any]) -> None:
    """``Authorization: Basic <user>:`` names the user a call runs as: cpuos runs every
    command and file operation as the sandbox's user; another user is refused."""
    auth = ctx.request_headers.get("authorization") or ""
    scheme, _, value = auth.partition(" ")
    if scheme.lower() != "basic":
        return
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, ValueError):
        raise ConnectError(Code.INVALID_ARGUMENT, "bad Authorization header") from None
    if user and user != USER:
        raise ConnectError(Code.PERMISSION_DENIED, f"cpuos runs commands and file "
                           f"operations as {USER!r} only (asked: {user[:40]!r})")


def _interval(ctx: RequestContext[Any, Any]) -> float:
    v = ctx.request_headers.get("keepalive-ping-interval")
    try:
        return min(max(float(v), 1.0), 300.0) if v else KEEPALIVE
    except ValueError:
        return KEEPALIVE


async def with_keepalive(gen: AsyncIterator[T], interval: float
                         ) -> AsyncGenerator[T | None, None]:
    """gen's items, and None whenever it has been silent for ``interval`` seconds."""
    it = gen.__aiter__()
    nxt: asyncio.Future[T] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=interval)
            if not done:
                yield None
                continue
            fut, nxt = nxt, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if nxt is not None:
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()


# ---- process.Process ----------------------------------------------------------------------
def _ev(event: Oneof[Any, Any]) -> PP.ProcessEvent:
    return PP.ProcessEvent(event=event)


def _end(h: P.Header) -> PP.ProcessEvent.EndEvent:
    sig = h.get("signal")
    if isinstance(sig, int) or h.get("killed") is True:
        name = "killed"
        with contextlib.suppress(ValueError, TypeError):
            name = signal_mod.Signals(sig).name[3:].lower() if sig else "killed"
        if name == "kill":
            name = "killed"
        end = PP.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}")
    else:
        code = h.get("exit_code")
        code = code if isinstance(code, int) else -1
        end = PP.ProcessEvent.EndEvent(exit_code=code, exited=True,
                                       status=f"exit status {code}")
    if h.get("timed_out") is True:
        end.error = "context deadline exceeded"
    return end


class ProcessService:
    def __init__(self, e2b: E2B) -> None:
        self.e2b = e2b

    def _track(self, sid: str, pid: int, cfg: dict[str, Any]) -> None:
        procs = self.e2b.processes.setdefault(sid, {})
        procs[pid] = cfg
        while len(procs) > MAX_TRACKED:
            procs.pop(next(iter(procs)))

    async def _pid(self, lv: Live, selector: PP.ProcessSelector | None) -> int:
        """A running process: by pid, or by the tag it was started with."""
        sel = selector.selector if selector is not None else None
        if isinstance(sel, Oneof) and sel.field == "pid":
            pid = int(sel.value)
        elif isinstance(sel, Oneof) and sel.field == "tag":
            tags = [p for p, c in self.e2b.processes.get(lv.row.id, {}).items()
                    if c.get("tag") == sel.value]
            if not tags:
                raise ConnectError(Code.NOT_FOUND, f"no process with tag {sel.value!r}")
            pid = tags[-1]
        else:
            raise ConnectError(Code.INVALID_ARGUMENT, "name the process (pid or tag)")
        try:
            info = await C.info(lv, pid)
        except ApiError as e:
            if e.code == "not_found":
                raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found"
                                   ) from None
            raise
        if not info["running"]:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        return pid

    async def list(self, request: PP.ListRequest, ctx: RequestContext[Any, Any]
                   ) -> PP.ListResponse:
        async def go() -> PP.ListResponse:
            t = CURRENT.get()
            lv = await t.ready()
            known = self.e2b.processes.get(t.sid, {})
            out = []
            for c in await C.list_(lv):
                if not c["running"]:
                    known.pop(c["pid"], None)
                    continue
                cfg = known.get(c["pid"]) or {"cmd": "/bin/bash",
                                              "args": ["-l", "-c", c["cmd"]]}
                info = PP.ProcessInfo(pid=c["pid"], config=PP.ProcessConfig(
                    cmd=cfg["cmd"], args=cfg["args"], envs=cfg.get("envs") or {},
                    cwd=cfg.get("cwd")))
                if cfg.get("tag") is not None:
                    info.tag = cfg["tag"]
                out.append(info)
            return PP.ListResponse(processes=out)
        return await _call(go)

    def start(self, request: PP.StartRequest, ctx: RequestContext[Any, Any]
              ) -> AsyncIterator[PP.StartResponse]:
        return _guarded(self._start(request, ctx))

    async def _start(self, request: PP.StartRequest, ctx: RequestContext[Any, Any]
                     ) -> AsyncGenerator[PP.StartResponse, None]:
        check_user(ctx)
        t = CURRENT.get()
        p = request.process
        if p is None or not p.cmd or "\x00" in p.cmd or any("\x00" in a for a in p.args) \
                or len(p.args) > 4096:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must be a non-empty "
                               "string; args at most 4096 strings, no NUL bytes")
        env = dict(p.envs)
        for k, v in env.items():
            if not k or "=" in k or "\x00" in k or "\x00" in v or len(v) > 32768:
                raise ConnectError(Code.INVALID_ARGUMENT, f"bad environment variable "
                                   f"{k[:80]!r}")
        cwd = t.path(p.cwd, "cwd") if p.has_field("cwd") and p.cwd else HOME
        remaining = ctx.timeout_ms
        timeout = None if remaining is None else max(0.001, remaining / 1000)
        pty = None
        if request.has_field("pty") and request.pty is not None:
            size = request.pty.size
            pty = {"cols": int(size.cols) if size else 80, "rows": int(size.rows) if size
                   else 24}
        stdin = request.stdin if request.has_field("stdin") else True
        argv = [p.cmd, *p.args]
        lv = await t.ready()
        what: dict[str, Any] = {"source": "e2b", "background": True, "argv": argv,
                                "cwd": cwd, "env": sorted(env)}
        try:
            info = await C.start(lv, argv, env, cwd, timeout, OUTPUT_BUFFER, bool(stdin),
                                 pty, record=False)
        except (ApiError, TransportError) as e:
            self._audit(t, {**what, "error": e.message})
            raise
        pid = info["pid"]
        self._audit(t, {**what, "pid": pid})
        self._track(t.sid, pid, {"cmd": p.cmd, "args": list(p.args), "envs": env,
                                 "cwd": cwd, "pty": pty is not None,
                                 "tag": request.tag if request.has_field("tag") else None})
        yield PP.StartResponse(event=_ev(one("start", PP.ProcessEvent.StartEvent(pid=pid))))
        follow = self._follow(lv, pid, 0, pty is not None, _interval(ctx),
                              deadline=timeout is not None)
        async with contextlib.aclosing(follow):
            async for ev in follow:
                yield PP.StartResponse(event=ev)

    def _audit(self, t: Target, fields: dict[str, Any]) -> None:
        self.e2b.mgr.events.emit(SandboxEvent("command", t.sid, t.ws, None, fields=fields))

    async def _follow(self, lv: Live, pid: int, offset: int, pty: bool, interval: float,
                      deadline: bool = False) -> AsyncGenerator[PP.ProcessEvent, None]:
        """The process's output from offset on, then its end: cpuos's command output
        (the agent's ring; lifecycle.commands.Output checks every frame). ``deadline``:
        this stream started it with a Connect timeout, which ended it: the stream ends
        with deadline_exceeded (as envd's, whose process lives in the request's context),
        not an end event."""
        m = self.e2b.mgr
        out = await C.output(m.store, lv, pid, offset, True, m._spawn)
        frames = cast(AsyncGenerator[bytes, None], out.frames())

        async def events() -> AsyncIterator[tuple[P.Header, bytes]]:
            dec = P.FrameDecoder()
            async for raw in frames:
                for h, payload in dec.feed(raw):
                    yield h, payload

        async with contextlib.aclosing(frames):
            async for item in with_keepalive(events(), interval):
                if item is None:
                    yield _ev(one("keepalive", PP.ProcessEvent.KeepAlive()))
                    continue
                h, payload = item
                if h["t"] == Frame.OUT:
                    field = "pty" if pty else ("stderr" if h.get("fd") == 2 else "stdout")
                    yield _ev(one("data", PP.ProcessEvent.DataEvent(
                        output=one(field, payload))))
                elif h["t"] == Frame.EXIT:
                    # the agent's stream is let go before the client hears of the end (a
                    # pause right after must not find it open)
                    await frames.aclose()
                    self.e2b.touch(lv.row.id)
                    if deadline and h.get("timed_out") is True:
                        raise ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded")
                    yield _ev(one("end", _end(h)))
                    return
                elif h["t"] == Frame.ERROR:
                    # (a killed sandbox: the SDK then asks /health, which says it is gone)
                    raise ConnectError(CODES.get(str(h.get("code")), Code.UNAVAILABLE),
                                       str(h.get("message") or "the command's stream ended"))

    def connect(self, request: PP.ConnectRequest, ctx: RequestContext[Any, Any]
                ) -> AsyncIterator[PP.ConnectResponse]:
        return _guarded(self._connect(request, ctx))

    async def _connect(self, request: PP.ConnectRequest, ctx: RequestContext[Any, Any]
                       ) -> AsyncGenerator[PP.ConnectResponse, None]:
        t = CURRENT.get()
        lv = await t.ready()
        pid = await self._pid(lv, request.process)
        cfg = self.e2b.processes.get(t.sid, {}).get(pid) or {}
        yield PP.ConnectResponse(event=_ev(one("start",
                                                 PP.ProcessEvent.StartEvent(pid=pid))))
        follow = self._follow(lv, pid, -1, cfg.get("pty") is True, _interval(ctx))
        async with contextlib.aclosing(follow):
            async for ev in follow:
                yield PP.ConnectResponse(event=ev)

    async def update(self, request: PP.UpdateRequest, ctx: RequestContext[Any, Any]
                     ) -> PP.UpdateResponse:
        async def go() -> PP.UpdateResponse:
            lv = await CURRENT.get().ready()
            pid = await self._pid(lv, request.process)
            if request.has_field("pty") and request.pty is not None and request.pty.size:
                s = request.pty.size
                await C.resize(lv, pid, max(1, min(int(s.cols), 10000)),
                               max(1, min(int(s.rows), 10000)))
            return PP.UpdateResponse()
        return await _call(go)

    async def _input(self, lv: Live, pid: int, inp: PP.ProcessInput | None,
                     close: bool = False) -> None:
        data = b""
        if inp is not None and isinstance(inp.input, Oneof):
            data = bytes(inp.input.value)

        async def body() -> AsyncIterator[bytes]:
            yield data
        await C.write_stdin(lv, pid, body(), close, self.e2b.mgr._spawn)

    async def send_input(self, request: PP.SendInputRequest, ctx: RequestContext[Any, Any]
                         ) -> PP.SendInputResponse:
        async def go() -> PP.SendInputResponse:
            lv = await CURRENT.get().ready()
            pid = await self._pid(lv, request.process)
            await self._input(lv, pid, request.input)
            return PP.SendInputResponse()
        return await _call(go)

    async def close_stdin(self, request: PP.CloseStdinRequest,
                          ctx: RequestContext[Any, Any]) -> PP.CloseStdinResponse:
        async def go() -> PP.CloseStdinResponse:
            lv = await CURRENT.get().ready()
            pid = await self._pid(lv, request.process)
            await self._input(lv, pid, None, close=True)
            return PP.CloseStdinResponse()
        return await _call(go)

    async def stream_input(self, request: AsyncIterator[PP.StreamInputRequest],
                           ctx: RequestContext[Any, Any]) -> PP.StreamInputResponse:
        async def go() -> PP.StreamInputResponse:
            lv = await CURRENT.get().ready()
            st: Stream | None = None
            spawn = self.e2b.mgr._spawn
            try:
                async for msg in request:
                    ev = msg.event
                    if not isinstance(ev, Oneof):
                        continue
                    if ev.field == "start":
                        if st is not None:
                            raise ConnectError(Code.INVALID_ARGUMENT, "a second start")
                        pid = await self._pid(lv, ev.value.process)
                        st = await C.open_stdin(lv, pid, spawn)
                    elif ev.field == "data":
                        if st is None:
                            raise ConnectError(Code.INVALID_ARGUMENT, "data before start")
                        inp = ev.value.input
                        if inp is not None and isinstance(inp.input, Oneof):
                            await st.send_stdin(bytes(inp.input.value))
                if st is not None:
                    await C.release_stdin(st, lv, spawn)
                    st = None
            finally:
                if st is not None:
                    C.close_stream(st, lv, spawn)
            return PP.StreamInputResponse()
        return await _call(go)

    async def send_signal(self, request: PP.SendSignalRequest,
                          ctx: RequestContext[Any, Any]) -> PP.SendSignalResponse:
        async def go() -> PP.SendSignalResponse:
            t = CURRENT.get()
            lv = await t.ready()
            pid = await self._pid(lv, request.process)
            sig = int(request.signal.value) if request.signal is not None else 0
            if sig not in (signal_mod.SIGKILL, signal_mod.SIGTERM):
                raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGKILL or SIGTERM")
            self._audit(t, {"source": "e2b", "background": True, "pid": pid, "signal": sig})
            await C.signal(lv, pid, sig)
            return PP.SendSignalResponse()
        return await _call(go)


# ---- filesystem.Filesystem ----------------------------------------------------------------
def _owner(v: Any) -> str:
    return {0: "root", 1000: USER}.get(v, str(v)) if isinstance(v, int) else USER


def entry(d: dict[str, Any]) -> F.EntryInfo:
    """cpuos's checked entry (lifecycle.exec_files._clean_stat) as E2B's EntryInfo."""
    kind = {"file": F.FileType.FILE, "dir": F.FileType.DIRECTORY,
            "symlink": F.FileType.SYMLINK}.get(d["type"], F.FileType.UNSPECIFIED)
    bits = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR,
            "symlink": stat_mod.S_IFLNK}.get(d["type"], 0)
    mode = int(d.get("mode") or 0)
    e = F.EntryInfo(name=d["name"], type=kind, path=d["path"], size=int(d.get("size") or 0),
                    mode=mode, permissions=stat_mod.filemode(bits | mode),
                    owner=_owner(d.get("uid")), group=_owner(d.get("gid")),
                    modified_time=Timestamp.from_nanos(int(float(d.get("mtime") or 0) * 1e9)))
    if d.get("target") is not None:
        e.symlink_target = str(d["target"])
    return e


class FilesystemService:
    def __init__(self, e2b: E2B) -> None:
        self.e2b = e2b
        # polled watchers (CreateWatcher / GetWatcherEvents): id -> Watcher
        self.watchers: dict[str, Watcher] = {}
        e2b.on_end.append(self._sandbox_ended)

    def _sandbox_ended(self, sid: str) -> None:
        for wid, w in list(self.watchers.items()):
            if w.sid == sid:
                self.watchers.pop(wid, None)
                w.stop()

    async def _stat(self, lv: Live, path: str) -> dict[str, Any]:
        d: dict[str, Any] = await self.e2b.mgr.session.file_call(lv, Kind.STAT, path)
        return d

    async def _resolved(self, lv: Live, d: dict[str, Any]) -> dict[str, Any]:
        """A symlink as envd reports it: the type of what it points to and the absolute
        path of that (a dangling or looping link stays a symlink)."""
        if d["type"] != "symlink":
            return d
        cur = d
        for _ in range(8):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(cur["path"]),
                                                       str(cur.get("target") or "")))
            try:
                cur = await self._stat(lv, target)
            except (ApiError, TransportError):
                return d
            if cur["type"] != "symlink":
                return {**d, "type": cur["type"], "target": target}
        return d

    async def stat(self, request: F.StatRequest, ctx: RequestContext[Any, Any]
                   ) -> F.StatResponse:
        async def go() -> F.StatResponse:
            check_user(ctx)
            t = CURRENT.get()
            lv = await t.ready()
            d = await self._resolved(lv, await self._stat(lv, t.path(request.path)))
            return F.StatResponse(entry=entry(d))
        return await _call(go)

    async def make_dir(self, request: F.MakeDirRequest, ctx: RequestContext[Any, Any]
                       ) -> F.MakeDirResponse:
        async def go() -> F.MakeDirResponse:
            check_user(ctx)
            t = CURRENT.get()
            lv = await t.ready()
            path = t.path(request.path)
            with contextlib.suppress(ApiError, TransportError):
                await self._stat(lv, path)
                raise ConnectError(Code.ALREADY_EXISTS, f"{path} already exists")
            self.e2b.touch(t.sid)
            d: dict[str, Any] = await self.e2b.mgr.session.file_call(lv, Kind.MKDIR, path)
            return F.MakeDirResponse(entry=entry(d))
        return await _call(go)

    async def move(self, request: F.MoveRequest, ctx: RequestContext[Any, Any]
                   ) -> F.MoveResponse:
        async def go() -> F.MoveResponse:
            check_user(ctx)
            t = CURRENT.get()
            lv = await t.ready()
            src, dst = t.path(request.source, "source"), t.path(request.destination,
                                                                "destination")
            await self._stat(lv, src)  # (not_found as E2B says it)
            self.e2b.touch(t.sid)
            # a rename is a command of the sandbox's user, through cpuos's exec (audited)
            frames = await self.e2b.mgr.session.exec_start(lv, ["mv", "-T", "--", src, dst], {},
                                                   "/", 60.0, None)
            dec, code, err = P.FrameDecoder(), None, b""
            async for raw in frames:
                for h, payload in dec.feed(raw):
                    if h["t"] == Frame.OUT and h.get("fd") == 2:
                        err = (err + payload)[-1000:]
                    elif h["t"] == Frame.EXIT:
                        code = h.get("exit_code")
                    elif h["t"] == Frame.ERROR:
                        raise ApiError(str(h.get("code")), str(h.get("message")))
            if code != 0:
                raise ConnectError(Code.INVALID_ARGUMENT if b"No such" not in err
                                   else Code.NOT_FOUND,
                                   f"move {src} -> {dst}: {err.decode(errors='replace')}"
                                   .strip())
            return F.MoveResponse(entry=entry(await self._stat(lv, dst)))
        return await _call(go)

    async def list_dir(self, request: F.ListDirRequest, ctx: RequestContext[Any, Any]
                       ) -> F.ListDirResponse:
        async def go() -> F.ListDirResponse:
            check_user(ctx)
            t = CURRENT.get()
            lv = await t.ready()
            root = t.path(request.path)
            depth = int(request.depth or 1)
            if depth > MAX_DEPTH:
                raise ConnectError(Code.INVALID_ARGUMENT, f"depth may be at most {MAX_DEPTH}")
            st = await self._stat(lv, root)
            if st["type"] != "dir":
                raise ConnectError(Code.INVALID_ARGUMENT, f"{root} is not a directory")
            out: list[F.EntryInfo] = []

            async def walk(path: str, level: int) -> None:
                entries = await self.e2b.mgr.session.file_call(lv, Kind.LIST, path)
                for d in entries:
                    if len(out) >= MAX_ENTRIES:
                        return
                    out.append(entry(await self._resolved(lv, d)))
                    if d["type"] == "dir" and level < depth:
                        await walk(d["path"], level + 1)
            await walk(root, 1)
            return F.ListDirResponse(entries=out)
        return await _call(go)

    async def remove(self, request: F.RemoveRequest, ctx: RequestContext[Any, Any]
                     ) -> F.RemoveResponse:
        async def go() -> F.RemoveResponse:
            check_user(ctx)
            t = CURRENT.get()
            lv = await t.ready()
            path = t.path(request.path)
            if path == "/":
                raise ConnectError(Code.INVALID_ARGUMENT, "refusing to remove /")
            self.e2b.touch(t.sid)
            try:
                await self.e2b.mgr.session.file_call(lv, Kind.REMOVE, path, recursive=True)
            except ApiError as e:
                if e.code != "not_found":  # (envd: removing what is not there succeeds)
                    raise
            return F.RemoveResponse()
        return await _call(go)

    async def _open_watch(self, t: Target, path: str, recursive: bool
                          ) -> tuple[Live, Stream, str]:
        lv = await t.ready()
        root = t.path(path)
        st = await self._stat(lv, root)
        if st["type"] != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"{root} is not a directory")
        stream, _ = await open_stream(lv.chan, {"t": Kind.WATCH, "path": root,
                                                "recursive": recursive}, 60.0,
                                      f"watch {root}")
        return lv, stream, root

    def watch_dir(self, request: F.WatchDirRequest, ctx: RequestContext[Any, Any]
                  ) -> AsyncIterator[F.WatchDirResponse]:
        return _guarded(self._watch_dir(request, ctx))

    async def _watch_dir(self, request: F.WatchDirRequest, ctx: RequestContext[Any, Any]
                         ) -> AsyncGenerator[F.WatchDirResponse, None]:
        check_user(ctx)
        t = CURRENT.get()
        lv, st, root = await self._open_watch(t, request.path, request.recursive)
        yield F.WatchDirResponse(event=one("start", F.WatchDirResponse.StartEvent()))
        events = with_keepalive(watch_events(self.e2b, lv, st, root, request.include_entry),
                                _interval(ctx))
        async with contextlib.aclosing(events):
            async for ev in events:
                if ev is None:
                    yield F.WatchDirResponse(event=one("keepalive",
                                                       F.WatchDirResponse.KeepAlive()))
                else:
                    yield F.WatchDirResponse(event=one("filesystem", ev))

    async def create_watcher(self, request: F.CreateWatcherRequest,
                             ctx: RequestContext[Any, Any]) -> F.CreateWatcherResponse:
        async def go() -> F.CreateWatcherResponse:
            check_user(ctx)
            t = CURRENT.get()
            if sum(1 for w in self.watchers.values() if w.sid == t.sid) >= MAX_WATCHERS:
                raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} "
                                   "watchers per sandbox")
            lv, st, root = await self._open_watch(t, request.path, request.recursive)
            wid = "w-" + secrets.token_hex(12)
            w = Watcher(t.sid, watch_events(self.e2b, lv, st, root, request.include_entry))
            self.watchers[wid] = w
            w.task.add_done_callback(lambda _: None)
            return F.CreateWatcherResponse(watcher_id=wid)
        return await _call(go)

    def _watcher(self, wid: str) -> Watcher:
        w = self.watchers.get(wid)
        if w is None or w.sid != CURRENT.get().sid:
            raise ConnectError(Code.NOT_FOUND, f"watcher {wid[:40]!r} not found")
        return w

    async def get_watcher_events(self, request: F.GetWatcherEventsRequest,
                                 ctx: RequestContext[Any, Any]) -> F.GetWatcherEventsResponse:
        w = self._watcher(request.watcher_id)
        # a change made through this surface just before: its events are on their way
        # (the agent coalesces each path's events for 50 ms)
        touched = self.e2b.touched.get(w.sid, 0.0)
        if time.monotonic() < touched + SETTLE:
            await w.settle(touched)
        if w.error is not None and not w.events:
            self.watchers.pop(request.watcher_id, None)
            raise connect_error(w.error) \
                if isinstance(w.error, ApiError | E2BError | TransportError) \
                else ConnectError(Code.UNAVAILABLE, str(w.error))
        events = list(w.events)
        w.events.clear()
        return F.GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, request: F.RemoveWatcherRequest,
                             ctx: RequestContext[Any, Any]) -> F.RemoveWatcherResponse:
        w = self._watcher(request.watcher_id)
        self.watchers.pop(request.watcher_id, None)
        w.stop()
        return F.RemoveWatcherResponse()


async def watch_events(e2b: E2B, lv: Live, st: Stream, root: str, with_entry: bool = False
                       ) -> AsyncIterator[F.FilesystemEvent]:
    """The agent's inotify events (checked by cpuos.api.dirs' rules) as E2B's: a name
    relative to the watched directory; a rename is the old name's RENAME and the new
    name's CREATE, as envd reports it; a file written through cpuos (a temporary name
    renamed over it) is the CREATE and WRITE of its name; ``with_entry``: each event's
    entry, where the path still exists."""
    done = False
    prefix = root.rstrip("/") + "/"

    async def ev_(path: str, kind: F.EventType) -> F.FilesystemEvent:
        out = F.FilesystemEvent(name=path[len(prefix):], type=kind)
        if with_entry and kind not in (F.EventType.REMOVE, F.EventType.RENAME):
            with contextlib.suppress(ApiError, TransportError):
                out.entry = entry(await e2b.mgr.session.file_call(lv, Kind.STAT, path))
        return out

    try:
        while True:
            h, payload = await st.get()
            if h["t"] == Kind.EVENTS:
                for ev in _clean_events(payload):
                    path = ev["path"]
                    if not path.startswith(prefix):
                        continue
                    if TEMP_RE.search(path):
                        continue  # (cpuos's atomic writes: a temporary name, renamed)
                    src = str(ev.get("from", ""))
                    if ev["type"] == "rename" and TEMP_RE.search(src):
                        # (what envd reports of its own write: create, chown, write)
                        for k in (F.EventType.CREATE, F.EventType.CHMOD, F.EventType.WRITE):
                            yield await ev_(path, k)
                        continue
                    if ev["type"] == "rename" and src.startswith(prefix):
                        yield await ev_(src, F.EventType.RENAME)
                        yield await ev_(path, F.EventType.CREATE)
                        continue
                    kind = EVENT_TYPES.get(ev["type"], F.EventType.WRITE)
                    if ev["type"] == "create" and not ev.get("dir"):
                        # (a file made and written within the agent's 50 ms window)
                        yield await ev_(path, kind)
                        kind = F.EventType.WRITE
                    yield await ev_(path, kind)
            elif h["t"] == Kind.EOF:
                done = True
                return
            else:
                raise_for_agent_error(h)
                raise ApiError("internal", f"unexpected agent frame {h['t']!r}")
    except AgentGone as e:
        raise ApiError("unavailable", C.gone_message(e2b.store, lv, e)) from None
    finally:
        st.close()
        if not done:
            e2b.mgr._spawn(lv.chan.send({"t": Kind.KILL, "id": st.id, "reason": "cancelled"}))


class Watcher:
    """A polled watcher: its events gathered in the daemon between polls (bounded: the
    oldest go first), until removed or its sandbox ends."""

    def __init__(self, sid: str, events: AsyncIterator[F.FilesystemEvent]) -> None:
        self.sid = sid
        self.events: deque[F.FilesystemEvent] = deque(maxlen=MAX_WATCH_EVENTS)
        self.error: BaseException | None = None
        self.created = time.monotonic()
        self.last_event = 0.0
        self._arrived = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(events))

    async def _run(self, events: AsyncIterator[F.FilesystemEvent]) -> None:
        try:
            async for ev in events:
                self.events.append(ev)
                self.last_event = time.monotonic()
                self._arrived.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.error = e

    async def settle(self, since: float) -> None:
        """Wait (until ``since`` + SETTLE at most) for the events of a change made at
        ``since`` through this surface: the first batch after it, then one more window of
        the agent's (it sends each path's events after 50 ms; a loaded host is slower)."""
        deadline = since + SETTLE
        while self.last_event <= since and not self.task.done():
            self._arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        await asyncio.sleep(max(0.0, min(AGENT_WINDOW, deadline - time.monotonic())))

    def stop(self) -> None:
        self.task.cancel()


def build(e2b: E2B) -> tuple[ProcessASGIApplication, FilesystemASGIApplication]:
    return (ProcessASGIApplication(ProcessService(e2b)),  # type: ignore[arg-type]
            FilesystemASGIApplication(FilesystemService(e2b)))  # type: ignore[arg-type]
