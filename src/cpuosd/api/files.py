"""Files of a sandbox, one at a time: write (the body streamed in), read (streamed out, raw
or as frames), remove, list a directory, stat, mkdir. Directories as tar streams and
watching for changes: ``dirs``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from cpuos_agent import protocol as P

from ..errors import invalid
from ..paths import check_path
from .deps import ManagerDep, Ws
from .models import PathQ
from .streams import MaxBytesQ, file_response

router = APIRouter()


@router.put("/sandboxes/{sid}/files")
async def put_file(sid: str, path: PathQ, request: Request, mgr: ManagerDep, ws: Ws
                   ) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid, "files")
    return await mgr.session.write_file(lv, check_path(path), request.stream())


@router.get("/sandboxes/{sid}/files",
            responses={200: {"content": {"application/octet-stream": {}, P.CONTENT_TYPE: {}},
                             "description": "the file's bytes (Content-Length when its size "
                             "is exact; a failure mid-way cuts the response short), or with "
                             f"Accept: {P.CONTENT_TYPE} frames: data..., then eof or error"}})
async def get_file(sid: str, path: PathQ, request: Request, mgr: ManagerDep, ws: Ws,
                   max_bytes: MaxBytesQ = None) -> StreamingResponse:
    lv = await mgr.ready(ws, sid, "files")
    body = await mgr.session.read_file(lv, check_path(path), max_bytes)
    return file_response(body, request.headers.get("accept", ""))


@router.delete("/sandboxes/{sid}/files")
async def remove_file(sid: str, path: PathQ, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid, "files")
    p = check_path(path)
    if p == "/":
        raise invalid("refusing to remove /", field="path")
    await mgr.session.file_call(lv, "remove", p)
    return {"removed": p}


@router.get("/sandboxes/{sid}/files/list")
async def list_files(sid: str, mgr: ManagerDep, ws: Ws, path: PathQ = "/work"
                     ) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid, "files")
    return {"entries": await mgr.session.file_call(lv, "list", check_path(path))}


@router.get("/sandboxes/{sid}/files/stat")
async def stat_file(sid: str, path: PathQ, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid, "files")
    result: dict[str, Any] = await mgr.session.file_call(lv, "stat", check_path(path))
    return result


@router.post("/sandboxes/{sid}/files/mkdir")
async def mkdir(sid: str, path: PathQ, mgr: ManagerDep, ws: Ws) -> dict[str, Any]:
    lv = await mgr.ready(ws, sid, "files")
    result: dict[str, Any] = await mgr.session.file_call(lv, "mkdir", check_path(path))
    return result
