"""The code interpreter over the API: ``POST /sandboxes/{sid}/code`` runs a cell on the
sandbox's persistent kernel and streams its output as frames (see
cpuosd.lifecycle.interpreter); ``POST /sandboxes/{sid}/kernel/restart`` starts the kernel anew
(its state is lost)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from cpuos_agent import protocol as P

from ..lifecycle.interpreter import restart_kernel, run_code
from .deps import ManagerDep, Ws
from .models import RestartKernel, RunCode

router = APIRouter()


@router.post("/sandboxes/{sid}/code",
             responses={200: {"content": {P.CONTENT_TYPE: {}},
                              "description": "a stream of frames: started, out (fd 1|2), "
                              "cut, item (n, main, mime; the content in the payload), "
                              "exception (ename, evalue; the traceback), then done or error"}})
async def code(sid: str, body: RunCode, mgr: ManagerDep, ws: Ws) -> StreamingResponse:
    """Run a cell on the sandbox's kernel; variables, imports and cwd stay for the next."""
    lv = await mgr.ready(ws, sid)
    frames = await run_code(mgr, lv, body.code, body.language,
                            None if body.timeout is None else float(body.timeout))
    return StreamingResponse(frames, media_type=P.CONTENT_TYPE,
                             headers={"Cache-Control": "no-store"})


@router.post("/sandboxes/{sid}/kernel/restart")
async def restart(sid: str, mgr: ManagerDep, ws: Ws,
                  body: RestartKernel | None = None) -> dict[str, Any]:
    """A fresh kernel: every variable and import of the old one is gone."""
    lv = await mgr.ready(ws, sid)
    return await restart_kernel(mgr, lv, (body or RestartKernel()).language)
