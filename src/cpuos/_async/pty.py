"""``sbx.pty``: terminals (a real pseudo-terminal inside: job control, ^C, full-screen
programs), each over one WebSocket; a terminal outlives its client (``disconnect`` and
``connect(pid)`` again, from anywhere).

>>> t = await sbx.pty.create(cols=120, rows=40, on_data=lambda b: print(b.decode(), end=""))
>>> await t.send_input("ls\\n"); await t.resize(100, 30)
>>> await t.send_input("exit\\n"); result = await t.wait()
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed

from .._errors import CpuosError, InvalidArgument, ServerError, Unavailable, error_from
from .._models import DEFAULT_MAX_OUTPUT, CommandInfo, ExecResult, OutputBuffer
from .._pumps import AsyncBeside
from .._ws import AsyncWsConn, ws_connect_async

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

DataCallback = Callable[[bytes], Any]


class AsyncTerminal:
    """One attached terminal: ``pid`` (its id; ``sbx.commands`` works on it too),
    ``send_input``, ``resize``, ``kill``, ``wait``, ``disconnect``."""

    def __init__(self, pty: AsyncPty, pid: int, conn: AsyncWsConn,
                 on_data: DataCallback | None, head: dict[str, Any],
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self._pty, self.pid, self._conn, self.on_data = pty, pid, conn, on_data
        self.offset = int(head.get("offset") or 0)
        self.output = OutputBuffer(max_output)
        self.exit: dict[str, Any] | None = None
        self.error: CpuosError | None = None
        self._detached = False
        self._reader = AsyncBeside(self._read)

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._conn.recv()
                if isinstance(msg, bytes):
                    self.offset += len(msg)
                    self.output.add(msg)
                    if self.on_data is not None:
                        r = self.on_data(msg)
                        if inspect.isawaitable(r):
                            await r
                    continue
                try:
                    ctl = json.loads(msg)
                except ValueError:
                    continue
                if ctl.get("type") == "exit":
                    self.exit = ctl
                elif ctl.get("type") == "error":
                    self.error = error_from(None, ctl.get("code"), str(ctl.get("message")),
                                            {"pid": self.pid})
        except ConnectionClosed as e:
            # the daemon closes with 4000 + an HTTP status (4401: the key was revoked)
            code = e.rcvd.code if e.rcvd is not None else 0
            if self.exit is None and self.error is None and 4400 <= code < 4600:
                reason = (e.rcvd.reason if e.rcvd else "") or f"terminal closed ({code})"
                self.error = error_from(code - 4000, None, reason,
                                        {"pid": self.pid})
        if self.exit is None and self.error is None and not self._detached:
            self.error = Unavailable(f"the connection to terminal {self.pid} closed",
                                     details={"pid": self.pid, "offset": self.offset})

    async def send_input(self, data: bytes | str) -> None:
        """Keystrokes (or any bytes) to the terminal."""
        if isinstance(data, str):
            data = data.encode()
        try:
            await self._conn.send(bytes(data))
        except ConnectionClosed:
            raise self.error or Unavailable(f"terminal {self.pid} is not attached") from None

    async def resize(self, cols: int, rows: int) -> None:
        if not (0 < cols <= 1000 and 0 < rows <= 1000):
            raise InvalidArgument("cols and rows must be 1..1000")
        try:
            await self._conn.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))
        except ConnectionClosed:
            raise self.error or Unavailable(f"terminal {self.pid} is not attached") from None

    async def kill(self, signal: str | int = "KILL") -> CommandInfo:
        """Send its process group a signal (default KILL: the whole tree ends)."""
        return await self._pty._sbx.commands.kill(self.pid, signal)

    async def wait(self) -> ExecResult:
        """Until it exits: its status, and the output seen by this client
        (``stdout_bytes``: at most ``max_output``, head and tail). Raises
        ``Unavailable`` if the sandbox stops answering (``connect`` again later)."""
        await self._reader.join()
        if self.error is not None:
            raise self.error
        if self.exit is None:
            raise Unavailable(f"terminal {self.pid} was disconnected before it exited")
        b = self.output
        return ExecResult(exit_code=int(self.exit.get("exit_code") or 0),
                          stdout_bytes=b.value(), stderr_bytes=b"",
                          duration=float(self.exit.get("duration") or 0.0),
                          timed_out=bool(self.exit.get("timed_out")),
                          signal=self.exit.get("signal"), truncated=b.truncated,
                          stdout_total=b.total)

    async def disconnect(self) -> None:
        """Detach: the terminal and what runs on it go on (``sbx.pty.connect(pid)``)."""
        self._detached = True
        await self._conn.close()
        await self._reader.join()


class AsyncPty:
    """``sbx.pty``: create terminals and attach to them."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    async def create(self, cols: int = 80, rows: int = 24, *,
                     on_data: DataCallback | None = None,
                     cmd: str | list[str] | None = None, env: dict[str, str] | None = None,
                     cwd: str | None = None, timeout: float | None = None,
                     buffer: int | None = None, max_output: int = DEFAULT_MAX_OUTPUT
                     ) -> AsyncTerminal:
        """A new terminal of cols x rows running ``cmd`` (default a login bash); its
        output goes to ``on_data`` (bytes) as it comes."""
        body: dict[str, Any] = {"cols": cols, "rows": rows, "env": env or {}, "cwd": cwd,
                                "timeout": timeout}
        if cmd is not None:
            body["cmd"] = cmd
        if buffer is not None:
            body["buffer"] = buffer
        d = await self._sbx._http.request("POST", f"/sandboxes/{self._sbx.id}/pty", json=body)
        return await self.connect(int(d["pid"]), on_data=on_data, max_output=max_output)

    async def connect(self, pid: int, *, on_data: DataCallback | None = None,
                      offset: int = 0, max_output: int = DEFAULT_MAX_OUTPUT
                      ) -> AsyncTerminal:
        """Attach to terminal ``pid``: its output from ``offset`` (0: all it still keeps;
        -1: only what comes next), then live."""
        http = self._sbx._http
        try:
            conn = await ws_connect_async(http.url, f"/sandboxes/{self._sbx.id}/pty/{pid}/ws"
                                          f"?offset={int(offset)}", http.key)
        except (OSError, TimeoutError) as e:
            raise Unavailable(f"cannot reach cpuosd at {http.url}: {e}") from None
        except Exception as e:  # the handshake refused (e.g. a bad key: HTTP 403)
            raise ServerError(f"terminal {pid}: {e}") from None
        try:
            first = await conn.recv()
            head = json.loads(first) if isinstance(first, str) else {}
        except ConnectionClosed:
            raise Unavailable(f"terminal {pid}: the connection closed") from None
        if head.get("type") == "error":
            await conn.close()
            raise error_from(None, head.get("code"), str(head.get("message")), {"pid": pid})
        if head.get("type") != "attached":
            await conn.close()
            raise ServerError(f"terminal {pid}: unexpected first message {str(first)[:80]!r}")
        return AsyncTerminal(self, pid, conn, on_data, head, max_output)
