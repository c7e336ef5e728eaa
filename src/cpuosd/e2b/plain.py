"""envd's plain HTTP routes (``/health``, ``/files`` read and write, ``/envs``) and the code
interpreter's (``/execute``, ``/contexts``), on cpuos's file API and kernel.

Errors are E2B's ``{"code": <status>, "message"}``. A file read streams (Content-Length when
its size is exact); an upload streams into the sandbox as it arrives — multipart parts one
after another, octet-stream (gzip or not) — never held whole in the daemon."""

from __future__ import annotations

import base64
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

from cpuos_agent import protocol as P
from cpuos_agent.messages import Frame
from cpuos_agent.protocol import Kind
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from ..api.streams import CutOnFailure, file_response
from ..agentconn import TransportError
from ..errors import STATUS, ApiError, api_error
from ..lifecycle.interpreter import LANGUAGE_RE, restart_kernel, run_code
from ..lifecycle.exec_files import StreamCut
from .envd import CURRENT
from .state import E2B, HOME, E2BError, Target
from ..lifecycle.states import GONE, State

log = logging.getLogger("cpuosd.e2b")
MAX_PARTS = 1000  # files of one multipart upload
MAX_PART_HEAD = 16 << 10
MAX_JSON = 8 << 20
MAX_INFLATE = 1 << 20  # bytes inflated from a gzip upload per step
UPLOAD_QUEUE = 8  # chunks between the request body and the agent


def _error(e: ApiError | E2BError | TransportError) -> JSONResponse:
    if isinstance(e, TransportError):
        e = api_error(e)
    if isinstance(e, E2BError):
        return JSONResponse(e.body(), status_code=e.status)
    status = STATUS.get(e.code, 500)
    if e.code in ("invalid_argument", "is_a_directory", "not_a_directory") \
            or status in (413, 422):
        status = 400
    return JSONResponse({"code": status, "message": e.message}, status_code=status)


async def _json(request: Request) -> dict[str, Any]:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON:
            raise E2BError(413, f"request body too large (at most {MAX_JSON} bytes)")
    try:
        d = json.loads(body or b"{}")
    except ValueError:
        raise E2BError(400, "the body is not JSON") from None
    if not isinstance(d, dict):
        raise E2BError(400, "the body must be a JSON object")
    return d


def _user(request: Request) -> None:
    u = request.query_params.get("username")
    if u and u != "user":
        raise E2BError(403, f"cpuos runs file operations as 'user' only (asked: {u[:40]!r})")


