"""``GET /events``: the event bus (cpuosd.events) as server-sent events, for the caller's
workspace: every state transition of its sandboxes (creating, running, pausing, paused,
resuming, killing, killed, error), and what the audit trail records as it happens
(``command``, ``file_write``, ``connection``, ``port``, ``network``, ``limit``, ``oom``,
``idle``). The web console's live views use it; so can any client.

Each event is ``event: <kind>`` and ``data: {"kind", "sandbox", "workspace", "previous",
"time", "transition", "fields"}``; a comment every 15 s keeps proxies from closing an idle
stream. Filters: ``sandbox=`` (one sandbox), ``kind=`` (repeated or comma-separated). The
admin gets every workspace with ``workspace=*``. Nothing is replayed: a client that
reconnects reads the current state again (``GET /sandboxes``). A client that does not keep
up is not waited for: past ``QUEUE`` undelivered events the oldest wait is cut and an
``overflow`` event (``{"dropped": n}``) says how many were lost.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from ..errors import invalid
from ..events import NOT_TRANSITIONS, EventBus, SandboxEvent
from ..paths import ID_RE
from .auth import all_workspaces
from .deps import ManagerDep, Ws
from ..lifecycle.states import GONE, SHOWN, State

router = APIRouter(tags=["events"])
QUEUE = 2000
HEARTBEAT = 15.0
KINDS = (*SHOWN, *sorted(NOT_TRANSITIONS))


def event_json(ev: SandboxEvent) -> dict[str, Any]:
    fields = ev.fields
    if ev.kind == "network":  # as the audit trail has it: secrets' names and CA left out
        pol = {k: v for k, v in (fields.get("network") or {}).items()
               if k not in ("secrets", "ca")}
        fields = {**fields, "network": pol}
    return {"kind": ev.kind, "sandbox": ev.sandbox, "workspace": ev.workspace,
            "previous": ev.previous, "time": ev.time,
            "transition": ev.kind not in NOT_TRANSITIONS, "fields": fields}


def _shown(ev: SandboxEvent) -> bool:
    """Not the daemon's own machinery: template images and the warm pool's sandboxes until
    one is handed out (it then shows up as ``pooled -> running`` in its new workspace)."""
    if not ev.workspace or ev.kind == State.POOLED:
        return False
    return not (ev.previous == State.POOLED and ev.kind in GONE)


@router.get("/events", responses={200: {"content": {"text/event-stream": {}},
                                        "description": "server-sent events (see the module)"}})
async def events(request: Request, mgr: ManagerDep, ws: Ws,
                 sandbox: str | None = Query(None, description="only this sandbox's events"),
                 kind: Annotated[list[str] | None, Query(description=(
                     "only these kinds (repeated or comma-separated)"))] = None
                 ) -> StreamingResponse:
    """The caller's workspace's sandbox events as they happen (server-sent events)."""
    kinds = {k for v in kind or () for k in v.split(",") if k}
    bad = sorted(kinds - set(KINDS))
    if bad:
        raise invalid(f"unknown kind {bad[0][:40]!r} (known: {', '.join(KINDS)})",
                      field="kind")
    if sandbox is not None:
        if not ID_RE.fullmatch(sandbox):
            raise invalid("bad sandbox id", field="sandbox")
        mgr.get(ws, sandbox)  # 404 unless the caller's
    every = all_workspaces(request)

    def accept(ev: SandboxEvent) -> bool:
        return (every or ev.workspace == ws) and _shown(ev) \
            and (sandbox is None or ev.sandbox == sandbox) and (not kinds or ev.kind in kinds)

    body = sse(mgr.events, accept, {"workspace": "*" if every else ws})
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def sse(bus: EventBus, accept: Callable[[SandboxEvent], bool], hello: dict[str, Any],
        heartbeat: float = HEARTBEAT) -> AsyncIterator[bytes]:
    """The bus's events that ``accept`` takes, as server-sent events: ``hello`` (with the
    time) first, a comment every ``heartbeat`` s, ``overflow`` past QUEUE undelivered
    events. Subscribed while the body is iterated (a stream never started holds none)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[SandboxEvent] = asyncio.Queue(QUEUE)
    dropped = 0

    def put(ev: SandboxEvent) -> None:
        nonlocal dropped
        try:
            queue.put_nowait(ev)
        except asyncio.QueueFull:
            dropped += 1

    def on_event(ev: SandboxEvent) -> None:
        if not accept(ev):
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            put(ev)
        else:  # (published from another thread)
            loop.call_soon_threadsafe(put, ev)

    async def stream() -> AsyncIterator[bytes]:
        nonlocal dropped
        unsubscribe = bus.subscribe(on_event)
        try:
            yield (f"retry: 2000\nevent: hello\ndata: "
                   f"{json.dumps({'time': time.time(), **hello})}\n\n").encode()
            while True:
                if dropped:
                    n, dropped = dropped, 0
                    yield f"event: overflow\ndata: {json.dumps({'dropped': n})}\n\n".encode()
                try:
                    ev = await asyncio.wait_for(queue.get(), heartbeat)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                data = json.dumps(event_json(ev), separators=(",", ":"), default=str)
                yield f"event: {ev.kind}\ndata: {data}\n\n".encode()
        finally:
            unsubscribe()

    return stream()
