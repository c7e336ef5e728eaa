"""Exec and files over the agent channel: everything the agent sends is checked and
rebuilt before it reaches a client."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from cpuos_agent import messages as M
from cpuos_agent import protocol as P
from cpuos_agent.messages import Frame
from cpuos_agent.protocol import Kind

from ..agentconn import AgentGone, TransportError, open_stream, raise_for_agent_error
from ..errors import ApiError, api_error
from ..events import EventBus, SandboxEvent
from ..store import Store
from .commands import ExecStdin
from .common import Live, Spawn, _base_env
from .states import State

log = logging.getLogger("cpuosd.lifecycle")


ENTRY_TYPES = {"file", "dir", "symlink", "other"}
MAX_ENTRIES = 10000
MAX_FILE = 1 << 50  # a declared size beyond this is not believed
READ_IDLE = 60.0  # s: a file read with no data from the agent for this long fails
_PATH_OPS: dict[str, Literal[Kind.STAT, Kind.LIST, Kind.MKDIR]] = {
    Kind.STAT: Kind.STAT, Kind.LIST: Kind.LIST, Kind.MKDIR: Kind.MKDIR}


class StreamCut(Exception):
    """A file stream failed after its response began: the response must end without its
    proper end (cpuosd.api.streams)."""


class FileStream:
    """A file being read from a sandbox, in one of the two forms the API sends (the
    frames themselves are cpuos_agent.protocol's):

    * ``framed()`` (``application/x-cpuos-frames``, for clients that ask for it, e.g. the
      SDK): ``data`` frames (raw bytes), then ``eof`` (with ``size``, the byte count) or
      ``error`` (``code``, ``message``): a failure after the headers is a frame.
    * ``raw()``: the bytes. ``length`` is set when the agent declared an exact size (the
      response gets a Content-Length); on a failure ``raw()`` raises ``StreamCut`` and the
      response is cut short: its declared length, or the chunked encoding's last chunk,
      is never reached, which every HTTP client reports as an error.

    Nothing the agent sends is trusted: it may not send more than it declared, nor end
    with less, nor more than ``limit`` bytes in all (``too_large``: the stream is cut and
    the agent told to stop)."""

    def __init__(self, session: Session, lv: Live, st: Any, path: str, length: int | None,
                 limit: int) -> None:
        self.session, self.lv, self.st, self.path, self.length = session, lv, st, path, length
        self.limit = limit

    async def _chunks(self) -> AsyncIterator[bytes]:
        n = 0
        done = False
        try:
            while True:
                h, payload = await self.st.get(READ_IDLE)
                if h["t"] == Kind.DATA:
                    n += len(payload)
                    if n > self.limit:
                        raise ApiError("too_large", f"{self.path}: more than the limit of "
                                       f"{self.limit} bytes", {"limit": self.limit})
                    if self.length is not None and n > self.length:
                        raise ApiError("internal", f"sandbox agent sent more of {self.path} "
                                       f"than the {self.length} bytes it declared")
                    yield payload
                elif h["t"] == Kind.EOF:
                    if self.length is not None and n != self.length:
                        raise ApiError("internal", f"{self.path}: {n} bytes of the "
                                       f"{self.length} declared")
                    done = True
                    return
                else:
                    raise_for_agent_error(h)
                    raise ApiError("internal", f"unexpected agent frame {h['t']!r}")
        except TimeoutError:
            raise ApiError("timeout", f"sandbox agent sent nothing of {self.path} for "
                           f"{READ_IDLE:.0f}s") from None
        except AgentGone:
            row = self.session.store.get_sandbox(self.lv.row.id)
            why = f"sandbox is {row.state} ({row.reason})" if row and row.state != State.RUNNING \
                else "sandbox agent disconnected"
            raise ApiError("unavailable", f"reading {self.path}: {why}") from None
        finally:
            self.st.close()
            if not done:  # the agent stops reading (a client that left, a failure)
                with contextlib.suppress(Exception):
                    self.session.spawn(self.lv.chan.send({"t": Kind.KILL, "id": self.st.id,
                                                          "reason": "cancelled"}))

    async def framed(self) -> AsyncIterator[bytes]:
        n = 0
        try:
            async for chunk in self._chunks():
                n += len(chunk)
                yield P.encode({"t": Frame.DATA}, chunk)
        except (ApiError, TransportError) as e:
            err = api_error(e)
            log.info("read of %s in %s failed after %d bytes: %s", self.path,
                     self.lv.row.id, n, err.message)
            yield P.encode({"t": Frame.ERROR, "code": err.code, "message": err.message,
                            "size": n})
            return
        yield P.encode({"t": Frame.EOF, "size": n})

    async def raw(self) -> AsyncIterator[bytes]:
        n = 0
        try:
            async for chunk in self._chunks():
                n += len(chunk)
                yield chunk
        except (ApiError, TransportError) as e:
            log.info("read of %s in %s failed after %d bytes (response cut): %s", self.path,
                     self.lv.row.id, n, e.message)
            raise StreamCut(e.message) from None


class Session:
    """Exec and files on a live sandbox (``Manager.session``), given what it uses: the store
    (the execs' records), the event bus (the audit trail's commands and file writes), the
    Manager's ``ExecStdin`` (stdin streamed to execs), the bound of one read
    (``max_read_bytes``, CPUOS_MAX_READ_BYTES) and how to start a task the Manager owns
    (``spawn``: a kill sent to the agent after a stream ended early)."""

    def __init__(self, store: Store, events: EventBus, exec_stdin: ExecStdin,
                 max_read_bytes: int, spawn: Spawn) -> None:
        self.store, self.events, self.exec_stdin = store, events, exec_stdin
        self.max_read_bytes, self.spawn = max_read_bytes, spawn

    async def exec_start(self, lv: Live, cmd: str | list[str], env: dict[str, str],
                         cwd: str | None,
                         timeout: float | None, stdin: bytes | None,
                         stdin_stream: bool = False) -> AsyncIterator[bytes]:
        """Start a command; returns the frame stream for the HTTP response.

        ``stdin_stream``: its stdin stays open for ``POST .../execs/{exec_id}/stdin``
        (lifecycle.commands.ExecStdin), flow-controlled end to end.

        Errors that happen before the command runs raise ApiError (a proper HTTP
        status); everything after is reported inside the stream.
        """
        eid = "exe-" + secrets.token_hex(6)
        st = lv.chan.open()
        try:
            cwd = cwd or lv.row.spec.workdir or "/work"
            msg: M.Exec = {**M.command(cmd), "env": {**_base_env(lv.row), **env},
                           "cwd": cwd, "timeout": timeout,
                           "stdin": stdin is not None or stdin_stream}
            await st.send(msg)
            if stdin is not None:
                for i in range(0, len(stdin), P.CHUNK):
                    await st.send({"t": Kind.STDIN}, stdin[i:i + P.CHUNK])
                await st.send({"t": Kind.STDIN, "close": True})
            h, _ = await st.get(15.0)
            raise_for_agent_error(h)
            if h["t"] != Kind.STARTED:
                raise ApiError("internal", f"unexpected agent answer {h['t']!r}")
        except TimeoutError:
            st.close()
            raise ApiError("timeout", "sandbox agent did not start the command") from None
        except BaseException:
            st.close()
            raise
        self.store.insert_exec(eid, lv.row.id, ["/bin/bash", "-c", cmd] if isinstance(cmd, str)
                               else cmd)
        if stdin_stream:
            self.exec_stdin.add(lv.row.id, eid, st)
        # for the audit trail: what ran, where, with which variables (names, never values)
        what = {"exec_id": eid, **({"shell": cmd} if isinstance(cmd, str) else {"argv": cmd}),
                "cwd": cwd, "env": sorted(env), "source": "api"}
        return self._exec_frames(lv, st, eid, timeout, what)

    async def _exec_frames(self, lv: Live, st: Any, eid: str, timeout: float | None,
                           what: dict[str, Any] | None = None) -> AsyncIterator[bytes]:
        t0 = time.monotonic()
        counts = {1: 0, 2: 0}
        done = False
        result: dict[str, Any] = {}

        def settle() -> None:
            """The exec's record, its stdin sender and the ``command`` event. Done before
            its exit frame is yielded (the answer's end then follows that frame at once: a
            client, or an API process between, reads them together), else when the stream
            ends otherwise."""
            self.exec_stdin.end(lv.row.id, eid, st)
            st.close()
            self.store.finish_exec(
                eid, exit_code=result.get("exit_code"), signal=result.get("signal"),
                timed_out=int(bool(result.get("timed_out"))), error=result.get("message"),
                stdout_bytes=counts[1], stderr_bytes=counts[2])
            self.events.emit(SandboxEvent("command", lv.row.id, lv.row.workspace_id, None,
                                          fields={**(what or {"exec_id": eid}),
                                                  "exit_code": result.get("exit_code"),
                                                  "signal": result.get("signal"),
                                                  "timed_out": bool(result.get("timed_out")),
                                                  "error": result.get("message"),
                                                  "duration": round(time.monotonic() - t0, 6),
                                                  "stdout_bytes": counts[1],
                                                  "stderr_bytes": counts[2]}))

        try:
            yield P.encode({"t": Frame.STARTED, "exec_id": eid})
            # The agent enforces the timeout; the host allows a grace period on top.
            host_deadline = None if timeout is None else t0 + timeout + 10.0
            while True:
                wait = None if host_deadline is None else max(0.1, host_deadline - time.monotonic())
                try:
                    h, payload = await st.get(wait)
                except TimeoutError:
                    result = {"t": Frame.ERROR, "code": "timeout",
                              "message": "command did not finish after its timeout"}
                    yield P.encode(result)
                    break
                t = h["t"]
                if t == Kind.OUT:
                    fd = h.get("fd")
                    if fd not in (1, 2):
                        continue
                    counts[fd] += len(payload)
                    yield P.encode({"t": Frame.OUT, "fd": fd}, payload)
                elif t == Kind.EXIT:
                    result = _exit_frame(h, time.monotonic() - t0)
                    if result["oom"]:
                        self.events.emit(SandboxEvent(
                            "oom", lv.row.id, lv.row.workspace_id, None,
                            fields={"exec_id": eid, "exit_code": result["exit_code"]}))
                    done = True
                    settle()
                    yield P.encode(result)
                    break
                elif t == Kind.ERR:
                    raise_for_agent_error(h)
        except AgentGone as e:
            row = self.store.get_sandbox(lv.row.id)
            why = f"sandbox is {row.state} ({row.reason})" if row and row.state != State.RUNNING \
                else e.message
            result = {"t": Frame.ERROR, "code": "unavailable", "message": why}
            yield P.encode(result)
        except (ApiError, TransportError) as e:
            err = api_error(e)
            result = {"t": Frame.ERROR, "code": err.code, "message": err.message}
            yield P.encode(result)
        finally:
            if not done:
                # client went away or we gave up: kill the command's whole tree
                with contextlib.suppress(Exception):
                    self.spawn(lv.chan.send({"t": Kind.KILL, "id": st.id, "reason": "cancelled"}))
                settle()

    async def write_file(self, lv: Live, path: str, body: AsyncIterator[bytes]
                         ) -> dict[str, Any]:
        st = lv.chan.open()
        digest, size, error = hashlib.sha256(), 0, "cancelled"  # (the audit's: on the stream)
        try:
            await st.send({"t": Kind.WRITE, "path": path})
            async for chunk in body:
                digest.update(chunk)
                size += len(chunk)
                for i in range(0, len(chunk), P.CHUNK):
                    if not st.queue.empty():  # the agent refused early (e.g. permission)
                        h, _ = await st.get()
                        raise_for_agent_error(h)
                    await st.send({"t": Kind.DATA}, chunk[i:i + P.CHUNK])
            await st.send({"t": Kind.EOF})
            h, _ = await st.get(120.0)
            raise_for_agent_error(h)
            error = ""
            return _clean_stat(h.get("stat"), path)
        except TimeoutError:
            error = "timeout"
            raise ApiError("timeout", f"sandbox agent did not finish writing {path}") from None
        except BaseException as e:
            if isinstance(e, ApiError | TransportError):
                error = e.message
            with contextlib.suppress(Exception):
                self.spawn(lv.chan.send({"t": Kind.EOF, "id": st.id, "abort": True}))
            raise
        finally:
            st.close()
            self.events.emit(SandboxEvent("file_write", lv.row.id, lv.row.workspace_id, None,
                                          fields={"path": path, "size": size,
                                                  "sha256": digest.hexdigest(),
                                                  "ok": not error, "source": "api",
                                                  **({"error": error} if error else {})}))

    def read_limit(self, max_bytes: int | None) -> int:
        """The bound of one read: the client's ``max_bytes``, at most CPUOS_MAX_READ_BYTES."""
        cap = self.max_read_bytes
        return cap if max_bytes is None else min(max_bytes, cap)

    async def read_file(self, lv: Live, path: str, max_bytes: int | None = None
                        ) -> FileStream:
        """Open a file for reading: errors up to here are proper HTTP errors (a file whose
        declared size is over the read's limit: 413 ``too_large``, before a byte of it);
        what happens after (the body is on its way) is the FileStream's to report."""
        limit = self.read_limit(max_bytes)
        st, h = await open_stream(lv.chan, {"t": Kind.READ, "path": path}, 30.0, f"open {path}")
        size = h.get("size")
        exact = h.get("exact") is True and isinstance(size, int) and 0 < size <= MAX_FILE
        if exact and isinstance(size, int) and size > limit:
            st.close()
            with contextlib.suppress(Exception):
                self.spawn(lv.chan.send({"t": Kind.KILL, "id": st.id, "reason": "cancelled"}))
            raise ApiError("too_large", f"{path} is {size} bytes, over the limit of {limit}",
                           {"path": path, "size": size, "limit": limit})
        return FileStream(self, lv, st, path, size if exact else None, limit)

    async def file_call(self, lv: Live, op: str, path: str, **extra: Any) -> Any:
        """op: Kind.STAT, LIST, MKDIR or REMOVE (``recursive``, default true)."""
        msg: M.Remove | M.PathRequest
        if op == Kind.REMOVE:
            msg = M.Remove(t=Kind.REMOVE, path=path)
            if "recursive" in extra:
                msg["recursive"] = bool(extra["recursive"])
        elif op in _PATH_OPS:
            msg = M.PathRequest(t=_PATH_OPS[op], path=path)
        else:
            raise ValueError(f"not a file call: {op!r}")
        if op in (Kind.REMOVE, Kind.MKDIR):  # changes: on the audit trail, as file writes are
            error = "cancelled"
            try:
                h, payload = await lv.chan.call_full(msg)
                error = ""
            except (ApiError, TransportError) as e:
                error = e.message
                raise
            finally:
                self.events.emit(SandboxEvent(
                    "file_write", lv.row.id, lv.row.workspace_id, None,
                    fields={"op": op, "path": path, "ok": not error, "source": "api",
                            **({"error": error} if error else {})}))
        else:
            h, payload = await lv.chan.call_full(msg)
        if op == Kind.LIST:
            entries = h.get("entries")  # (agents before the listing moved to the payload)
            if entries is None and payload:
                try:
                    entries = json.loads(payload)
                except ValueError:
                    entries = None
            if not isinstance(entries, list):
                raise ApiError("internal", "sandbox agent sent a malformed listing")
            return [_clean_stat(e, None, parent=path) for e in entries[:MAX_ENTRIES]]
        if op in (Kind.STAT, Kind.MKDIR):
            return _clean_stat(h.get("stat"), path)
        return None


def _exit_frame(h: P.Header, duration: float) -> dict[str, Any]:
    """Rebuild the agent's exit report from checked fields only."""
    code = h.get("exit_code")
    sig = h.get("signal")
    return {
        "t": Frame.EXIT,
        "exit_code": code if isinstance(code, int) and -1 <= code <= 255 else -1,
        "signal": sig if isinstance(sig, int) and 0 < sig < 128 else None,
        "timed_out": h.get("timed_out") is True,
        "killed": h.get("killed") is True,
        "oom": h.get("oom") is True,
        "duration": round(duration, 6),
    }


def _clean_stat(d: Any, path: str | None, parent: str | None = None) -> dict[str, Any]:
    """Rebuild an entry from the agent with checked fields; never pass its data through."""
    if not isinstance(d, dict):
        raise ApiError("internal", "sandbox agent sent a malformed entry")
    name = d.get("name")
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 255 or (
            "/" in name and name != "/"):
        raise ApiError("internal", "sandbox agent sent a malformed file name")
    if path is None:
        path = (parent.rstrip("/") if parent else "") + "/" + name
    size, mode, mtime = d.get("size"), d.get("mode"), d.get("mtime")
    out: dict[str, Any] = {
        "name": name,
        "path": path,
        "type": d.get("type") if d.get("type") in ENTRY_TYPES else "other",
        "size": size if isinstance(size, int) and size >= 0 else 0,
        "mode": mode if isinstance(mode, int) and 0 <= mode <= 0o7777 else 0,
        "mtime": float(mtime) if isinstance(mtime, (int, float)) else 0.0,
    }
    target = d.get("target")
    if out["type"] == "symlink" and isinstance(target, str):
        out["target"] = target[:4096]
    return out
