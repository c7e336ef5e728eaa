"""``cpuosd --role=api``: the public API of many nodes at one address (docs/DEPLOY.md).

An API process keeps no state of its own: the state store (Postgres, CPUOS_DATABASE_URL) is
shared with the nodes. It checks the caller's API key against the store, picks the node a
request belongs to, and forwards the request there whole (httpx for HTTP, streamed both
ways; the ``websockets`` client for WebSockets), with the node token:

- a path under ``/sandboxes/<id>``: the node whose row holds the sandbox (``node_id``); a
  node that is not alive answers 503 ``unavailable`` (its sandboxes wait for it to come
  back or to be fenced);
- ``POST /sandboxes`` (create): placement (``cpuosd.cluster.nodes.place``: live, not
  cordoned, the memory free, the template built there first);
- anything else (workspaces, keys, usage, audit, templates, listings): any live node (they
  read and write the shared store).

So the SDKs and the CLI do not change: they talk to an API process as to one daemon. The
node re-checks the key, the workspace and every quota itself (the API process forwards the
caller's Authorization header as it came).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from ..api.auth import bearer_key
from ..config import Config
from ..console.sessions import SAFE_METHODS, Sessions, cookie_token, csrf_ok, same_origin
from ..errors import ApiError
from ..store import Store
from .transport import AiohttpTransport, NodeAnswer
from .nodes import (ROUTE_HEADER, SANDBOX_PATH, TOKEN_HEADER, KubeNodeView, NodeInfo, NodeView,
                    check_token, fence_dead, place)
from ..lifecycle.states import State

if TYPE_CHECKING:
    from ..wiring import ApiServices

log = logging.getLogger("cpuosd.cluster")

# the E2B surface (cpuosd.e2b): its control plane's paths naming a sandbox, its creates
E2B_SANDBOX_PATH = re.compile(r"^/e2b(?:/v2)?/sandboxes/([A-Za-z0-9_-]{1,64})(?:/|$)")
E2B_CREATES = frozenset({"/e2b/sandboxes", "/e2b/v2/sandboxes"})
OPEN_PATHS = frozenset({"/health"})
# hop-by-hop headers (RFC 9110 7.6.1) and those the forwarder sets itself (a node trusts
# X-Forwarded-Host on a request that carried the node token: only the forwarder sets it)
DROP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                  "trailer", "upgrade", "host", TOKEN_HEADER, ROUTE_HEADER,
                  "proxy-authorization", "x-forwarded-host"})
DROP_B = frozenset(k.encode() for k in DROP)
ROUTED = (ROUTE_HEADER.encode(), b"cached")
# (a WebSocket's Origin goes to the node with the Host it was sent to, X-Forwarded-Host:
# the node checks a console session's origin as one host does, cpuosd.console.sessions)
WS_DROP = DROP | {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                  "sec-websocket-protocol"}
REFRESH = 1.0  # s between reads of the nodes' rows
WS_MAX_MESSAGE = 16 << 20
SMALL_BODY = 64 << 10  # bytes of a request body read whole before it is forwarded
# no read timeout: a stream (exec output, watch, a long download) may be quiet for long; the
# node bounds every operation itself
TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=10.0)
TIMEOUTS = TIMEOUT.as_dict()
KEY_CACHE = 5.0  # s a key found valid is not looked up again (the node re-checks it)
ROUTE_CACHE = 60.0  # s a sandbox's node is remembered (the node refuses a stale guess: 421)


def _error(err: ApiError, e2b: bool = False) -> JSONResponse:
    """The API's error body, or (``e2b``: a request of the E2B surface) E2B's
    ``{"code": <status>, "message"}``, which E2B's SDKs read."""
    if e2b:
        return JSONResponse({"code": err.status, "message": err.message},
                            status_code=err.status)
    return JSONResponse(err.body(), status_code=err.status)


# glibc's malloc for a process that copies streams: blocks up to MMAP_THRESHOLD come from the
# heap, and up to TRIM_THRESHOLD of free heap is kept. By default each chunk of a stream
# bigger than the dynamic threshold (128 KiB at first) was a fresh mmap, faulted in page by
# page and unmapped when freed, and the heap's free top went back to the system: page
# faults and zeroing were ~11 % of the API process's CPU while it forwarded a stream of
# ~200 KB chunks. With these, its CPU per streamed MB was 1.19 ms against 1.56 (set through
# GLIBC_TUNABLES) and 1.49 against 1.64 (this function), 8 interleaved 64 MiB streams each
# (bench/README.md, many hosts); at most TRIM_THRESHOLD more resident.
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 32 << 20


