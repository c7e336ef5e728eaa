"""``GET /events`` through the API tier: every node's events of the caller's workspace on one
stream (docs/DEPLOY.md).

An event happens on the node holding the sandbox (its ``EventBus``). An API process fans
them in: while anyone reads ``/events`` through it, it keeps one stream open to each live
node's internal ``GET /node/events`` (node token only: every workspace's events that
``/events`` would show, cpuosd.api.eventstream), whatever the number of its readers, and
hands each event to the readers whose workspace (or ``workspace=*``, the admin), sandbox and
kinds it matches. The nodes are re-read every second (``Forwarder.view``): a node that
joins is subscribed to, a node that goes away ends its own stream only (it is retried
while the node counts as alive, and the readers get an ``overflow`` event naming the node
when it comes back, as events may have been missed: the console then reads the list
again). Buffers are bounded at each step: the node's queue per stream (cpuosd.api
.eventstream.QUEUE, then ``overflow``), and each reader's queue here (the same bound and the
same ``overflow``). A reader's key (or console session) is checked again every
``RECHECK`` s: revoking it, or signing out, ends the stream.

Why not the database (Postgres ``LISTEN``/``NOTIFY``): every event of every node (each
command, file write and connection) would become a write to the shared database, whether
anyone watches or not, behind ``NOTIFY``'s cluster-wide commit lock and its 8000-byte
payload limit. Here events stay on their node unless an API process has a reader, and cost
one HTTP stream per (API process, node).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..api.auth import bearer_key, target_workspace
from ..api.eventstream import HEARTBEAT, KINDS, QUEUE, _shown, sse
from ..console.sessions import cookie_token
from ..errors import ApiError, invalid, not_found
from ..paths import ID_RE
from .nodes import TOKEN_HEADER

if TYPE_CHECKING:
    from .api import Forwarder

log = logging.getLogger("cpuosd.cluster")

NODE_KEEPALIVE = 5.0  # s between a node stream's comments (an API process's read timeout: 4x)
RETRY = 1.0  # s before a node's stream is opened again
RECHECK = 10.0  # s between checks of a reader's key or session
LINGER = 30.0  # s the node streams stay open after the last reader left (a page reload)
READY_WAIT = 3.0  # s a new reader waits for the streams of the live nodes to be open


# ---- a node's side: every shown event, for API processes (the node token) -------------------
async def serve_node(app: Any, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /node/events`` on a node (cpuosd.cluster.nodes.NodeTokenGuard, after the node
    token): the events ``/events`` shows, of every workspace."""
    from ..api.deps import services_of

    svc = services_of(app)
    body = sse(svc.manager.events, _shown, {"node": svc.manager.node_id}, NODE_KEEPALIVE)
    resp = StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})
    await resp(scope, receive, send)


# ---- an API process's side ---------------------------------------------------------------------
@dataclass(eq=False)
class Reader:
    """One ``/events`` request: what it wants, and its bounded queue."""

    workspace: str
    every: bool
    sandbox: str | None
    kinds: frozenset[str]
    queue: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(QUEUE))
    dropped: int = 0
    gaps: list[str] = field(default_factory=list)  # nodes whose stream broke meanwhile

    def wants(self, ev: dict[str, Any]) -> bool:
        return (self.every or ev.get("workspace") == self.workspace) \
            and (self.sandbox is None or ev.get("sandbox") == self.sandbox) \
            and (not self.kinds or ev.get("kind") in self.kinds)

    def put(self, chunk: bytes) -> None:
        try:
            self.queue.put_nowait(chunk)
        except asyncio.QueueFull:
            self.dropped += 1


