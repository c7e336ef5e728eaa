"""The code interpreter over the API: ``POST /sandboxes/{sid}/code`` runs a cell on the
sandbox's persistent kernel and streams its output as frames (see
cpuosd.lifecycle.kernel); ``POST /sandboxes/{sid}/kernel/restart`` starts the kernel anew
(its state is lost)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cpuos_agent import protocol as P
from cpuos_agent.protocol import parse_duration

from ..lifecycle.kernel import LANGUAGE_RE, restart_kernel, run_code
from ..lifecycle.manager import Manager
from .auth import Ws

router = APIRouter()
MAX_CODE = 1_000_000  # characters of one cell


def _language(v: str) -> str:
    if not LANGUAGE_RE.fullmatch(v):
        raise ValueError("language must be a kernel language such as 'python'")
    return v


class RunCode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(max_length=MAX_CODE)
    language: str = "python"
    timeout: float | str | None = Field(None, description="the cell is interrupted (SIGINT) "
                                        "after this; default 300 s")

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v, "timeout")

    @field_validator("language")
    @classmethod
    def _lang(cls, v: str) -> str:
        return _language(v)


class RestartKernel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: str = "python"

    @field_validator("language")
    @classmethod
    def _lang(cls, v: str) -> str:
        return _language(v)


def _mgr(request: Request) -> Manager:
    m: Manager = request.app.state.mgr
    return m


@router.post("/sandboxes/{sid}/code",
             responses={200: {"content": {P.CONTENT_TYPE: {}},
                              "description": "a stream of frames: started, out (fd 1|2), "
                              "cut, item (n, main, mime; the content in the payload), "
                              "exception (ename, evalue; the traceback), then done or error"}})
async def code(sid: str, body: RunCode, request: Request, ws: Ws) -> StreamingResponse:
    """Run a cell on the sandbox's kernel; variables, imports and cwd stay for the next."""
    lv = await _mgr(request).ready(ws, sid)
    frames = await run_code(_mgr(request), lv, body.code, body.language,
                            None if body.timeout is None else float(body.timeout))
    return StreamingResponse(frames, media_type=P.CONTENT_TYPE,
                             headers={"Cache-Control": "no-store"})


@router.post("/sandboxes/{sid}/kernel/restart")
async def restart(sid: str, request: Request, ws: Ws,
                  body: RestartKernel | None = None) -> dict[str, Any]:
    """A fresh kernel: every variable and import of the old one is gone."""
    lv = await _mgr(request).ready(ws, sid)
    return await restart_kernel(_mgr(request), lv, (body or RestartKernel()).language)
