"""File bodies as the API sends them (``GET /sandboxes/{id}/files``): framed for clients
that ask for frames, raw bytes otherwise; a failure after the headers is reported either
way (cpuosd.lifecycle.exec_files.FileStream)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query
from starlette.responses import StreamingResponse
from starlette.types import Send

from cpuos_agent import protocol as P

from ..lifecycle.exec_files import FileStream, StreamCut

MaxBytesQ = Annotated[int | None, Query(
    ge=0, description="the most bytes the client accepts: a file declaring more is 413 "
    "too_large before its body, a stream passing it ends with too_large (at most, and by "
    "default, CPUOS_MAX_READ_BYTES)")]


class CutOnFailure(StreamingResponse):
    """A streamed body that, when its source fails, ends without its proper end: the
    server closes the connection before the declared Content-Length or the chunked
    encoding's last chunk, so the client sees an incomplete body, never a short one that
    looks whole."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except StreamCut:
            return  # no final message: the server drops the connection mid-body
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def file_response(body: FileStream, accept: str) -> StreamingResponse:
    if P.CONTENT_TYPE in accept:
        return StreamingResponse(body.framed(), media_type=P.CONTENT_TYPE,
                                 headers={"Cache-Control": "no-store"})
    headers = {"Cache-Control": "no-store"}
    if body.length is not None:
        headers["Content-Length"] = str(body.length)
    return CutOnFailure(body.raw(), media_type="application/octet-stream", headers=headers)