def tune_malloc() -> bool:
    """Set MMAP_THRESHOLD and TRIM_THRESHOLD for this process (glibc's ``mallopt``; the API
    process calls it at its start). False where the C library has no ``mallopt``."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # (M_MMAP_THRESHOLD is -3, M_TRIM_THRESHOLD -1; each answers 1 when set)
    return bool(mallopt(-3, MMAP_THRESHOLD)) and bool(mallopt(-1, TRIM_THRESHOLD))


def _is_e2b(path: str, headers: list[tuple[bytes, bytes]]) -> bool:
    return path == "/e2b" or path.startswith("/e2b/") or any(
        k == b"e2b-sandbox-id" for k, _ in headers)


class Forwarder:
    def __init__(self, cfg: Config, store: Store) -> None:
        self.cfg, self.store = cfg, store
        self.token = check_token(cfg.cluster.node_token, "api")
        self._token_header = (TOKEN_HEADER.encode(), self.token.encode())
        self.view: NodeView | KubeNodeView = NodeView(store, cfg.cluster.node_lease)
        self.kube: Any = None  # the Kubernetes API client (CPUOS_MEMBERSHIP=kubernetes)
        # forwarded requests go to the transport (its connection pool: kept-alive HTTP/1.1
        # connections to the nodes) without the client's layers (cookie jar, redirects,
        # auth, an INFO log line per request); the client (same pool) is for the
        # forwarder's own calls (drain, forks)
        self.transport: httpx.AsyncBaseTransport = AiohttpTransport()  # (C parser: .transport)
        self.http = httpx.AsyncClient(transport=self.transport, timeout=TIMEOUT,
                                      follow_redirects=False)
        self._task: asyncio.Task[None] | None = None
        self._keys: dict[str, float] = {}  # key -> monotonic time its check expires
        # sandbox id -> (the node its row named, monotonic time the guess expires)
        self._where: dict[str, tuple[str, float]] = {}
        self._e2b: Any = None  # cpuosd.e2b.state.E2B: signed file URLs (made when needed)
        # the web console's sessions (in the shared store: cpuosd.console.sessions)
        self.sessions = Sessions(store, cfg.api.console_session_ttl)
        self.elector: Any = None  # LeaderElector (CPUOS_MEMBERSHIP=kubernetes)
        self._elect: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.cfg.cluster.membership == "kubernetes":
            from .membership import Membership, connect

            self.kube = await connect()
            self.view = KubeNodeView(Membership(self.kube, self.cfg.cluster.k8s_namespace))
            # one API process leads (the Lease cpuos-api-leader) and runs the cluster-wide
            # work: fencing dead nodes (with the store's table every process fences: safe,
            # as it is one compare-and-set per node)
            from .membership import LeaderElector

            ident = f"{self.cfg.cluster.api_id or socket.gethostname()}-{secrets.token_hex(4)}"
            lease = int(max(4, self.cfg.cluster.node_lease))  # (whole seconds: the Lease's field)
            self.elector = LeaderElector(self.kube, self.cfg.cluster.k8s_namespace, ident,
                                         lease_seconds=lease, renew_deadline=lease - 1,
                                         retry_period=1)
            self._elect = asyncio.ensure_future(self.elector.run(self._lead))
        elif self.cfg.cluster.membership != "store":
            raise ValueError(f"CPUOS_MEMBERSHIP must be store or kubernetes, not "
                             f"{self.cfg.cluster.membership!r}")
        await self._refresh()
        self._task = asyncio.ensure_future(self._refresh_loop())

    async def _refresh(self) -> None:
        if isinstance(self.view, KubeNodeView):
            await self.view.refresh_async()
        else:
            await asyncio.to_thread(self.view.refresh)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH)
            try:
                await self._refresh()
                if self.elector is None:
                    await asyncio.to_thread(fence_dead, self.store, self.view,
                                            self.cfg.cluster.node_fence_after)
            except Exception as e:
                log.warning("reading the nodes failed: %s", e)

    async def _lead(self) -> None:
        """While this API process leads: fence dead nodes (the refresh loop keeps the view
        current)."""
        while True:
            await asyncio.sleep(REFRESH)
            try:
                await asyncio.to_thread(fence_dead, self.store, self.view,
                                        self.cfg.cluster.node_fence_after)
            except Exception as e:
                log.warning("fencing failed: %s", e)

    @property
    def leading(self) -> bool | None:
        """Whether this process leads (None: no election, every process fences)."""
        return None if self.elector is None else self.elector.is_leader

    async def close(self) -> None:
        if self._elect is not None:  # (a leader gives its Lease up on the way out)
            self._elect.cancel()
            await asyncio.gather(self._elect, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.http.aclose()
        if self.kube is not None:
            await self.kube.close()

    # ---- where a request goes ---------------------------------------------------------
    def _row_node(self, path: str, sid: str | None = None) -> tuple[str, str | None] | None:
        """(sandbox id, its node) for a path under /sandboxes/<id> (or E2B's
        /e2b/sandboxes/<id>, or ``sid``: the sandbox E2B's header names) whose row exists."""
        if sid is None:
            m = SANDBOX_PATH.match(path) or E2B_SANDBOX_PATH.match(path)
            if not m:
                return None
            sid = m.group(1)
        row = self.store.get_sandbox(sid)
        return None if row is None else (row.id, row.node_id)

    def _route(self, headers: list[tuple[bytes, bytes]], path: str, query: bytes = b"",
               method: str = "GET", websocket: bool = False
               ) -> tuple[bool, tuple[str, str | None] | None]:
        """The key check and the sandbox's row, in one trip to a thread. The E2B surface
        (cpuosd.e2b) has credentials of its own: its control plane's key (X-API-Key or a
        bearer key: keys of the store, checked here); its sandbox plane (the
        E2b-Sandbox-Id header) carries the sandbox's access token, which only the nodes
        can check (an HMAC under their E2B key): such a request goes to the sandbox's node
        unchecked here, and the node checks it as one host does. So does a signed file URL
        of E2B's (``/files?signature=...``, no headers): its signature names the sandbox
        (with CPUOS_E2B_KEY_FILE, the nodes' key, here too; else any node answers)."""
        e2b_sid = next((v.decode("latin-1") for k, v in headers if k == b"e2b-sandbox-id"),
                       None)
        if e2b_sid is not None:
            return True, self._row_node(path, e2b_sid[:64])
        if path in ("/files", "/e2b/files") and b"signature=" in query:
            if self._e2b is None:
                from ..e2b.state import E2B

                self._e2b = E2B(self.cfg, self.store)
            sid = self._e2b.signed_for(query, method, None)
            return True, (self._row_node(path, sid) if sid else None)
        key = None
        if path == "/e2b" or path.startswith("/e2b/"):
            key = next((v.decode("latin-1").strip() for k, v in headers if k == b"x-api-key"),
                       None)
        ok = self._authorized(headers, key, method, websocket)
        return ok, (self._row_node(path) if ok else None)

    def _target(self, method: str, path: str, found: tuple[str, str | None] | None,
                memory_mib: int = 0, template: str | None = None) -> NodeInfo:
        if found is not None:
            sid, node_id = found
            if node_id is not None:
                node = self.view.get(node_id)
                if node is None or not node.alive:
                    raise ApiError("unavailable", f"the node holding sandbox {sid} "
                                   f"({node_id}) is not reachable; try again later")
                return node
            # (unknown here: any node answers as one host would, 404 for a stranger)
        if method == "POST" and (path == "/sandboxes" or path in E2B_CREATES):
            # (a warm pool, a template image)
            chosen = place(self.view.nodes, memory_mib, template=template)
        else:  # (a resume from the store: a node with a local copy first)
            chosen = place(self.view.nodes, snapshot=found[0] if found else None) or next(
                (n for n in self.view.nodes if n.alive), None)
        if chosen is None:
            raise ApiError("unavailable", "no node is available (none alive with room)")
        return chosen

    def _authorized(self, headers: list[tuple[bytes, bytes]], key: str | None = None,
                    method: str = "GET", websocket: bool = False) -> bool:
        """A known, unrevoked key (``key``, else the bearer key; a positive answer is kept
        KEY_CACHE s: the node checks the key again on every request, so a key revoked
        meanwhile gets no further), else a console session's cookie (``_console``)."""
        key = key or bearer_key(headers)
        if key is None:
            return self._console(headers, method, websocket)
        now = time.monotonic()
        if self._keys.get(key, 0.0) > now:
            return True
        if self.store.key_lookup(key) is None:
            return False
        if len(self._keys) >= 10_000:
            self._keys.clear()
        self._keys[key] = now + KEY_CACHE
        return True

    def _console(self, headers: list[tuple[bytes, bytes]], method: str, websocket: bool
                 ) -> bool:
        """A live console session (the shared store; its key live), as on one host
        (cpuosd.api.auth.Guard): a request that changes something carries the session's
        CSRF token (else ApiError 403), a WebSocket comes from a page of this origin. The
        node checks the session again (the cookie and the CSRF header are forwarded)."""
        token = cookie_token(headers)
        s = self.sessions.get(token, live_key=True) if token else None
        if s is None:
            return False
        if websocket:
            return same_origin({"headers": headers})
        if method not in SAFE_METHODS and not csrf_ok(s, headers):
            raise ApiError("permission_denied", "a console session's request that changes "
                           "something needs the session's X-Cpuos-Csrf header")
        return True

    def _admin(self, headers: list[tuple[bytes, bytes]]) -> None:
        """The admin workspace's key (as on one host: the "default" workspace), else
        401/403."""
        key = bearer_key(headers)
        found = self.store.key_lookup(key) if key else None
        if found is None:
            raise ApiError("unauthorized", "missing or invalid API key")
        if found[1] != self.store.workspace_by_name("default"):
            raise ApiError("permission_denied", "only the admin workspace may do this")

    # ---- the nodes (admin) ------------------------------------------------------------
    def _node_json(self, n: NodeInfo) -> dict[str, Any]:
        f = n.facts
        running = len(self.store.list_sandboxes(states=(State.RUNNING,), node_id=n.node_id))
        return {"id": n.node_id, "address": n.address, "alive": n.alive,
                "cordoned": n.cordoned, "incarnation": n.incarnation,
                "capacity": f.get("capacity") or {},
                "runsc_version": (f.get("runtime") or {}).get("runsc_version"),
                "cpu_model": f.get("cpu_model"), "templates": len(f.get("templates") or ()),
                "running": running}

    async def nodes(self, request: Request) -> Response:
        try:
            await asyncio.to_thread(self._admin, request.scope["headers"])
        except ApiError as e:
            return _error(e)
        out = await asyncio.to_thread(lambda: [self._node_json(n) for n in self.view.nodes])
        return JSONResponse({"nodes": out})

    async def node_op(self, request: Request) -> Response:
        """POST /nodes/{id}/cordon|uncordon|drain (drain: cordon, then the node pauses every
        running sandbox of its own, into the snapshot store when it has one)."""
        nid, op = request.path_params["node_id"], request.path_params["op"]
        try:
            await asyncio.to_thread(self._admin, request.scope["headers"])
            if op not in ("cordon", "uncordon", "drain"):
                raise ApiError("not_found", f"no node operation {op!r} (cordon, uncordon, "
                               "drain)")
            if not await asyncio.to_thread(self.store.set_node_cordoned, nid, op != "uncordon"):
                raise ApiError("not_found", f"no node {nid!r}")
            if isinstance(self.view, KubeNodeView):  # (the Lease's label is what counts)
                from .membership import Membership

                await Membership(self.kube, self.cfg.cluster.k8s_namespace).cordon(
                    nid, op != "uncordon")
            await self._refresh()
            node = self.view.get(nid)
            assert node is not None
            if op != "drain":
                return JSONResponse(self._node_json(node))
            if not node.alive:
                raise ApiError("unavailable", f"node {nid} is not alive: nothing to drain")
            r = await self.http.post(f"http://{node.address}/node/drain",
                                     headers={TOKEN_HEADER: self.token},
                                     timeout=httpx.Timeout(10.0, read=None))
            return Response(r.content, status_code=r.status_code,
                            media_type="application/json")
        except ApiError as e:
            return _error(e)
        except httpx.HTTPError as e:
            return _error(ApiError("unavailable", f"node {nid} did not answer: {e}"))

    # ---- HTTP ---------------------------------------------------------------------------
    async def http_forward(self, request: Request) -> Response:
        scope = request.scope
        path: str = scope["path"]  # (the app has no root_path: request.url.path, unbuilt)
        if path == "/health":
            alive = sum(1 for n in self.view.nodes if n.alive)
            placeable = sum(1 for n in self.view.nodes if n.placeable)
            return JSONResponse({"ok": True, "role": "api", "nodes_alive": alive,
                                 "nodes_placeable": placeable, "leader": self.leading})
        raw: list[tuple[bytes, bytes]] = scope["headers"]  # (names in lower case: ASGI)
        guess = self._cached_route(raw, path)
        length = next((v for k, v in raw if k == b"content-length"), None)
        has_body = request.method not in ("GET", "HEAD", "DELETE", "OPTIONS") or (
            length is not None or any(k == b"transfer-encoding" for k, _ in raw))
        size = (length or b"").decode("latin-1") if has_body else "0"
        small = size.isdigit() and int(size) <= SMALL_BODY
        content: Any = None
        if guess is not None and small:  # (a body sent twice must be whole in hand)
            if has_body:
                content = await request.body()
            resp = await self._send(request, guess, path, content, cached=True)
            if isinstance(resp, Response):
                return resp
            if not (resp.status_code == 421 and resp.headers.get(ROUTE_HEADER) == "elsewhere"):
                return self._answer(resp)
            await resp.aclose()
            self._where.pop(guess[1], None)  # (moved, paused or gone: ask the store)
        e2b = _is_e2b(path, request.scope["headers"])
        try:
            ok, found = await asyncio.to_thread(self._route, request.scope["headers"], path,
                                                request.scope.get("query_string", b""),
                                                request.method)
        except ApiError as e:  # (a console session's request without its CSRF token)
            return _error(e, e2b)
        if not ok:
            return _error(ApiError("unauthorized", "missing or invalid API key"), e2b)
        if has_body and content is None:
            # a small body is sent with its head (one write); a big or unsized one streams
            content = await request.body() if small else request.stream()
        try:
            node = self._target(request.method, path, found, *_create_args(path, content))
        except ApiError as e:
            return _error(e, e2b)
        resp = await self._send(request, (node, None), path, content, e2b=e2b)
        if isinstance(resp, Response):
            return resp
        if found is not None and found[1] == node.node_id and resp.status_code < 500:
            self._remember(found[0], node.node_id)
        return self._answer(resp)

    def _cached_route(self, headers: list[tuple[bytes, bytes]], path: str
                      ) -> tuple[NodeInfo, str] | None:
        """(the node, the sandbox) a request under /sandboxes/<id> may go to without a trip
        to the store: its key is in the key cache, the sandbox's node in the route cache
        and alive. Sent marked (ROUTE_HEADER): the node answers 421 unless it holds the
        sandbox live, and nothing runs there."""
        m = SANDBOX_PATH.match(path)
        if m is None:
            return None
        now = time.monotonic()
        hit = self._where.get(m.group(1))
        if hit is None or hit[1] <= now:
            return None
        key = bearer_key(headers)
        if key is None or self._keys.get(key, 0.0) <= now or any(
                k == b"e2b-sandbox-id" for k, _ in headers):
            return None
        node = self.view.get(hit[0])
        return (node, m.group(1)) if node is not None and node.alive else None

    def _remember(self, sid: str, node_id: str) -> None:
        if len(self._where) >= 100_000:
            self._where.clear()
        self._where[sid] = (node_id, time.monotonic() + ROUTE_CACHE)

    async def _send(self, request: Request, target: tuple[NodeInfo, str | None], path: str,
                    content: Any, *, cached: bool = False, e2b: bool = False
                    ) -> httpx.Response | Response:
        """The request sent to the node (its answer's head read), or the error to answer."""
        node = target[0]
        scope = request.scope
        headers = [(k, v) for k, v in scope["headers"] if k not in DROP_B]
        headers.append(self._token_header)
        if cached:
            headers.append(ROUTED)
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", client[0].encode()))
        query = request.scope.get("query_string", b"")
        upstream = httpx.Request(
            request.method, f"http://{node.address}{path}" + (
                "?" + query.decode("latin-1") if query else ""),
            headers=headers, content=content, extensions={"timeout": TIMEOUTS})
        try:
            resp = await self.transport.handle_async_request(upstream)
            resp.request = upstream
            return resp
        except httpx.HTTPError as e:
            # (never sent again: the node may have run it)
            log.warning("forwarding to node %s failed: %s", node.node_id, e)
            return _error(ApiError("unavailable", f"node {node.node_id} did not answer"), e2b)

    @staticmethod
    def _answer(resp: httpx.Response) -> Response:
        out = [(k, v) for k, v in resp.headers.raw if k.lower() not in DROP_B]
        return _Streamed(resp, out)

    # ---- WebSockets -----------------------------------------------------------------------
    async def ws_forward(self, ws: WebSocket) -> None:
        path = ws.url.path
        ok, found = await asyncio.to_thread(self._route, ws.scope["headers"], path, b"", "GET",
                                            True)
        if not ok:
            await ws.close(4401, "missing or invalid API key")
            return
        try:
            node = self._target("GET", path, found)
        except ApiError as e:
            await ws.close(4000 + e.status, e.message[:120])
            return
        headers = [(k.decode(), v.decode("latin-1")) for k, v in ws.headers.raw
                   if k.decode().lower() not in WS_DROP]
        headers.append((TOKEN_HEADER, self.token))
        if ws.headers.get("host"):
            headers.append(("X-Forwarded-Host", ws.headers["host"]))
        url = f"ws://{node.address}{path}" + (f"?{ws.url.query}" if ws.url.query else "")
        protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")
                     if p.strip()]
        try:
            up = await ws_connect(url, additional_headers=headers, open_timeout=10,
                                  subprotocols=protocols or None,  # type: ignore[arg-type]
                                  max_size=WS_MAX_MESSAGE, compression=None)
        except (OSError, TimeoutError, InvalidStatus) as e:
            log.warning("WebSocket to node %s failed: %s", node.node_id, e)
            await ws.close(4503, f"node {node.node_id} did not answer")
            return
        await ws.accept(subprotocol=up.subprotocol)

        async def client_to_node() -> None:
            with contextlib.suppress(WebSocketDisconnect, ConnectionClosed):
                while True:
                    msg = await ws.receive()
                    if msg["type"] == "websocket.disconnect":
                        await up.close(msg.get("code") or 1000)
                        return
                    if msg.get("bytes") is not None:
                        await up.send(msg["bytes"])
                    elif msg.get("text") is not None:
                        await up.send(msg["text"])

        async def node_to_client() -> None:
            try:
                async for data in up:
                    if isinstance(data, bytes):
                        await ws.send_bytes(data)
                    else:
                        await ws.send_text(data)
            except ConnectionClosed:
                pass
            rcvd = up.close_code or 1000, up.close_reason or ""
            with contextlib.suppress(Exception):
                await ws.close(rcvd[0] if rcvd[0] not in (1005, 1006) else 1011, rcvd[1])

        tasks = [asyncio.ensure_future(client_to_node()), asyncio.ensure_future(node_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await up.close()


def _create_args(path: str, body: Any) -> tuple[int, str | None]:
    """The memory a create asks for (its JSON's memory_mib; 0 when it leaves it to the
    workspace's default, which the node resolves): what placement needs free; and its
    template (placement prefers a node with a warm pool or a checkpoint of it)."""
    if path != "/sandboxes" or not isinstance(body, bytes):
        return 0, None
    try:
        d = json.loads(body)
        v, t = d.get("memory_mib"), d.get("template")
    except (ValueError, AttributeError):
        return 0, None
    return (v if isinstance(v, int) and v > 0 else 0,
            t if isinstance(t, str) and len(t) <= 64 else None)


class _Streamed(Response):
    """A node's answer streamed back as it comes (raw: encodings untouched), as plain ASGI:
    Starlette's StreamingResponse runs an anyio task group per answer (under uvicorn's ASGI
    2.3) for its disconnect listener; here one asyncio task waits for the client's
    ``http.disconnect`` and cancels the copy, which closes the node's answer (so the node
    ends what it runs for the request: an exec is killed, a download stops)."""

    def __init__(self, resp: httpx.Response, headers: list[tuple[bytes, bytes]]) -> None:
        self.resp, self.status_code, self.raw_headers = resp, resp.status_code, headers
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        resp = self.resp
        task = asyncio.current_task()
        assert task is not None
        copying, left = True, False

        def gone(t: asyncio.Future[Any]) -> None:
            nonlocal left
            # (a callback already scheduled when the copy ended must not cancel what follows)
            if copying and not t.cancelled() and t.exception() is None:
                left = True
                task.cancel()

        listener = asyncio.ensure_future(_disconnect(receive))
        listener.add_done_callback(gone)
        # (cluster.transport's answers say when a chunk was the last: it then goes out with
        # the answer's end, one write, as an exec's exit frame does)
        at_end = resp.stream.at_end if isinstance(resp.stream, NodeAnswer) else None
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            last = False
            async for chunk in resp.aiter_raw():
                last = at_end is not None and at_end()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
            copying = False
            listener.cancel()
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()  # (the client went away: nothing more to send)
        finally:
            copying = False
            listener.cancel()
            await resp.aclose()


async def _disconnect(receive: Any) -> None:
    """Returns when the client has gone away (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_api_app(cfg: Config, services: ApiServices | None = None) -> Starlette:
    """``--role=api``'s app: ``/nodes`` (admin) and everything else forwarded. Its lifespan
    serves ``services`` (the caller's), else builds its own (``wiring.build_api_services``)
    and closes them when it ends. ValueError: the configuration cannot serve."""
    if not cfg.cluster.database_url and services is None:
        raise ValueError("--role=api needs CPUOS_DATABASE_URL (the state store it shares "
                         "with the nodes)")
    check_token(cfg.cluster.node_token, "api")
    state: dict[str, Any] = {}
    from .console import console_app

    ui = console_app(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        from ..wiring import build_api_services
        from .events import FanIn

        svc = services or await build_api_services(cfg)
        state["fwd"] = svc.forwarder
        state["fan"] = fan = FanIn(svc.forwarder)
        ui.state.services = svc  # (its store: sessions, keys, workspaces)
        try:
            yield
        finally:
            await fan.close()
            if services is None:
                await svc.close()

    async def http(request: Request) -> Response:
        fwd: Forwarder = state["fwd"]
        return await fwd.http_forward(request)

    async def websocket(ws: WebSocket) -> None:
        fwd: Forwarder = state["fwd"]
        await fwd.ws_forward(ws)

    async def nodes(request: Request) -> Response:
        fwd: Forwarder = state["fwd"]
        return await fwd.nodes(request)

    async def node_op(request: Request) -> Response:
        fwd: Forwarder = state["fwd"]
        return await fwd.node_op(request)

    async def events(request: Request) -> Response:  # (every node's: cluster.events)
        from . import events as ev

        return await ev.events(state["fwd"], state["fan"], request)

    async def metrics(request: Request) -> Response:  # (every node's: cluster.console)
        from . import console

        return await console.metrics(state["fwd"], request)

    async def fork(request: Request) -> Response:  # (across nodes: cluster.forks)
        from . import forks

        return await forks.fork(state["fwd"], request)

    from .forks import refuse_internal

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/nodes", nodes, methods=["GET"]),
                             Route("/nodes/{node_id}/{op}", node_op, methods=["POST"]),
                             Route("/sandboxes/{sid}/fork", fork, methods=["POST"]),
                             Route("/sandboxes/{sid}/fork/{rest:path}", refuse_internal,
                                   methods=methods),
                             Route("/events", events, methods=["GET"]),
                             Route("/metrics", metrics, methods=["GET"]),
                             # the web console, served here (cpuosd.console: its page and
                             # sessions; the rest it calls is forwarded like the SDKs')
                             Route("/ui", ui), Route("/ui/{rest:path}", ui),
                             # the nodes' internal routes (drain, events) are not the public's
                             Route("/node/{rest:path}", refuse_internal, methods=methods),
                             Route("/{path:path}", http, methods=methods),
                             WebSocketRoute("/{path:path}", websocket)], lifespan=lifespan)
