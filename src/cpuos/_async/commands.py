"""``sbx.commands``: background commands, which run on after the call that started them,
after this client is gone and across a daemon restart; their output is kept in the sandbox
(a ring of ``buffer`` bytes) and can be read again from any offset it still holds.

>>> h = await sbx.exec("python -m http.server 8000", background=True)
>>> h.pid
>>> for c in await sbx.commands.list(): ...
>>> h2 = await sbx.commands.connect(h.pid, on_stdout=print)
>>> await h2.kill("TERM"); result = await h2.wait()
"""

from __future__ import annotations

import builtins
import codecs
import inspect
import typing
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from cpuos_agent.protocol import CONTENT_TYPE, FrameDecoder, ProtocolError

from .._errors import InvalidArgument, ServerError, Unavailable, error_from
from .._models import DEFAULT_MAX_OUTPUT, CommandInfo, ExecResult, OutputBuffer

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

OutputCallback = Callable[[str], Any]
# (typing's Iterable: the sync twin's AsyncIterable becomes collections.abc's Iterable)
StdinSource = bytes | str | typing.Iterable[bytes | str] | AsyncIterable[bytes | str]


def _as_bytes(b: object) -> bytes:
    if isinstance(b, str):
        return b.encode()
    if isinstance(b, (bytes, bytearray, memoryview)):
        return bytes(b)
    raise InvalidArgument(f"stdin chunks must be bytes or str, not {type(b).__name__}")


async def stdin_chunks(src: StdinSource) -> AsyncIterator[bytes]:
    """The bytes of a stdin source (bytes, str, or an iterable of them), as they come."""
    if isinstance(src, (bytes, bytearray, memoryview, str)):
        yield _as_bytes(src)
        return
    if hasattr(src, "__aiter__"):
        async for b in src:
            yield _as_bytes(b)
    else:
        for b in src:
            yield _as_bytes(b)


