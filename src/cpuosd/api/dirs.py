"""Directories as tar streams: ``/sandboxes/{id}/files/tar``.

- ``PUT /sandboxes/{id}/files/tar?path=DIR``: the body is a tar (optionally gzip) extracted
  into DIR (created). Every entry is checked before anything is written: an absolute path,
  a ``..``, a link pointing outside DIR, an entry through a link of the archive, a device
  or FIFO: the whole archive is refused (422) and nothing is written. Modes and mtimes are
  kept. -> ``{"path", "files", "dirs", "links", "bytes"}``.
- ``GET /sandboxes/{id}/files/tar?path=DIR[&max_bytes=N]``: a tar (PAX) of DIR, links
  stored as links; raw bytes, or with ``Accept: application/x-cpuos-frames`` frames
  (``data``..., ``eof`` or ``error``) as for a file read. At most ``max_bytes`` (and
  CPUOS_MAX_READ_BYTES): past it the stream ends with ``too_large``.
- ``GET /sandboxes/{id}/files/watch?path=DIR&recursive=true``: changes under DIR (inotify
  inside the sandbox; the path rules of the file API), as frames: ``watching`` (path,
  watches), then ``events`` (n, overflow: events were lost, rescan; the payload a JSON
  array of {type: create|modify|delete|rename, path, dir, from?}; one per path per 50 ms
  window) until the client leaves, then ``eof`` (DIR is gone) or ``error``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from cpuos_agent import protocol as P
from cpuos_agent.messages import Frame
from cpuos_agent.protocol import Kind

from ..agentconn import AgentGone, Stream, TransportError, open_stream, raise_for_agent_error
from ..lifecycle.commands import gone_message
from ..errors import ApiError, api_error
from ..lifecycle.manager import Manager
from ..lifecycle.exec_files import FileStream
from ..paths import check_path
from .deps import ManagerDep, Ws
from .streams import MaxBytesQ, file_response

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
async def put_tar(sid: str, path: str, request: Request, m: ManagerDep, ws: Ws
                  ) -> dict[str, Any]:
    """Extract the tar in the body into the directory ``path`` (all or nothing)."""
    lv = await m.ready(ws, sid, "files")
    dest = check_path(path)
    if dest == "/":
        raise ApiError("invalid_argument", "extract into a directory below /")
    archive = f"{dest.rstrip('/')}/.cpuos-upload-{secrets.token_hex(8)}.tar"
    await m.session.write_file(lv, archive, request.stream())
    # (the agent removes the archive once it has tried it, whatever came of it)
    h = await lv.chan.call({"t": Kind.UNTAR, "archive": archive, "path": dest}, UNTAR_WAIT)
    got = h.get("extracted")
    n: dict[str, Any] = got if isinstance(got, dict) else {}
    return {"path": dest, **{k: _count(n.get(k)) for k in ("files", "dirs", "links", "bytes")}}


@router.get("/sandboxes/{sid}/files/tar",
            responses={200: {"content": {"application/x-tar": {}, P.CONTENT_TYPE: {}},
                             "description": "a tar of the directory (raw; or frames with "
                             f"Accept: {P.CONTENT_TYPE}: data..., then eof or error)"}})
async def get_tar(sid: str, path: str, request: Request, m: ManagerDep, ws: Ws,
                  max_bytes: MaxBytesQ = None) -> StreamingResponse:
    lv = await m.ready(ws, sid, "files")
    src = check_path(path)
    limit = m.session.read_limit(max_bytes)
    st, _ = await open_stream(lv.chan, {"t": Kind.TAR, "path": src}, 30.0, f"open {src}")
    return file_response(FileStream(m.session, lv, st, src, None, limit),
                         request.headers.get("accept", ""))


EVENT_TYPES = ("create", "modify", "delete", "rename")
MAX_EVENTS = 1000  # per frame, as the agent batches them


def _clean_events(payload: bytes) -> list[dict[str, Any]]:
    try:
        raw = json.loads(payload)
    except ValueError:
        raise ApiError("internal", "sandbox agent sent malformed events") from None
    if not isinstance(raw, list):
        raise ApiError("internal", "sandbox agent sent malformed events")
    out = []
    for e in raw[:MAX_EVENTS]:
        if not isinstance(e, dict) or e.get("type") not in EVENT_TYPES:
            continue
        path = e.get("path")
        if not isinstance(path, str) or not path.startswith("/") or "\x00" in path \
                or len(path) > 4096:
            continue
        ev: dict[str, Any] = {"type": e["type"], "path": path, "dir": e.get("dir") is True}
        src = e.get("from")
        if e["type"] == "rename" and isinstance(src, str) and src.startswith("/") \
                and "\x00" not in src and len(src) <= 4096:
            ev["from"] = src
        out.append(ev)
    return out


@router.get("/sandboxes/{sid}/files/watch",
            responses={200: {"content": {P.CONTENT_TYPE: {}},
                             "description": "frames: watching, events (JSON array "
                             "payload)..., then eof or error"}})
async def watch(sid: str, path: str, m: ManagerDep, ws: Ws, recursive: bool = True
                ) -> StreamingResponse:
    """Changes under a directory as they happen (until the client leaves)."""
    lv = await m.ready(ws, sid, "files")
    root = check_path(path)
    st, h = await open_stream(lv.chan, {"t": Kind.WATCH, "path": root, "recursive": recursive},
                              60.0, f"watch {root}")
    watches = h.get("watches")
    return StreamingResponse(_watch_frames(m, lv, st, root, watches),
                             media_type=P.CONTENT_TYPE, headers={"Cache-Control": "no-store"})


async def _watch_frames(m: Manager, lv: Any, st: Stream, root: str, watches: Any
                        ) -> AsyncIterator[bytes]:
    done = False
    try:
        yield P.encode({"t": Frame.WATCHING, "path": root,
                        "watches": watches if isinstance(watches, int) else 0})
        while True:
            h, payload = await st.get()
            if h["t"] == Kind.EVENTS:
                evs = _clean_events(payload)
                yield P.encode({"t": Frame.EVENTS, "n": len(evs),
                                "overflow": h.get("overflow") is True},
                               json.dumps(evs, separators=(",", ":")).encode())
            elif h["t"] == Kind.EOF:
                done = True
                yield P.encode({"t": Frame.EOF})
                return
            else:
                raise_for_agent_error(h)
                raise ApiError("internal", f"unexpected agent frame {h['t']!r}")
    except AgentGone as e:
        yield P.encode({"t": Frame.ERROR, "code": "unavailable",
                        "message": gone_message(m.store, lv, e)})
    except (ApiError, TransportError) as e:
        err = api_error(e)
        yield P.encode({"t": Frame.ERROR, "code": err.code, "message": err.message})
    finally:
        st.close()
        if not done:
            m._spawn(lv.chan.send({"t": Kind.KILL, "id": st.id, "reason": "cancelled"}))