class FanIn:
    """The node streams of one API process, shared by its readers."""

    def __init__(self, fwd: Forwarder) -> None:
        self.fwd = fwd
        self.readers: set[Reader] = set()
        self.streams: dict[str, asyncio.Task[None]] = {}
        self.open: set[str] = set()  # nodes whose stream is open now
        self.lost: set[str] = set()  # nodes whose stream broke (until it is open again)
        self._watch: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def add(self, r: Reader) -> None:
        self.readers.add(r)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._run())

    def remove(self, r: Reader) -> None:
        self.readers.discard(r)

    async def ready(self, timeout: float = READY_WAIT) -> list[str]:
        """Wait (up to ``timeout``) until every live node's stream is open; those open."""
        deadline = time.monotonic() + timeout
        while True:
            alive = {n.node_id for n in self.fwd.view.nodes if n.alive}
            left = deadline - time.monotonic()
            if alive <= self.open or left <= 0:
                return sorted(self.open)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.2))

    async def close(self) -> None:
        tasks = [t for t in (self._watch, *self.streams.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        """Keep a stream open to each live node while there are readers (and LINGER s
        after the last left)."""
        idle_since: float | None = None
        try:
            while True:
                now = time.monotonic()
                if self.readers:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since > LINGER:
                    return
                try:
                    for n in self.fwd.view.nodes:
                        t = self.streams.get(n.node_id)
                        if n.alive and (t is None or t.done()):
                            self.streams[n.node_id] = asyncio.ensure_future(
                                self._node(n.node_id))
                except Exception as e:  # (never leaves the readers without streams)
                    log.warning("the event fan-in: %s", e)
                await asyncio.sleep(0.5)
        finally:
            for t in self.streams.values():
                t.cancel()
            await asyncio.gather(*self.streams.values(), return_exceptions=True)
            self.streams.clear()
            self.open.clear()
            self.lost.clear()

    async def _node(self, node_id: str) -> None:
        """One node's stream, opened again after a break while the node counts as alive (and
        by ``_run`` when it is alive again)."""
        while True:
            node = self.fwd.view.get(node_id)
            if node is None or not node.alive:
                return
            try:
                async with self.fwd.http.stream(
                        "GET", f"http://{node.address}/node/events",
                        headers={TOKEN_HEADER: self.fwd.token},
                        timeout=httpx.Timeout(5.0, read=NODE_KEEPALIVE * 4)) as resp:
                    if resp.status_code != 200:
                        raise httpx.HTTPError(f"status {resp.status_code}")
                    await self._read(node_id, resp)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # (httpx's, a node that stops mid-stream)
                log.info("the event stream of node %s ended: %s", node_id, e)
            finally:
                if node_id in self.open:
                    self.open.discard(node_id)
                    self.lost.add(node_id)
            await asyncio.sleep(RETRY)

    async def _read(self, node_id: str, resp: httpx.Response) -> None:
        kind, data = "message", ""
        async for line in resp.aiter_lines():
            if line == "":
                if data:
                    self._event(node_id, kind, data)
                kind, data = "message", ""
            elif line.startswith(":"):
                continue
            elif line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()

    def _event(self, node_id: str, kind: str, data: str) -> None:
        if kind == "hello":
            self.open.add(node_id)
            self._changed.set()
            if node_id in self.lost:  # (what the node emitted meanwhile is lost: say so)
                self.lost.discard(node_id)
                for r in self.readers:
                    r.gaps.append(node_id)
            return
        if kind == "overflow":  # (the node dropped some for this stream: maybe anyone's)
            for r in self.readers:
                r.gaps.append(node_id)
            return
        try:
            ev = json.loads(data)
        except ValueError:
            return
        if not isinstance(ev, dict):
            return
        chunk = f"event: {kind}\ndata: {data}\n\n".encode()
        for r in self.readers:
            if r.wants(ev):
                r.put(chunk)


def _caller(fwd: Forwarder, scope: Scope, sandbox: str | None) -> tuple[str, bool]:
    """(the workspace the reader acts in, whether it asked for every workspace); ApiError
    (401, 403, 404) as on one host."""
    headers = scope["headers"]
    key = bearer_key(headers)
    found: tuple[str, str] | None = None
    if key is not None:
        found = fwd.store.key_lookup(key)
        if found is None:
            raise ApiError("unauthorized", "invalid API key (unknown, revoked, or of a "
                           "deleted workspace)")
    else:
        token = cookie_token(headers)
        s = fwd.sessions.get(token, live_key=True) if token else None
        if s is None:
            raise ApiError("unauthorized", "console session expired or signed out: sign in "
                           "again at /ui" if token else
                           "missing API key: send 'Authorization: Bearer <key>'")
        found = (s.key_id, s.workspace)
    wid, every = target_workspace(scope, fwd.store, found[1])
    if sandbox is not None:
        row = fwd.store.get_sandbox(sandbox)
        if row is None or row.workspace_id != wid:
            raise not_found("sandbox", sandbox)
    return wid, every


def _still_live(fwd: Forwarder, headers: list[tuple[bytes, bytes]]) -> bool:
    key = bearer_key(headers)
    if key is not None:
        return fwd.store.key_lookup(key) is not None
    token = cookie_token(headers)
    return token is not None and fwd.sessions.get(token, live_key=True) is not None


async def events(fwd: Forwarder, fan: FanIn, request: Request) -> Response:
    """``GET /events`` on an API process: as on one host (cpuosd.api.eventstream), from
    every node."""
    q = request.query_params
    kinds = frozenset(k for v in q.getlist("kind") for k in v.split(",") if k)
    sandbox = q.get("sandbox")
    try:
        bad = sorted(kinds - set(KINDS))
        if bad:
            raise invalid(f"unknown kind {bad[0][:40]!r} (known: {', '.join(KINDS)})",
                          field="kind")
        if sandbox is not None and not ID_RE.fullmatch(sandbox):
            raise invalid("bad sandbox id", field="sandbox")
        wid, every = await asyncio.to_thread(_caller, fwd, request.scope, sandbox)
    except ApiError as e:
        return JSONResponse(e.body(), status_code=e.status)
    headers = list(request.scope["headers"])
    reader = Reader(wid, every, sandbox, kinds)

    async def stream() -> AsyncIterator[bytes]:
        fan.add(reader)
        try:
            nodes = await fan.ready()
            hello = {"time": time.time(), "workspace": "*" if every else wid, "nodes": nodes}
            yield f"retry: 2000\nevent: hello\ndata: {json.dumps(hello)}\n\n".encode()
            checked = last = time.monotonic()
            while True:
                if reader.dropped or reader.gaps:
                    n, reader.dropped = reader.dropped, 0
                    gaps, reader.gaps = sorted(set(reader.gaps)), []
                    info: dict[str, Any] = {"dropped": n if not gaps else None}
                    if gaps:
                        info["nodes"] = gaps
                    yield f"event: overflow\ndata: {json.dumps(info)}\n\n".encode()
                try:
                    chunk = await asyncio.wait_for(reader.queue.get(), 1.0)
                    last = time.monotonic()
                    yield chunk
                except TimeoutError:
                    if time.monotonic() - last >= HEARTBEAT:
                        last = time.monotonic()
                        yield b": keep-alive\n\n"
                if time.monotonic() - checked >= RECHECK:
                    checked = time.monotonic()
                    if not await asyncio.to_thread(_still_live, fwd, headers):
                        return  # (revoked or signed out: the stream ends)
        finally:
            fan.remove(reader)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
