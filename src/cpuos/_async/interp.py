"""``sbx.interpreter`` (and ``sbx.run_code``, ``sbx.restart_kernel``): a persistent
IPython kernel inside the sandbox (written once here; the sync twin is generated)."""

from __future__ import annotations

import codecs
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cpuos_agent.protocol import CONTENT_TYPE, FrameDecoder, ProtocolError

from .._code import CodeError, CodeResult, Result, add_item
from .._durations import parse_duration
from .._errors import InvalidArgument, ServerError, Unavailable, error_from
from .._models import DEFAULT_MAX_OUTPUT, OutputBuffer

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

OutputCallback = Callable[[str], Any]
ResultCallback = Callable[[Result], Any]


async def _call(cb: Callable[[Any], Any] | None, arg: Any) -> None:
    if cb is not None:
        r = cb(arg)
        if inspect.isawaitable(r):
            await r


class AsyncInterpreter:
    """The sandbox's code interpreter: one kernel per language (``python``; others only
    where the template has a kernel for them), whose variables, imports and working
    directory persist from one ``run_code`` to the next."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    async def run_code(self, code: str, language: str = "python", *,
                       timeout: str | float | None = None,
                       on_stdout: OutputCallback | None = None,
                       on_stderr: OutputCallback | None = None,
                       on_result: ResultCallback | None = None,
                       max_output: int = DEFAULT_MAX_OUTPUT) -> CodeResult:
        """Run a cell. Returns its stdout, stderr, rich results (every matplotlib figure as
        PNG bytes, DataFrames as text and HTML, the last expression's value as
        ``result.text``) and the exception it raised (``result.error``, with its
        traceback). At ``timeout`` (default 300 s) the cell is interrupted (SIGINT, as
        Ctrl-C in Jupyter) and the kernel's state is kept (``timed_out`` set)."""
        if not isinstance(code, str):
            raise InvalidArgument("code must be a str")
        body: dict[str, Any] = {"code": code, "language": language}
        if timeout is not None:
            try:
                body["timeout"] = parse_duration(timeout, "timeout")
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
        bufs = {1: OutputBuffer(max_output), 2: OutputBuffer(max_output)}
        dropped = {1: 0, 2: 0}
        cbs = {1: on_stdout, 2: on_stderr}
        decoders = {1: codecs.getincrementaldecoder("utf-8")("replace"),
                    2: codecs.getincrementaldecoder("utf-8")("replace")}
        items: dict[int, Result] = {}
        res = CodeResult()
        done: dict[str, Any] | None = None
        dec = FrameDecoder()
        last_item: int | None = None
        try:
            async for chunk in self._sbx._http.stream(
                    "POST", f"/sandboxes/{self._sbx.id}/code", json=body,
                    headers={"Accept": CONTENT_TYPE}):
                for h, payload in dec.feed(chunk):
                    t = h.get("t")
                    if t != "item" and last_item is not None:
                        await _call(on_result, items[last_item])
                        last_item = None
                    if t == "out" and h.get("fd") in (1, 2):
                        fd = h["fd"]
                        bufs[fd].add(payload)
                        if cbs[fd] is not None:
                            text = decoders[fd].decode(payload)
                            if text:
                                await _call(cbs[fd], text)
                    elif t == "cut" and h.get("fd") in (1, 2):
                        n = h.get("dropped")
                        dropped[h["fd"]] += n if isinstance(n, int) and n > 0 else 0
                    elif t == "item" and isinstance(h.get("n"), int):
                        n = h["n"]
                        if last_item is not None and last_item != n:
                            await _call(on_result, items[last_item])
                        add_item(items, n, h.get("main") is True, str(h.get("mime")), payload)
                        last_item = n if n in items else None
                    elif t == "exception":
                        res.error = CodeError(str(h.get("ename")), str(h.get("evalue")),
                                              payload.decode("utf-8", "replace"))
                    elif t == "started":
                        res.exec_id = h.get("exec_id")
                    elif t == "done":
                        done = h
                    elif t == "error":
                        raise error_from(None, h.get("code"), str(h.get("message")))
            if last_item is not None:
                await _call(on_result, items[last_item])
        except ProtocolError as e:
            raise ServerError(f"malformed run_code stream: {e}") from None
        if done is None:
            raise Unavailable("run_code stream ended without its result")
        for fd in (1, 2):
            tail = decoders[fd].decode(b"", final=True)
            if tail:
                await _call(cbs[fd], tail)
        res.stdout_bytes, res.stderr_bytes = bufs[1].value(), bufs[2].value()
        res.stdout_total = bufs[1].total + dropped[1]
        res.stderr_total = bufs[2].total + dropped[2]
        res.truncated = bufs[1].truncated or bufs[2].truncated or any(dropped.values())
        res.results = [items[k] for k in sorted(items)]
        count = done.get("execution_count")
        res.execution_count = count if isinstance(count, int) else None
        res.timed_out = done.get("timed_out") is True
        res.restarted = done.get("restarted") is True
        res.duration = float(done.get("duration") or 0.0)
        n = done.get("dropped_items")
        res.dropped_results = n if isinstance(n, int) else 0
        if done.get("status") == "died" and res.error is None:
            res.error = CodeError("KernelDied", "the kernel died; it was restarted and its "
                                  "state is lost", "")
        return res

    async def restart(self, language: str = "python") -> None:
        """A fresh kernel: every variable and import of the old one is gone."""
        await self._sbx._http.request("POST", f"/sandboxes/{self._sbx.id}/kernel/restart",
                                      json={"language": language})