class OutputSink:
    """What an output stream's frames become: callbacks with decoded text as it arrives,
    and the raw bytes kept (at most ``max_output`` per stream, head and tail)."""

    def __init__(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self.bufs = {1: OutputBuffer(max_output), 2: OutputBuffer(max_output)}
        self.cbs = {1: on_stdout, 2: on_stderr}
        self.decoders = {1: codecs.getincrementaldecoder("utf-8")("replace"),
                         2: codecs.getincrementaldecoder("utf-8")("replace")}

    async def out(self, fd: int, payload: bytes) -> None:
        self.bufs[fd].add(payload)
        cb = self.cbs[fd]
        if cb is not None:
            text = self.decoders[fd].decode(payload)
            if text:
                r = cb(text)
                if inspect.isawaitable(r):
                    await r

    async def flush(self) -> None:
        for fd in (1, 2):
            cb = self.cbs[fd]
            tail = self.decoders[fd].decode(b"", final=True)
            if cb is not None and tail:
                r = cb(tail)
                if inspect.isawaitable(r):
                    await r

    def result(self, exit_h: dict[str, Any], exec_id: str | None = None) -> ExecResult:
        b = self.bufs
        return ExecResult(
            exit_code=int(exit_h["exit_code"]), stdout_bytes=b[1].value(),
            stderr_bytes=b[2].value(), duration=float(exit_h.get("duration") or 0.0),
            timed_out=bool(exit_h.get("timed_out")), signal=exit_h.get("signal"),
            oom=bool(exit_h.get("oom")), truncated=b[1].truncated or b[2].truncated,
            exec_id=exec_id, stdout_total=b[1].total, stderr_total=b[2].total)


class AsyncCommandHandle:
    """A background command: ``pid``; ``wait()`` streams its output (from ``offset``) to
    the callbacks and returns its result once it exits; ``kill``, ``send_stdin``,
    ``close_stdin``. Any number of handles may follow one command."""

    def __init__(self, commands: AsyncCommands, pid: int, *,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None, offset: int = 0,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self._commands = commands
        self.pid = pid
        self.on_stdout, self.on_stderr = on_stdout, on_stderr
        self.offset = offset
        self.max_output = max_output

    @property
    def _base(self) -> str:
        return f"{self._commands._base}/{self.pid}"

    async def info(self) -> CommandInfo:
        return CommandInfo.from_json(await self._commands._http.request("GET", self._base))

    async def wait(self) -> ExecResult:
        """Follow its output to the end (the callbacks get it as it comes) and return its
        result: exit status and the output kept (from ``offset``). Raises ``Unavailable``
        if the sandbox stops answering; calling ``wait`` again resumes where it was."""
        sink = OutputSink(self.on_stdout, self.on_stderr, self.max_output)
        exit_h = await self._follow(sink)
        await sink.flush()
        return sink.result(exit_h)

    async def _follow(self, sink: OutputSink, follow: bool = True) -> dict[str, Any]:
        dec = FrameDecoder()
        end: dict[str, Any] | None = None
        try:
            async for chunk in self._commands._http.stream(
                    "GET", self._base + "/output",
                    params={"offset": self.offset, "follow": str(follow).lower()},
                    headers={"Accept": CONTENT_TYPE}):
                for h, payload in dec.feed(chunk):
                    t = h.get("t")
                    if t == "out" and h.get("fd") in (1, 2):
                        await sink.out(h["fd"], payload)
                        self.offset = int(h.get("off") or 0) + len(payload)
                    elif t == "attached":
                        self.offset = max(self.offset, int(h.get("offset") or 0))
                    elif t in ("exit", "eof"):
                        end = h
                        self.offset = int(h.get("next") or self.offset)
                    elif t == "error":
                        raise error_from(None, h.get("code"), str(h.get("message")),
                                         {"pid": self.pid, "offset": self.offset})
        except ProtocolError as e:
            raise ServerError(f"malformed output stream: {e}") from None
        if end is None:
            raise Unavailable(f"the output stream of {self.pid} ended before its end",
                              details={"pid": self.pid, "offset": self.offset})
        return end

    async def output(self) -> tuple[bytes, bytes]:
        """What it has written from ``offset`` up to now (stdout, stderr), without waiting;
        ``offset`` moves past it."""
        sink = OutputSink(None, None, self.max_output)
        await self._follow(sink, follow=False)
        return sink.bufs[1].value(), sink.bufs[2].value()

    async def kill(self, signal: str | int = "KILL") -> CommandInfo:
        """Send it a signal (default KILL: its whole process tree ends)."""
        return CommandInfo.from_json(await self._commands._http.request(
            "POST", self._base + "/signal", json={"signal": signal}))

    async def send_stdin(self, data: StdinSource) -> int:
        """Write to its stdin (bytes, str, or an iterable of them, streamed no faster than
        the command reads); the byte count."""
        d = await self._commands._http.request("POST", self._base + "/stdin",
                                               content=stdin_chunks(data))
        return int(d["written"])

    async def close_stdin(self) -> None:
        await self._commands._http.request("POST", self._base + "/stdin",
                                           params={"close": "true"}, content=b"")


class AsyncCommands:
    """``sbx.commands``: the sandbox's background commands."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    @property
    def _http(self) -> Any:
        return self._sbx._http

    @property
    def _base(self) -> str:
        return f"/sandboxes/{self._sbx.id}/commands"

    async def run(self, cmd: str | builtins.list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None, timeout: float | None = None,
                  buffer: int | None = None, stdin: bool = True,
                  on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None) -> AsyncCommandHandle:
        """Start ``cmd`` in the background (``sbx.exec(cmd, background=True)``)."""
        body: dict[str, Any] = {"cmd": cmd, "env": env or {}, "cwd": cwd, "timeout": timeout,
                                "stdin": stdin}
        if buffer is not None:
            body["buffer"] = buffer
        d = await self._http.request("POST", self._base, json=body)
        return AsyncCommandHandle(self, int(d["pid"]), on_stdout=on_stdout,
                                  on_stderr=on_stderr)

    async def list(self) -> builtins.list[CommandInfo]:
        d = await self._http.request("GET", self._base)
        return [CommandInfo.from_json(x) for x in d["commands"]]

    async def connect(self, pid: int, *, on_stdout: OutputCallback | None = None,
                      on_stderr: OutputCallback | None = None, offset: int = 0
                      ) -> AsyncCommandHandle:
        """A handle on a background command started by anyone (another client, before a
        daemon restart); ``wait()`` on it streams its output from ``offset``."""
        await self._http.request("GET", f"{self._base}/{pid}")  # NotFound if there is none
        return AsyncCommandHandle(self, pid, on_stdout=on_stdout, on_stderr=on_stderr,
                                  offset=offset)

    async def kill(self, pid: int, signal: str | int = "KILL") -> CommandInfo:
        return await AsyncCommandHandle(self, pid).kill(signal)

    async def send_stdin(self, pid: int, data: StdinSource) -> int:
        return await AsyncCommandHandle(self, pid).send_stdin(data)

    async def close_stdin(self, pid: int) -> None:
        await AsyncCommandHandle(self, pid).close_stdin()
