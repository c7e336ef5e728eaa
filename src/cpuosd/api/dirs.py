"""Directories as tar streams: ``/sandboxes/{id}/files/tar``.

- ``PUT /sandboxes/{id}/files/tar?path=DIR``: the body is a tar (optionally gzip) extracted
  into DIR (created). Every entry is checked before anything is written: an absolute path,
  a ``..``, a link pointing outside DIR, an entry through a link of the archive, a device
  or FIFO: the whole archive is refused (422) and nothing is written. Modes and mtimes are
  kept. -> ``{"path", "files", "dirs", "links", "bytes"}``.
- ``GET /sandboxes/{id}/files/tar?path=DIR``: a tar (PAX) of DIR, links stored as links;
  raw bytes, or with ``Accept: application/x-cpuos-frames`` frames (``data``..., ``eof`` or
  ``error``) as for a file read.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from cpuos_agent import protocol as P

from ..agentconn import raise_for_agent_error
from ..errors import ApiError
from ..lifecycle.manager import Manager
from ..lifecycle.session import FileStream
from ..paths import check_path
from .auth import Ws
from .streams import file_response

router = APIRouter(tags=["files"])
UNTAR_WAIT = 600.0  # s for the agent to extract an archive


class Extracted(BaseModel):
    path: str
    files: int
    dirs: int
    links: int
    bytes: int


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


@router.put("/sandboxes/{sid}/files/tar", response_model=Extracted)
async def put_tar(sid: str, path: str, request: Request, ws: Ws) -> dict[str, Any]:
    """Extract the tar in the body into the directory ``path`` (all or nothing)."""
    m: Manager = request.app.state.mgr
    lv = await m.ready(ws, sid, "files")
    dest = check_path(path)
    if dest == "/":
        raise ApiError("invalid_argument", "extract into a directory below /")
    archive = f"{dest.rstrip('/')}/.cpuos-upload-{secrets.token_hex(8)}.tar"
    await m.write_file(lv, archive, request.stream())
    # (the agent removes the archive once it has tried it, whatever came of it)
    h = await lv.chan.call({"t": "untar", "archive": archive, "path": dest}, UNTAR_WAIT)
    got = h.get("extracted")
    n: dict[str, Any] = got if isinstance(got, dict) else {}
    return {"path": dest, **{k: _count(n.get(k)) for k in ("files", "dirs", "links", "bytes")}}


@router.get("/sandboxes/{sid}/files/tar",
            responses={200: {"content": {"application/x-tar": {}, P.CONTENT_TYPE: {}},
                             "description": "a tar of the directory (raw; or frames with "
                             f"Accept: {P.CONTENT_TYPE}: data..., then eof or error)"}})
async def get_tar(sid: str, path: str, request: Request, ws: Ws) -> StreamingResponse:
    m: Manager = request.app.state.mgr
    lv = await m.ready(ws, sid, "files")
    src = check_path(path)
    st = lv.chan.open()
    try:
        await st.send({"t": "tar", "path": src})
        try:
            h, _ = await st.get(30.0)
        except TimeoutError:
            raise ApiError("timeout", f"sandbox agent did not open {src}") from None
        raise_for_agent_error(h)
        if h.get("t") != "ok":
            raise ApiError("internal", f"unexpected agent answer {h.get('t')!r}")
    except BaseException:
        st.close()
        raise
    return file_response(FileStream(m, lv, st, src, None), request.headers.get("accept", ""))
