"""Live preview URLs: the daemon's reverse proxy to servers inside sandboxes, on a listener
of its own (``CPUOS_PREVIEW_PORT``, default the API's port + 1), so a slow preview never
stalls the API.

Two forms reach port P of sandbox S:
- host form ``http://P-S.<domain>:<port>/...`` (``CPUOS_PREVIEW_DOMAIN``, default
  ``localhost``: ``*.localhost`` resolves to the loopback address in browsers and curl):
  one origin per sandbox and port, the only form a browser is served (issue 25: on one
  shared origin a page of sandbox A could read sandbox B's answers with the visitor's
  cookie, overwrite it, or keep waking B);
- path form ``http://<daemon>:<port>/sandboxes/S/ports/P/...``, for programs: the prefix is
  removed before the request goes on; it takes no cookie and sets none (a sandbox server's
  ``Set-Cookie`` is dropped), its answers carry ``Content-Security-Policy: sandbox`` (a page
  that gets there anyway runs in an opaque origin: no storage, no service worker), and a
  browser's navigation to it (``Sec-Fetch-Mode: navigate`` or
  ``Upgrade-Insecure-Requests``) is redirected to the host form.
Access: an exposed port has a token: ``?cpuos_token=...`` (host form, a browser: answered
with a redirect that sets a host-only cookie; path form and WebSocket upgrades: taken as
it is), the ``X-Cpuos-Token`` header for programs, or (host form only) the cookie.
``public`` ports need none; a port not exposed is unreachable. The caller's Authorization
header, the token and every cpuos cookie are removed before a request reaches the sandbox;
on the host form a sandbox server's ``Set-Cookie`` loses any ``Domain`` (host-only).

Every request is parsed (h11), routed, checked and stripped on its own, also the second
and later ones on a kept-alive connection (issue 25: behind a front proxy that reuses its
connections, checking only a connection's first request let a request without a token
ride on another's), and relayed on an upstream connection bound to its (sandbox, port),
kept for the next request to the same place. Only a WebSocket (or other) upgrade that the
sandbox's server answered ``101`` becomes a byte relay.

Bounds (issue 25): a request head is at most ``MAX_HEAD`` bytes and must arrive within
``HEAD_TIMEOUT`` s of its first byte; a connection waits ``IDLE_TIMEOUT`` s for that byte
(a kept-alive one for its next request, a new one for its first: a browser opens connections
ahead of its requests and may send one ~10 s later, which a deadline from the connect would
cut and the browser not resend). At most ``CPUOS_PREVIEW_MAX_CONNECTIONS`` client
connections, of which at most ``CPUOS_PREVIEW_MAX_PENDING`` (``..._PER_IP`` from one
address) wait for a request head (unauthenticated): past that the oldest idle connection
(kept alive, or silent since it was made) is closed, else the new one is; at most
``CPUOS_PREVIEW_MAX_PER_SANDBOX`` upstream connections into one sandbox (503 past it); and
every connection takes its descriptor from the daemon's budget (``cpuosd.fdbudget``).
Readers are bounded (``CLIENT_LIMIT``, ``UPSTREAM_LIMIT``) and a head is at most
``MAX_HEAD``, so what one connection makes the daemon buffer is bounded.

A request to a paused sandbox resumes it (unless the sandbox was created with
``wake_on_request`` false) and is served once it is up; requests arriving meanwhile wait
for the same resume. The path into the sandbox is its network namespace (cpuosd.network):
the daemon connects to the sandbox's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qsl, urlencode

import h11

from ..config import PreviewConfig
from ..errors import ApiError, invalid, not_found
from ..fdbudget import BUDGET
from ..lifecycle.states import GONE, State
from .relay import PlainStream, quickack, relay

if TYPE_CHECKING:
    from ..store import RowSpec
    from ..lifecycle.manager import Manager
    from .service import Network

log = logging.getLogger("cpuosd.preview")


MAX_HEAD = 32 * 1024
HEAD_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
CONNECT_TIMEOUT = 10.0
WAKE_TIMEOUT = 120.0
# reads: what one recv of the event loop brings at most (taken whole: nothing is left
# behind in a reader while a request head is incomplete)
READ = 256 * 1024
# a connection's reader stops reading from its socket past twice this (while the other
# side is slow): with a read in flight, at most about 0.5 MiB per connection and direction
CLIENT_LIMIT = 64 * 1024
UPSTREAM_LIMIT = 128 * 1024
PATH_RE = re.compile(r"^/sandboxes/(sbx-[a-z0-9]{12})/ports/(\d{1,5})(/.*)?$")
# the request headers that never reach a sandbox (cookies: every cpuos_token*, and the
# console's cpuos_session)
DROP_HEADERS = {b"authorization", b"x-cpuos-token", b"x-forwarded-host"}
# hop-by-hop: about this connection, not the request (RFC 9110 7.6.1)
HOP_HEADERS = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade",
               b"proxy-authenticate", b"proxy-authorization"}
# a page served on the path form (the shared origin) runs in an opaque origin of its own
PATH_CSP = (b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads "
            b"allow-popups-to-escape-sandbox")
LOG_INTERVAL = 10.0


Headers = list[tuple[bytes, bytes]]


class Route(NamedTuple):
    """A surface's own rule for one port of its sandbox (``Preview.route``, e.g.
    cpuosd.e2b.ports): reachable without a cpuos token, at ``upstream`` (None: the
    sandbox's own port), with these request headers dropped and added."""
    upstream: tuple[str, int] | None = None
    drop: frozenset[bytes] = frozenset()
    add: tuple[tuple[bytes, bytes], ...] = ()


def cookie_name(port: int) -> str:
    return f"cpuos_token_{port}"


def host_form(host: str, domain: str) -> tuple[int, str] | None:
    """(port, sandbox id) of a host-form Host header (``<port>-<id>.<domain>[:port]``)."""
    name = host.lower()
    if name.startswith("["):
        return None
    name = name.rsplit(":", 1)[0] if ":" in name else name
    m = re.fullmatch(r"(\d{1,5})-(sbx-[a-z0-9]{12})\." + re.escape(domain.lower()), name)
    return (int(m.group(1)), m.group(2)) if m else None


class Head(NamedTuple):
    """A preview request's head, routed: which sandbox and port, in which form."""
    headers: Headers
    lower: Headers  # (names in lower case)
    hosts: list[bytes]
    host: str
    path: str
    query: str
    sid: str
    port: int
    rest: str  # the path the sandbox's server is asked for
    form: str  # host | path


def parse_head(req: h11.Request, domain: str) -> Head | tuple[int, str]:
    """The sandbox and port a request is for, by its Host (host form) or its path (path
    form), or the answer (status, message) it gets when it names none."""
    headers = list(req.headers.raw_items())
    lower = [(k.lower(), v) for k, v in headers]
    hosts = [v for k, v in lower if k == b"host"]
    if len(hosts) > 1:
        return 400, "more than one Host header"
    host = (hosts[0] if hosts else b"").decode("latin-1")
    if req.method == b"CONNECT" or not req.target.startswith(b"/"):
        return 400, "only origin-form requests (GET /path ...)"
    path, _, query = req.target.decode("latin-1").partition("?")
    hf = host_form(host, domain)
    if hf is not None:
        return Head(headers, lower, hosts, host, path, query, hf[1], hf[0], path, "host")
    pm = PATH_RE.match(path)
    if not pm:
        return 404, ("no such preview: use "
                     f"<port>-<id>.{domain} or /sandboxes/<id>/ports/<port>/")
    return Head(headers, lower, hosts, host, path, query, pm.group(1), int(pm.group(2)),
                pm.group(3) or "/", "path")


class _Upstream:
    """A connection into a sandbox, bound to one (sandbox, port)."""

    def __init__(self, sid: str, port: int, addr: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.sid, self.port, self.addr = sid, port, addr
        self.reader, self.writer = reader, writer
        self.h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.reusable = False  # the last answer ended cleanly
        self.in_use = contextlib.ExitStack()  # closed with the connection


class _Client:
    """One client connection: h11 parses its requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 ip: str) -> None:
        self.reader, self.writer, self.ip = reader, writer, ip
        self.h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.started = False  # bytes of the next request head have arrived
        self.up: _Upstream | None = None


class _Done(Exception):
    """The exchange is over and the client connection is not to be reused."""


class _BadBody(Exception):
    """A sandbox server's answer body that is not what its head said."""


MAX_LINE = 1024  # a chunk-size line


def line_size(line: bytes) -> int:
    """The size in a chunk-size line (extensions ignored); _BadBody if it is none."""
    digits = line.split(b";", 1)[0].strip()
    if not 0 < len(digits) <= 15 or digits.strip(b"0123456789abcdefABCDEF"):
        raise _BadBody(f"bad chunk size {line[:40]!r}")
    return int(digits, 16)


def _framing(method: bytes, r: h11.Response) -> tuple[str, int]:
    """How an answer's body is delimited (RFC 9112 6.3; h11 has refused transfer codings
    other than chunked and conflicting lengths): (none|length|chunked|close, length)."""
    if method == b"HEAD" or r.status_code in (204, 304):
        return "none", 0
    te = [v for k, v in r.headers if k == b"transfer-encoding"]
    if te:
        return "chunked", 0
    cl = [v for k, v in r.headers if k == b"content-length"]
    if cl:
        return "length", int(cl[0])
    return "close", 0


class Preview:
    def __init__(self, mgr: Manager, network: Network | None, port: int,
                 host: str = "127.0.0.1", cfg: PreviewConfig | None = None) -> None:
        self.mgr, self.network = mgr, network
        self._listener(port, host, cfg)
        # (row, port, request headers) -> a Route, an answer (status, message) or None
        # (cpuos's own rules): another surface's ports (cpuosd.e2b)
        self.route: Callable[[Any, int, dict[bytes, bytes]],
                             Route | tuple[int, str] | None] | None = None

    def _listener(self, port: int, host: str, cfg: PreviewConfig | None) -> None:
        """The listener's own state: what a relay without sandboxes of its own
        (cpuosd.cluster.preview) shares with the proxy."""
        # CPUOS_PREVIEW_*: the host form's domain, the bounds on connections
        self.cfg = cfg or PreviewConfig()
        self.domain = self.cfg.domain
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self.conns: set[asyncio.Task[None]] = set()
        self.clients: dict[_Client, None] = {}
        # connections waiting for a request head (oldest first), and how many per address
        self.pending: dict[_Client, None] = {}
        self.pending_by_ip: dict[str, int] = {}
        self.per_sandbox: dict[str, int] = {}  # upstream connections
        self.refused = 0
        self._refusal_logged = -LOG_INTERVAL

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  limit=CLIENT_LIMIT, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("preview proxy on %s:%d (host form *.%s)", self.host, self.port,
                 self.domain)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self.conns):
            t.cancel()

    def public(self) -> tuple[str, str]:
        """(host, port) the preview URLs name: CPUOS_PREVIEW_PUBLIC_ADDRESS (many hosts: the
        API tier's preview listener, which relays to this node's), else this listener."""
        if self.cfg.public_address:
            host, _, port = self.cfg.public_address.rpartition(":")
            return host, port
        return self.host, str(self.port)

    def urls(self, sid: str, port: int) -> dict[str, str]:
        host, pport = self.public()
        return {"url": f"http://{host}:{pport}/sandboxes/{sid}/ports/{port}/",
                "host_url": f"http://{port}-{sid}.{self.domain}:{pport}/"}

    # -- exposing ports ------------------------------------------------------------------
    def _event(self, sid: str, ws: str, port: int, action: str, **fields: Any) -> None:
        from ..events import SandboxEvent

        self.mgr.events.emit(SandboxEvent("port", sid, ws, None,
                                          fields={"port": port, "action": action, **fields}))

    def _view(self, sid: str, port: int, p: dict[str, Any]) -> dict[str, Any]:
        return {"port": port, "public": bool(p.get("public")), "token": p.get("token"),
                "created_at": p.get("created_at"), **self.urls(sid, port)}

    async def expose(self, ws: str, sid: str, port: int, public: bool | None
                     ) -> dict[str, Any]:
        if not 1 <= port <= 65535:
            raise invalid("port must be 1..65535", field="port")
        async with self.mgr._lock(sid):
            row = self.mgr.get(ws, sid)
            if row.state in GONE:
                raise ApiError("conflict", f"sandbox {sid} is {row.state}",
                               {"state": row.state})
            ports = dict(row.spec.ports or {})
            p = ports.get(str(port)) or {"token": secrets.token_urlsafe(24),
                                         "created_at": time.time()}
            if public is not None or "public" not in p:
                p["public"] = bool(public)
            ports[str(port)] = p
            row.spec = replace(row.spec, ports=ports)
            self.mgr.store.update_sandbox(sid, spec=row.spec)
            lv = self.mgr.live.get(sid)
            if lv is not None:
                lv.row.spec = replace(lv.row.spec, ports=ports)
        self._event(sid, ws, port, "expose", public=p["public"])
        return self._view(sid, port, p)

    async def unexpose(self, ws: str, sid: str, port: int) -> None:
        async with self.mgr._lock(sid):
            row = self.mgr.get(ws, sid)
            ports = dict(row.spec.ports or {})
            if ports.pop(str(port), None) is None:
                raise not_found("port", str(port))
            row.spec = replace(row.spec, ports=ports)
            self.mgr.store.update_sandbox(sid, spec=row.spec)
            lv = self.mgr.live.get(sid)
            if lv is not None:
                lv.row.spec = replace(lv.row.spec, ports=ports)
        self._event(sid, ws, port, "unexpose")

    def list(self, ws: str, sid: str) -> list[dict[str, Any]]:
        row = self.mgr.get(ws, sid)
        return [self._view(sid, int(k), v) for k, v in sorted(
            (row.spec.ports or {}).items(), key=lambda kv: int(kv[0]))]

    # -- client connections -------------------------------------------------------------
    def _note_refusal(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._refusal_logged >= LOG_INTERVAL:
            self._refusal_logged = now
            log.warning("preview proxy closed a connection: %s (%d so far)", why, self.refused)

    def _set_pending(self, c: _Client, pending: bool) -> None:
        if pending and c not in self.pending:
            self.pending[c] = None
            self.pending_by_ip[c.ip] = self.pending_by_ip.get(c.ip, 0) + 1
        elif not pending and c in self.pending:
            del self.pending[c]
            left = self.pending_by_ip.get(c.ip, 1) - 1
            if left > 0:
                self.pending_by_ip[c.ip] = left
            else:
                self.pending_by_ip.pop(c.ip, None)

    def _make_room(self, ip: str) -> str | None:
        """Room for one more connection waiting for a request head from ip: the oldest idle
        connection, none of whose next head has come (from ip, when ip is at its cap), is
        closed if need be. None, or why there is no room."""
        per_ip, pending = self.cfg.max_pending_per_ip, self.cfg.max_pending
        for over, mine, cap in ((self.pending_by_ip.get(ip, 0) >= per_ip, True, per_ip),
                                (len(self.pending) >= pending, False, pending)):
            if not over:
                continue
            victim = next((c for c in self.pending if not c.started
                           and (c.ip == ip or not mine)), None)
            if victim is None:
                return (f"{cap} connections {'from ' + ip if mine else 'in all'} are "
                        "waiting for a request head")
            self._set_pending(victim, False)
            victim.writer.transport.abort()
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if peer else ""
        cap = self.cfg.max_connections
        why = (f"{cap} connections open" if len(self.clients) >= cap
               else self._make_room(ip))
        if why is None and not BUDGET.take():
            why = "the daemon's descriptor budget is spent"
        if why is not None:
            writer.transport.abort()
            self._note_refusal(why)
            return
        c = _Client(reader, writer, ip)
        task = asyncio.current_task()
        assert task is not None
        self.conns.add(task)
        self.clients[c] = None
        self._set_pending(c, True)
        try:
            await self._serve(c)
        except (ConnectionError, TimeoutError, OSError, h11.ProtocolError, _Done):
            pass
        except Exception:
            log.exception("preview proxy")
        finally:
            self.conns.discard(task)
            self._set_pending(c, False)
            self.clients.pop(c, None)
            self._drop_upstream(c)
            writer.close()
            BUDGET.give()

    async def _serve(self, c: _Client) -> None:
        while True:
            req = await self._next_request(c)
            if req is None:
                return
            self._set_pending(c, False)
            if not await self._exchange(c, req):
                return
            if c.h.our_state is not h11.DONE or c.h.their_state is not h11.DONE:
                return
            c.h.start_next_cycle()
            c.started = False
            self._set_pending(c, True)

    async def _next_request(self, c: _Client) -> h11.Request | None:
        """The next request's head (None: the connection is over, any error answered):
        whole HEAD_TIMEOUT s after its first byte, which may take IDLE_TIMEOUT s to come."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + IDLE_TIMEOUT
        while True:
            try:
                ev = c.h.next_event()
            except h11.RemoteProtocolError as e:
                status = e.error_status_hint if 400 <= e.error_status_hint < 500 else 400
                await _reply(c.writer, status, f"bad request: {e}"[:300])
                return None
            if ev is h11.NEED_DATA:
                if deadline <= loop.time():
                    return None
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await c.reader.read(READ)
                except TimeoutError:
                    return None
                if data and not c.started:
                    c.started = True
                    deadline = loop.time() + HEAD_TIMEOUT
                c.h.receive_data(data)
                continue
            return ev if isinstance(ev, h11.Request) else None

    async def _exchange(self, c: _Client, req: h11.Request) -> bool:
        """One request: routed, checked, relayed; whether the connection may go on."""
        head = parse_head(req, self.domain)
        if not isinstance(head, Head):
            return await _reply(c.writer, *head)
        headers, lower, hosts, host = head.headers, head.lower, head.hosts, head.host
        path, query, sid, port, rest, form = (head.path, head.query, head.sid, head.port,
                                              head.rest, head.form)
        hdr: dict[bytes, bytes] = {}
        for k, v in lower:
            hdr.setdefault(k, v)
        row = self.mgr.store.get_sandbox(sid)
        exposed = ((row.spec.ports or {}).get(str(port)) if row else None)
        routed = self.route(row, port, hdr) if self.route is not None and row else None
        if routed is not None and not isinstance(routed, Route):  # refused: (status, why)
            return await _reply(c.writer, *routed)
        if routed is not None:
            exposed = {"public": True}  # (the surface's rule has been applied)
        if row is None or exposed is None:
            return await _reply(c.writer, 404, f"port {port} of {sid} is not exposed")
        conn_tokens = {t.strip() for k, v in lower if k == b"connection"
                       for t in v.lower().split(b",")}
        upgrade = b"upgrade" in conn_tokens and b"upgrade" in hdr
        navigate = (req.method in (b"GET", b"HEAD") and not upgrade
                    and (hdr.get(b"sec-fetch-mode") == b"navigate"
                         or (b"sec-fetch-mode" not in hdr
                             and hdr.get(b"upgrade-insecure-requests") == b"1")))
        # the token: query, header, or (host form only) cookie
        q = parse_qsl(query, keep_blank_values=True)
        given = next((v for k, v in q if k == "cpuos_token"), None)
        clean = urlencode([(k, v) for k, v in q if k != "cpuos_token"]) \
            if given is not None else query
        if not exposed.get("public"):
            token = str(exposed.get("token"))
            if given is not None:
                if not _same(given, token):
                    return await _reply(c.writer, 403, "wrong preview token")
            else:
                offered = hdr.get(b"x-cpuos-token", b"").decode("latin-1")
                if offered:
                    if not _same(offered, token):
                        return await _reply(c.writer, 403, "wrong preview token")
                else:
                    cookies = (_cookies(b"; ".join(v for k, v in lower if k == b"cookie"),
                                        cookie_name(port)) if form == "host" else [])
                    if not cookies:
                        return await _reply(c.writer, 401, "this preview needs its token "
                                            "(?cpuos_token=..., or the X-Cpuos-Token "
                                            "header)")
                    # a cookie tossed in by another page does not shut the visitor out
                    if not any(_same(v, token) for v in cookies):
                        return await _reply(c.writer, 403, "wrong preview token")
        if form == "path" and navigate:
            # a browser is served the sandbox's own origin only
            hp = host.rsplit(":", 1)[1] if ":" in host and not host.endswith("]") else ""
            loc = (f"//{port}-{sid}.{self.domain}{':' + hp if hp.isdigit() else ''}"
                   f"{_local(rest)}" + ("?" + query if query else ""))
            return await _reply(c.writer, 303, "", extra=[("Location", loc)])
        if form == "host" and given is not None and not upgrade and navigate \
                and not exposed.get("public"):
            # the token once in the query: a host-only cookie, and the URL without it
            return await _reply(c.writer, 303, "", extra=[
                ("Location", _local(path) + ("?" + clean if clean else "")),
                ("Set-Cookie", f"{cookie_name(port)}={exposed.get('token')}; Path=/; "
                               "HttpOnly; SameSite=Lax")])
        to_port = port
        if routed is not None and routed.upstream is not None:
            addr, to_port = routed.upstream
        else:
            found = await self._running_address(row.id, row.workspace_id, row.state, row.spec)
            if isinstance(found, tuple):
                return await _reply(c.writer, *found)
            addr = found
        up = c.up
        if up is None or (up.sid, up.port, up.addr) != (sid, port, addr):
            up = await self._upstream(c, sid, port, addr, to_port,
                                      (502, f"nothing answers on port {port} in {sid}"))
            if up is None:
                return False
            # an open connection into the sandbox: it is not idle (lifecycle.idle)
            up.in_use.enter_context(self.mgr.using(sid))
            self._event(row.id, row.workspace_id, port, "connect", peer=c.ip)
        # the request as the sandbox's server sees it
        out: list[tuple[bytes, bytes]] = []
        xff = b""
        for k, v in headers:
            lk = k.lower()
            if lk in DROP_HEADERS or lk in HOP_HEADERS or lk in conn_tokens or (
                    routed is not None and lk in routed.drop):
                continue
            if lk == b"cookie":
                v = _drop_cookies(v)
                if not v:
                    continue
            if lk == b"x-forwarded-for":
                xff = v + b", "
                continue
            out.append((k, v))
        if not hosts:
            out.append((b"Host", f"{addr}:{port}".encode()))
        if upgrade:
            out += [(b"Connection", b"upgrade"), (b"Upgrade", hdr[b"upgrade"])]
        out += [(b"X-Forwarded-For", xff + c.ip.encode()),
                (b"X-Forwarded-Host", host.encode("latin-1"))]
        out += list(routed.add) if routed is not None else []
        target = (rest + ("?" + clean if clean else "")).encode("latin-1")
        return await self._send(c, up, req.method, target, out, form, upgrade)

    async def _upstream(self, c: _Client, sid: str, port: int, addr: str, to_port: int,
                        unreachable: tuple[int, str]) -> _Upstream | None:
        """A new upstream connection for c's request to (sid, port) at addr:to_port, in
        place of the one c had (None: refused or unreachable, answered to the client)."""
        self._drop_upstream(c)
        if self.per_sandbox.get(sid, 0) >= self.cfg.max_per_sandbox:
            self._note_refusal(f"{self.cfg.max_per_sandbox} connections into {sid}")
            await _reply(c.writer, 503, f"too many connections to {sid}")
            return None
        if not BUDGET.take():
            self._note_refusal("the daemon's descriptor budget is spent")
            await _reply(c.writer, 503, "the preview proxy is at its limit")
            return None
        self.per_sandbox[sid] = self.per_sandbox.get(sid, 0) + 1
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                ur, uw = await asyncio.open_connection(addr, to_port, limit=UPSTREAM_LIMIT)
        except (OSError, TimeoutError):
            self._release(sid)
            await _reply(c.writer, *unreachable)
            return None
        up = c.up = _Upstream(sid, port, addr, ur, uw)
        return up

    async def _send(self, c: _Client, up: _Upstream, method: bytes, target: bytes,
                    out: Headers, form: str, upgrade: bool) -> bool:
        """The request (its head as given, its body as it comes) on up, and the answer back
        to the client; whether the client connection may go on."""
        up.h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)  # per request
        up.reusable = False
        try:
            up.writer.write(up.h.send(h11.Request(method=method, target=target,
                                                  headers=out)))
        except h11.LocalProtocolError as e:
            self._drop_upstream(c)
            return await _reply(c.writer, 400, f"bad request: {e}"[:300])
        # the request's body: a request without one (most) is done here, else it is sent
        # on as it comes while the answer is relayed
        try:
            first = c.h.next_event()
        except h11.RemoteProtocolError as e:
            self._drop_upstream(c)
            return await _reply(c.writer, 400, f"bad request body: {e}"[:300])
        body: asyncio.Task[None] | None = None
        if isinstance(first, h11.EndOfMessage):
            up.writer.write(up.h.send(h11.EndOfMessage()))
        else:
            body = asyncio.get_running_loop().create_task(self._request_body(c, up, first))
        keep = False
        try:
            keep = await self._response(c, up, form, upgrade, method)
            for _ in range(3):  # a body already read to its end is sent by now
                if body is None or body.done():
                    break
                await asyncio.sleep(0)
        except BaseException:
            self._drop_upstream(c)
            raise
        finally:
            if body is not None:
                if not body.done():
                    body.cancel()  # the sandbox answered before the body's end: no reuse
                    keep = False
                await asyncio.gather(body, return_exceptions=True)
        if not keep or not up.reusable or up.h.our_state is not h11.DONE:
            self._drop_upstream(c)
            return keep and c.h.their_state is h11.DONE
        return True

    async def _request_body(self, c: _Client, up: _Upstream, ev: Any) -> None:
        """The request's body from its first event on, client to sandbox, as it comes
        (h11 reframes it). A client or sandbox gone in the middle ends both connections."""
        try:
            while True:
                if ev is h11.NEED_DATA:
                    c.h.receive_data(await c.reader.read(READ))
                elif isinstance(ev, h11.Data):
                    _write(up.writer, up.h, ev.data)
                    await up.writer.drain()
                elif isinstance(ev, h11.EndOfMessage):
                    up.writer.write(up.h.send(h11.EndOfMessage()))
                    await up.writer.drain()
                    return
                else:
                    return
                ev = c.h.next_event()
        except (ConnectionError, OSError, h11.ProtocolError):
            c.writer.transport.abort()
            up.writer.transport.abort()

    async def _response(self, c: _Client, up: _Upstream, form: str, upgrade: bool,
                        method: bytes) -> bool:
        """The sandbox's answer, to the client as it comes; whether the client connection
        may take another request. An upgrade answered 101 becomes a byte relay. h11 parses
        the answer's head; its body is read by ``_body`` (h11's reader copies every chunk
        three times: it halved a download's throughput) and framed for the client by h11."""
        while True:
            try:
                ev = up.h.next_event()
            except h11.RemoteProtocolError as e:
                await _reply(c.writer, 502, f"bad answer from port {up.port} in {up.sid}: "
                             f"{e}"[:300])
                return False
            if ev is h11.NEED_DATA:
                data = await up.reader.read(READ)
                quickack(up.writer)
                up.h.receive_data(data)
                continue
            if isinstance(ev, h11.InformationalResponse):
                if ev.status_code == 101:
                    if not upgrade:
                        raise _Done()
                    c.writer.write(c.h.send(h11.InformationalResponse(
                        status_code=101, reason=ev.reason,
                        headers=_response_headers(ev.headers.raw_items(), form,
                                                  upgrade=True))))
                    await self._switched(c, up)
                    return False
                c.writer.write(c.h.send(h11.InformationalResponse(
                    status_code=ev.status_code, reason=ev.reason,
                    headers=_response_headers(ev.headers.raw_items(), form))))
                await c.writer.drain()
            elif isinstance(ev, h11.Response):
                out = _Out(c.writer)
                out.add(c.h.send(h11.Response(
                    status_code=ev.status_code, reason=ev.reason,
                    headers=_response_headers(ev.headers.raw_items(), form))) or b"")
                rest, _ = up.h.trailing_data
                try:
                    up.reusable = await self._body(c, up, out, _framing(method, ev),
                                                   bytearray(rest))
                except _BadBody as e:
                    log.debug("preview: %s in %s port %d", e, up.sid, up.port)
                    await out.flush()
                    raise _Done() from None  # the client sees its answer cut short
                out.add(c.h.send(h11.EndOfMessage()) or b"")
                await out.flush()
                return True
            else:  # the sandbox hung up before answering
                await _reply(c.writer, 502, f"no answer from port {up.port} in {up.sid}")
                return False

    async def _body(self, c: _Client, up: _Upstream, out: _Out, framing: tuple[str, int],
                    buf: bytearray) -> bool:
        """An answer's body (``buf``: what came with its head), relayed as it comes (what is
        gathered in ``out`` is sent before any wait for the sandbox); whether the upstream
        connection ended cleanly and may take another request."""
        kind, length = framing

        async def more(n: int = READ) -> bytes:
            await out.flush()
            data = await up.reader.read(n)
            quickack(up.writer)
            return data

        async def emit(data: bytes) -> None:
            for piece in c.h.send_with_data_passthrough(h11.Data(data=data)) or ():
                out.add(piece)
            if out.size >= OUT_GATHER:
                await out.flush()

        async def line() -> bytes:
            while (i := buf.find(b"\r\n", 0, MAX_LINE + 2)) < 0:
                if len(buf) > MAX_LINE:
                    raise _BadBody("a chunked body's line is too long")
                data = await more()
                if not data:
                    raise _BadBody("the body was cut")
                buf.extend(data)
            out = bytes(buf[:i])
            del buf[:i + 2]
            return out

        async def exactly(n: int) -> None:
            """n bytes of payload: what is in buf first, then straight from the socket."""
            if buf:
                take = min(n, len(buf))
                await emit(bytes(buf[:take]))
                del buf[:take]
                n -= take
            while n:
                data = await more(min(READ, n))
                if not data:
                    raise _BadBody("the body was cut")
                await emit(data)
                n -= len(data)

        if kind == "none":
            return not buf
        if kind == "length":
            await exactly(length)
            return not buf
        if kind == "close":
            if buf:
                await emit(bytes(buf))
            while data := await more():
                await emit(data)
            return False
        while True:  # chunked
            size = line_size(await line())
            if size == 0:
                break
            await exactly(size)
            if await line() != b"":
                raise _BadBody("a chunk does not end with CRLF")
        seen = 0
        while trailer := await line():  # trailers: read, not passed on
            seen += len(trailer)
            if seen > MAX_HEAD:
                raise _BadBody("trailers too long")
        return not buf

    async def _switched(self, c: _Client, up: _Upstream) -> None:
        """After a real 101: bytes both ways, what either side sent early included."""
        early, _ = c.h.trailing_data
        late, _ = up.h.trailing_data
        try:
            await relay(PlainStream(c.reader, c.writer),
                        PlainStream(up.reader, up.writer, ack=quickack),
                        to_b=bytes(early), to_a=bytes(late), until_b_ends=True)
        finally:
            up.writer.close()

    def _release(self, sid: str) -> None:
        BUDGET.give()
        left = self.per_sandbox.get(sid, 1) - 1
        if left > 0:
            self.per_sandbox[sid] = left
        else:
            self.per_sandbox.pop(sid, None)

    def _drop_upstream(self, c: _Client) -> None:
        up, c.up = c.up, None
        if up is not None:
            up.writer.transport.abort()
            up.in_use.close()
            self._release(up.sid)

    async def _running_address(self, sid: str, ws: str, state: str, spec: RowSpec
                               ) -> str | tuple[int, str]:
        """The sandbox's address, resuming it first if it is paused (or pausing, resuming)
        and may be woken: one resume for any number of requests (Manager.autopause.wake)."""
        if state in (State.PAUSED, State.PAUSING, State.RESUMING):
            if spec.wake_on_request is False and state != State.RESUMING:
                return 503, f"{sid} is {state}"
            try:
                async with asyncio.timeout(WAKE_TIMEOUT):
                    await self.mgr.autopause.wake(ws, sid, any_pause=True)
            except Exception as e:
                return 503, f"{sid} could not be resumed: {getattr(e, 'message', e)}"
            row = self.mgr.store.get_sandbox(sid)
            state = row.state if row else "gone"
        if state != State.RUNNING:
            return 503, f"{sid} is {state}"
        self.mgr.idle.touch(sid)
        a = self.network.by_sid.get(sid) if self.network else None
        if a is None:
            return 503, f"{sid} has no network here (previews need it)"
        return a.slot.address


def _local(path: str) -> str:
    """A path for a Location on this host: one leading slash (``//x`` would be another
    host)."""
    return "/" + path.lstrip("/\\")


def _same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode())


def _cookies(raw: bytes, name: str) -> list[str]:
    """Every value of cookie ``name`` in a Cookie header (another page may have added one
    of the same name)."""
    out = []
    for part in raw.decode("latin-1").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            out.append(v)
    return out


def _drop_cookies(raw: bytes) -> bytes:
    """A Cookie header without any cpuos token cookie, nor the web console's session
    (cookies ignore ports: a console on this host's API port has its cookie sent here)."""
    keep = [p.strip() for p in raw.decode("latin-1").split(";")
            if p.strip() and not p.strip().partition("=")[0].startswith(
                ("cpuos_token", "cpuos_session", "__Host-cpuos_session"))]
    return "; ".join(keep).encode("latin-1")


def _response_headers(headers: list[tuple[bytes, bytes]], form: str, upgrade: bool = False
                      ) -> list[tuple[bytes, bytes]]:
    """A sandbox server's answer headers as the client gets them: hop-by-hop ones dropped
    (h11 frames the answer anew), cookies kept to the sandbox's own origin."""
    keep = (b"connection", b"upgrade") if upgrade else ()  # a 101 says what it switches to
    named = {t.strip() for k, v in headers if k.lower() == b"connection"
             for t in v.lower().split(b",")}
    out = []
    for k, v in headers:
        lk = k.lower()
        if (lk in named or lk in HOP_HEADERS) and lk not in keep:
            continue
        if lk == b"set-cookie":
            if form == "path":
                continue  # the shared origin holds no sandbox's cookie
            v = _host_only(v)
        out.append((k, v))
    if form == "path":
        out.append((b"Content-Security-Policy", PATH_CSP))
    return out


def _host_only(cookie: bytes) -> bytes:
    """A Set-Cookie value without its Domain attribute: the cookie stays on the sandbox's
    own host (a Domain would share it with every sandbox under the preview domain)."""
    parts = cookie.split(b";")
    return b";".join([parts[0], *(p for p in parts[1:]
                                  if p.strip().lower().partition(b"=")[0].strip()
                                  != b"domain")])


CODES = {400: "invalid_argument", 401: "unauthorized", 403: "permission_denied",
         404: "not_found", 431: "invalid_argument", 502: "unavailable", 503: "unavailable"}


async def _reply(writer: asyncio.StreamWriter, status: int, msg: str,
                 extra: list[tuple[str, str]] | None = None) -> bool:
    """An answer of the proxy's own: errors as the API's JSON error body. The connection
    ends with it (False: not to be reused)."""
    body = b""
    if status >= 400:
        body = json.dumps({"error": {"code": CODES.get(status, "internal"), "message": msg,
                                     "details": {}}}).encode()
    reason = {303: "See Other", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
              404: "Not Found", 431: "Request Header Fields Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "")
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{k}: {v}" for k, v in (extra or []))]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    return False


OUT_GATHER = 64 * 1024


class _Out:
    """What goes to a client, gathered until the proxy is about to wait (a small answer:
    one write, one send)."""

    def __init__(self, w: asyncio.StreamWriter) -> None:
        self.w = w
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        if data:
            self.parts.append(data)
            self.size += len(data)

    async def flush(self) -> None:
        if self.parts:
            self.w.write(self.parts[0] if len(self.parts) == 1 else b"".join(self.parts))
            self.parts, self.size = [], 0
        await self.w.drain()


def _write(w: asyncio.StreamWriter, h: h11.Connection, data: bytes) -> None:
    """A body's bytes, framed by h: as they are (no copy) where the framing adds nothing."""
    pieces = h.send_with_data_passthrough(h11.Data(data=data)) or []
    w.write(pieces[0] if len(pieces) == 1 else b"".join(pieces))