class Plain:
    def __init__(self, e2b: E2B) -> None:
        self.e2b = e2b
        self.envd = Router(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/files", self.read, methods=["GET"]),
            Route("/files", self.write, methods=["POST"]),
            Route("/envs", self.envs, methods=["GET"]),
        ])
        self.jupyter = Router(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/execute", self.execute, methods=["POST"]),
            Route("/contexts", self.contexts, methods=["GET", "POST"]),
            Route("/contexts/{cid}", self.remove_context, methods=["DELETE"]),
            Route("/contexts/{cid}/restart", self.restart_context, methods=["POST"]),
        ])

    # -- envd -----------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        t = CURRENT.get()
        row = self.e2b.store.get_sandbox(t.sid)
        if row is None or row.state not in (State.RUNNING, State.CREATING, State.RESUMING):
            return JSONResponse({"sandboxId": t.sid, "code": 502,
                                 "message": "The sandbox was not found"
                                 if row is None or row.state in GONE
                                 else f"The sandbox is {row.state}"}, status_code=502)
        return Response(status_code=204)

    async def envs(self, request: Request) -> Response:
        t = CURRENT.get()
        row = t.row
        env = {**(row.spec.template_env or {}), **(row.spec.env or {})}
        return JSONResponse(env)

    async def read(self, request: Request) -> Response:
        t = CURRENT.get()
        try:
            _user(request)
            path = t.path(request.query_params.get("path") or "")
            lv = await t.ready()
            st = await self.e2b.mgr.session.file_call(lv, Kind.STAT, path)
            if st["type"] == "dir":
                raise E2BError(400, f"{path} is a directory")
            body = await self.e2b.mgr.session.read_file(lv, path)
        except (ApiError, E2BError, TransportError) as e:
            return _error(e)
        return file_response(body, "")

    async def write(self, request: Request) -> Response:
        t = CURRENT.get()
        try:
            _user(request)
            if any(k.lower().startswith("x-metadata-") for k in request.headers):
                raise E2BError(400, "file metadata (X-Metadata-*, xattrs) is not supported "
                               "by cpuos")
            lv = await t.ready()
            self.e2b.touch(t.sid)
            ctype, opts = parse_options_header(request.headers.get("content-type", ""))
            if ctype == b"multipart/form-data":
                boundary = opts.get(b"boundary")
                if not boundary:
                    raise E2BError(400, "multipart body without a boundary")
                written = await self._multipart(t, lv, request, boundary)
            else:
                p = request.query_params.get("path")
                if not p:
                    raise E2BError(400, "name the file: ?path=")
                path = t.path(p)
                body: AsyncIterator[bytes] = request.stream()
                enc = request.headers.get("content-encoding", "identity").lower()
                if enc == "gzip":
                    body = _gunzip(body)
                elif enc not in ("identity", ""):
                    raise E2BError(400, f"unsupported Content-Encoding {enc!r}")
                await self.e2b.mgr.session.write_file(lv, path, body)
                written = [path]
            self.e2b.touch(t.sid)
            if not written:
                raise E2BError(400, "no file in the upload")
        except (ApiError, E2BError, TransportError) as e:
            return _error(e)
        return JSONResponse([{"name": p.rsplit("/", 1)[-1], "type": "file", "path": p}
                             for p in written])

    async def _multipart(self, t: Target, lv: Any, request: Request, boundary: bytes
                         ) -> list[str]:
        """Each part's bytes go to the sandbox as they arrive (the part's filename is its
        path, else ?path=); a bounded queue between the body and the agent."""
        import asyncio

        events: list[tuple[str, Any]] = []
        head: dict[str, bytes] = {}
        field: list[bytes] = [b"", b""]

        def on_header_field(data: bytes, start: int, end: int) -> None:
            field[0] += data[start:end]

        def on_header_value(data: bytes, start: int, end: int) -> None:
            field[1] += data[start:end]

        def on_header_end() -> None:
            if sum(len(v) for v in head.values()) + len(field[0]) + len(field[1]) \
                    > MAX_PART_HEAD:
                raise E2BError(400, "a part's headers are too large")
            head[field[0].decode("latin-1").lower()] = field[1]
            field[0], field[1] = b"", b""

        parser = MultipartParser(boundary, {
            "on_part_begin": lambda: head.clear(),
            "on_header_field": on_header_field, "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": lambda: events.append(("begin", dict(head))),
            "on_part_data": lambda d, s, e: events.append(("data", bytes(d[s:e]))),
            "on_part_end": lambda: events.append(("end", None)),
        })
        written: list[str] = []
        queue: asyncio.Queue[bytes | None] | None = None
        task: asyncio.Task[Any] | None = None
        single = request.query_params.get("path")

        async def part_body(q: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
            while (chunk := await q.get()) is not None:
                yield chunk

        try:
            async for chunk in request.stream():
                try:
                    parser.write(chunk)
                except MultipartParseError as e:
                    raise E2BError(400, f"malformed multipart body: {e}") from None
                for kind, v in events:
                    if kind == "begin":
                        _, opts = parse_options_header(v.get("content-disposition", b""))
                        name = opts.get(b"filename")
                        p = name.decode("utf-8", "replace") if name else single
                        if not p:
                            raise E2BError(400, "a part without a filename (its path)")
                        if len(written) >= MAX_PARTS:
                            raise E2BError(400, f"at most {MAX_PARTS} files per upload")
                        path = t.path(p)
                        queue = asyncio.Queue(UPLOAD_QUEUE)
                        task = asyncio.ensure_future(
                            self.e2b.mgr.session.write_file(lv, path, part_body(queue)))
                        written.append(path)
                    elif kind == "data" and queue is not None and v:
                        await _put(queue, v, task)
                    elif kind == "end" and queue is not None and task is not None:
                        await _put(queue, None, task)
                        await task
                        queue, task = None, None
                events.clear()
            try:
                parser.finalize()
            except MultipartParseError as e:
                raise E2BError(400, f"malformed multipart body: {e}") from None
            if task is not None:
                raise E2BError(400, "the multipart body ended inside a part")
        finally:
            if task is not None and not task.done():
                task.cancel()
        return written

    # -- the code interpreter -------------------------------------------------------------
    async def execute(self, request: Request) -> Response:
        t = CURRENT.get()
        try:
            body = await _json(request)
            code = body.get("code")
            if not isinstance(code, str):
                raise E2BError(400, "code must be a string")
            ctx, lang = body.get("context_id"), body.get("language")
            if ctx is not None and lang is not None:
                raise E2BError(400, "give context_id or language, not both")
            language = str(ctx or lang or "python")
            if not LANGUAGE_RE.fullmatch(language):
                raise E2BError(400, f"bad language or context {language[:40]!r}")
            if body.get("env_vars"):
                raise E2BError(400, "env_vars per execution are not supported by cpuos's "
                               "kernel: set envs at create")
            lv = await t.ready()
            frames = await run_code(self.e2b.mgr, lv, code, language, None)
        except (ApiError, E2BError, TransportError) as e:
            return _error(e)
        def gone() -> bool:
            row = self.e2b.store.get_sandbox(t.sid)
            return row is None or row.state in GONE

        # a sandbox that ends mid-cell cuts the response (as E2B's does: the SDK then asks
        # /health and says the sandbox was killed)
        return CutOnFailure(_ndjson(frames, gone), media_type="application/x-ndjson",
                            headers={"Cache-Control": "no-store"})

    def _context(self, language: str) -> dict[str, Any]:
        return {"id": language, "language": language, "cwd": HOME}

    async def contexts(self, request: Request) -> Response:
        """One context per language: the sandbox's kernel of that language (cpuos keeps
        one kernel per language; a context made here is that one, shared)."""
        if request.method == "GET":
            return JSONResponse([self._context("python")])
        try:
            body = await _json(request)
            language = str(body.get("language") or "python")
            if not LANGUAGE_RE.fullmatch(language):
                raise E2BError(400, f"bad language {language[:40]!r}")
            if language != "python":
                raise E2BError(400, f"no {language} kernel: cpuos's templates have Python's")
        except (ApiError, E2BError, TransportError) as e:
            return _error(e)
        return JSONResponse(self._context(language))

    async def restart_context(self, request: Request) -> Response:
        t = CURRENT.get()
        try:
            lv = await t.ready()
            await restart_kernel(self.e2b.mgr, lv, request.path_params["cid"])
        except (ApiError, E2BError, TransportError) as e:
            return _error(e)
        return Response(status_code=204)

    async def remove_context(self, request: Request) -> Response:
        """The language's kernel starts anew (its state is gone, as a removed context's)."""
        return await self.restart_context(request)


async def _put(q: Any, v: bytes | None, task: Any) -> None:
    """Into the part's queue, unless its write already failed (then its error)."""
    import asyncio

    put = asyncio.ensure_future(q.put(v))
    done, _ = await asyncio.wait({put, task}, return_when=asyncio.FIRST_COMPLETED)
    if put not in done:
        put.cancel()
        task.result()  # raises the write's error
        raise E2BError(500, "the upload ended early")


async def _gunzip(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in body:
            buf = chunk
            while buf:
                out = d.decompress(buf, MAX_INFLATE)
                if out:
                    yield out
                buf = d.unconsumed_tail
        rest = d.flush()
        if rest:
            yield rest
    except zlib.error as e:
        raise E2BError(400, f"bad gzip body: {e}") from None


MIME_KEYS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
             "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
             "text/latex": "latex", "application/json": "json",
             "application/javascript": "javascript", "application/pdf": "pdf"}


async def _ndjson(frames: AsyncIterator[bytes], gone: Any = None) -> AsyncIterator[bytes]:
    """cpuos's cell frames (lifecycle.interpreter) as the E2B code interpreter's lines
    (``gone()``: the sandbox ended: the stream is cut, StreamCut)."""
    dec = P.FrameDecoder()
    item: dict[str, Any] | None = None
    item_n: int | None = None

    def line(d: dict[str, Any]) -> bytes:
        return json.dumps(d, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    def flush() -> list[bytes]:
        nonlocal item, item_n
        out = [line(item)] if item is not None else []
        item, item_n = None, None
        return out

    async for raw in frames:
        for h, payload in dec.feed(raw):
            t = h.get("t")
            if t == Frame.ITEM:
                if h.get("n") != item_n:
                    for b in flush():
                        yield b
                    item_n = h.get("n")
                    item = {"type": "result", "is_main_result": h.get("main") is True}
                key = MIME_KEYS.get(str(h.get("mime")))
                if key is None or item is None:
                    continue
                if key in ("png", "jpeg", "pdf"):
                    item[key] = base64.b64encode(payload).decode()
                elif key == "json":
                    try:
                        item[key] = json.loads(payload)
                    except ValueError:
                        continue
                else:
                    text = payload.decode("utf-8", "replace")
                    if key == "text" and item["is_main_result"] and len(text) >= 2 \
                            and text[0] == text[-1] and text[0] in "'\"":
                        text = text[1:-1]  # (E2B strips a plain string's quotes)
                    item[key] = text
                continue
            for b in flush():
                yield b
            if t == Frame.OUT:
                yield line({"type": "stderr" if h.get("fd") == 2 else "stdout",
                            "text": payload.decode("utf-8", "replace"),
                            "timestamp": time.time_ns() // 1000})
            elif t == Frame.EXCEPTION:
                yield line({"type": "error", "name": h.get("ename") or "Error",
                            "value": h.get("evalue") or "",
                            "traceback": payload.decode("utf-8", "replace")})
            elif t == Frame.DONE:
                if h.get("execution_count") is not None:
                    yield line({"type": "number_of_executions",
                                "execution_count": h["execution_count"]})
                if h.get("timed_out"):
                    yield line({"type": "error", "name": "TimeoutError",
                                "value": "the cell was interrupted at its timeout",
                                "traceback": ""})
            elif t == Frame.ERROR:
                if h.get("code") == "unavailable" and gone is not None and gone():
                    raise StreamCut(str(h.get("message")))
                yield line({"type": "error", "name": str(h.get("code") or "Error"),
                            "value": str(h.get("message") or ""), "traceback": ""})
    for b in flush():
        yield b
    yield line({"type": "end_of_execution"})
