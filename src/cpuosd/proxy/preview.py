"""Live preview URLs: the daemon's reverse proxy to servers inside sandboxes, on a listener
of its own (``CPUOS_PREVIEW_PORT``, default the API's port + 1), so a slow preview never
stalls the API.

Two forms reach port P of sandbox S:
- host form ``http://P-S.<domain>:<port>/...`` (``CPUOS_PREVIEW_DOMAIN``, default
  ``localhost``: ``*.localhost`` resolves to the loopback address) — keep-alive, streaming
  and WebSocket pass through as they are;
- path form ``http://<daemon>:<port>/sandboxes/S/ports/P/...`` — the prefix is removed
  before the request goes on (one request per connection to the sandbox).
Access: an exposed port has a token; ``?cpuos_token=...`` once (answered with a redirect that
sets a cookie for that host or path; a WebSocket upgrade, which can follow neither, is let
through with it), or the ``X-Cpuos-Token`` header for programs;
``public`` ports need none; a port not exposed is unreachable. The caller's Authorization
header, the token and the cookie are removed before the request reaches the sandbox.
A request to a paused sandbox resumes it (unless the sandbox was created with
``wake_on_request`` false) and is served once it is up; requests arriving meanwhile wait
for the same resume. The path into the sandbox is its network namespace (cpuosd.network):
the daemon connects to the sandbox's address.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

from ..errors import ApiError, invalid, not_found

if TYPE_CHECKING:
    from ..lifecycle.manager import Manager
    from ..network.service import Network

log = logging.getLogger("cpuosd.preview")
MAX_HEAD = 64 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 10.0
WAKE_TIMEOUT = 120.0
CHUNK = 256 * 1024
HOST_RE = re.compile(r"^(\d{1,5})-(sbx-[a-z0-9]{12})\.")
PATH_RE = re.compile(r"^/sandboxes/(sbx-[a-z0-9]{12})/ports/(\d{1,5})(/.*)?$")
DROP_HEADERS = {b"authorization", b"x-cpuos-token"}


def domain() -> str:
    return os.environ.get("CPUOS_PREVIEW_DOMAIN", "localhost")


def cookie_name(port: int) -> str:
    return f"cpuos_token_{port}"


class Preview:
    def __init__(self, mgr: Manager, network: Network | None, port: int,
                 host: str = "127.0.0.1") -> None:
        self.mgr, self.network = mgr, network
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self.conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  limit=CHUNK, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("preview proxy on %s:%d (host form *.%s)", self.host, self.port, domain())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self.conns):
            t.cancel()

    def urls(self, sid: str, port: int) -> dict[str, str]:
        base = f"http://{self.host}:{self.port}"
        return {"url": f"{base}/sandboxes/{sid}/ports/{port}/",
                "host_url": f"http://{port}-{sid}.{domain()}:{self.port}/"}

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
            if row.state in ("killing", "killed", "error"):
                raise ApiError("conflict", f"sandbox {sid} is {row.state}",
                               {"state": row.state})
            ports = dict(row.spec.get("ports") or {})
            p = ports.get(str(port)) or {"token": secrets.token_urlsafe(24),
                                         "created_at": time.time()}
            if public is not None or "public" not in p:
                p["public"] = bool(public)
            ports[str(port)] = p
            row.spec["ports"] = ports
            self.mgr.store.update_sandbox(sid, spec=row.spec)
            lv = self.mgr.live.get(sid)
            if lv is not None:
                lv.row.spec["ports"] = ports
        self._event(sid, ws, port, "expose", public=p["public"])
        return self._view(sid, port, p)

    async def unexpose(self, ws: str, sid: str, port: int) -> None:
        async with self.mgr._lock(sid):
            row = self.mgr.get(ws, sid)
            ports = dict(row.spec.get("ports") or {})
            if ports.pop(str(port), None) is None:
                raise not_found("port", str(port))
            row.spec["ports"] = ports
            self.mgr.store.update_sandbox(sid, spec=row.spec)
            lv = self.mgr.live.get(sid)
            if lv is not None:
                lv.row.spec["ports"] = ports
        self._event(sid, ws, port, "unexpose")

    def list(self, ws: str, sid: str) -> list[dict[str, Any]]:
        row = self.mgr.get(ws, sid)
        return [self._view(sid, int(k), v) for k, v in sorted(
            (row.spec.get("ports") or {}).items(), key=lambda kv: int(kv[0]))]

    # -- one client connection ---------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.conns.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError, ValueError):
            pass
        except Exception:
            log.exception("preview proxy")
        finally:
            self.conns.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        async with asyncio.timeout(HEAD_TIMEOUT):
            head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD:
            return await _reply(writer, 431, "request head too large")
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            return await _reply(writer, 400, "bad request line")
        method, target, version = parts
        headers = [(k.strip(), v.strip()) for k, _, v in
                   (line.partition(b":") for line in lines[1:]) if k.strip()]
        hdr = {k.lower(): v for k, v in headers}
        host = hdr.get(b"host", b"").decode("latin-1").lower()
        path, _, query = target.decode("latin-1").partition("?")
        m = HOST_RE.match(host)
        if m and host.split(":")[0].endswith("." + domain()):
            port, sid, rest, form = int(m.group(1)), m.group(2), path, "host"
        else:
            pm = PATH_RE.match(path)
            if not pm:
                return await _reply(writer, 404, "no such preview: use /sandboxes/<id>/ports/"
                                    f"<port>/ or <port>-<id>.{domain()}")
            sid, port, rest, form = pm.group(1), int(pm.group(2)), pm.group(3) or "/", "path"
        row = self.mgr.store.get_sandbox(sid)
        exposed = ((row.spec.get("ports") or {}).get(str(port)) if row else None)
        if row is None or exposed is None:
            return await _reply(writer, 404, f"port {port} of {sid} is not exposed")
        # the token: query (once: a redirect sets the cookie), header, or cookie
        q = parse_qsl(query, keep_blank_values=True)
        given = next((v for k, v in q if k == "cpuos_token"), None)
        if not exposed.get("public"):
            token = str(exposed.get("token"))
            cookie = _cookie(hdr.get(b"cookie", b""), cookie_name(port))
            if given is not None:
                if not hmac.compare_digest(given.encode(), token.encode()):
                    return await _reply(writer, 403, "wrong preview token")
                clean = urlencode([(k, v) for k, v in q if k != "cpuos_token"])
                if b"upgrade" in hdr.get(b"connection", b"").lower():
                    # a WebSocket client neither follows a redirect nor keeps a cookie (a
                    # DevTools URL given to Playwright): the token in the query is enough
                    query = clean
                else:
                    scope = f"/sandboxes/{sid}/ports/{port}/" if form == "path" else "/"
                    loc = path + ("?" + clean if clean else "")
                    return await _reply(writer, 303, "", extra=[
                        ("Location", loc),
                        ("Set-Cookie", f"{cookie_name(port)}={token}; Path={scope}; "
                                       "HttpOnly; SameSite=Lax")])
            offered = (hdr.get(b"x-cpuos-token", b"").decode("latin-1") or cookie or ""
                       if given is None else given)
            if not offered:
                return await _reply(writer, 401, "this preview needs its token "
                                    "(?cpuos_token=..., or the X-Cpuos-Token header)")
            if not hmac.compare_digest(offered.encode(), token.encode()):
                return await _reply(writer, 403, "wrong preview token")
        elif given is not None:
            query = urlencode([(k, v) for k, v in q if k != "cpuos_token"])
        addr = await self._running_address(row.id, row.workspace_id, row.state, row.spec)
        if isinstance(addr, tuple):
            return await _reply(writer, *addr)
        self._event(row.id, row.workspace_id, port, "connect",
                    peer=str((writer.get_extra_info("peername") or ("",))[0]))
        with self.mgr.using(row.id):  # an open preview connection: the sandbox is not idle
            await self._forward(reader, writer, addr, port, sid, method, rest, query, version,
                                headers, hdr, host, form)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       addr: str, port: int, sid: str, method: bytes, rest: str, query: str,
                       version: bytes, headers: builtins.list[tuple[bytes, bytes]],
                       hdr: dict[bytes, bytes], host: str, form: str) -> None:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                ur, uw = await asyncio.open_connection(addr, port, limit=CHUNK)
        except (OSError, TimeoutError):
            return await _reply(writer, 502, f"nothing answers on port {port} in {sid}")
        # the request as the sandbox's server sees it
        upgrade = b"upgrade" in hdr.get(b"connection", b"").lower()
        out = [method + b" " + (rest + ("?" + query if query else "")).encode("latin-1")
               + b" " + version]
        for k, v in headers:
            lk = k.lower()
            if lk in DROP_HEADERS:
                continue
            if lk == b"cookie":
                v = _drop_cookie(v, cookie_name(port))
                if not v:
                    continue
            if form == "path" and lk == b"connection" and not upgrade:
                continue
            out.append(k + b": " + v)
        peer = writer.get_extra_info("peername")
        out.append(b"X-Forwarded-For: " + str(peer[0] if peer else "").encode())
        out.append(b"X-Forwarded-Host: " + host.encode())
        if form == "path" and not upgrade:
            out.append(b"Connection: close")  # the next request has its prefix to remove
        uw.write(b"\r\n".join(out) + b"\r\n\r\n")
        if form == "path" and not upgrade:
            # one request per connection: the client is told so, or it would send its next
            # request down a connection the sandbox's server is closing
            try:
                async with asyncio.timeout(HEAD_TIMEOUT):
                    rhead = await ur.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                uw.close()
                return await _reply(writer, 502, f"no answer from port {port} in {sid}")
            lines = [line for line in rhead[:-4].split(b"\r\n")
                     if not line.lower().startswith(b"connection:")]
            writer.write(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n")
        await _relay(reader, writer, ur, uw)

    async def _running_address(self, sid: str, ws: str, state: str, spec: dict[str, Any]
                               ) -> str | tuple[int, str]:
        """The sandbox's address, resuming it first if it is paused (or pausing, resuming)
        and may be woken: one resume for any number of requests (Manager.wake)."""
        if state in ("paused", "pausing", "resuming"):
            if spec.get("wake_on_request") is False and state != "resuming":
                return 503, f"{sid} is {state}"
            try:
                async with asyncio.timeout(WAKE_TIMEOUT):
                    await self.mgr.wake(ws, sid, any_pause=True)
            except Exception as e:
                return 503, f"{sid} could not be resumed: {getattr(e, 'message', e)}"
            row = self.mgr.store.get_sandbox(sid)
            state = row.state if row else "gone"
        if state != "running":
            return 503, f"{sid} is {state}"
        self.mgr.idle.touch(sid)
        a = self.network.by_sid.get(sid) if self.network else None
        if a is None:
            return 503, f"{sid} has no network here (previews need it)"
        return a.slot.address


def _cookie(raw: bytes, name: str) -> str | None:
    for part in raw.decode("latin-1").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


def _drop_cookie(raw: bytes, name: str) -> bytes:
    keep = [p.strip() for p in raw.decode("latin-1").split(";")
            if p.strip() and p.strip().partition("=")[0] != name]
    return "; ".join(keep).encode("latin-1")


CODES = {400: "invalid_argument", 401: "unauthorized", 403: "permission_denied",
         404: "not_found", 431: "invalid_argument", 502: "unavailable", 503: "unavailable"}


async def _reply(writer: asyncio.StreamWriter, status: int, msg: str,
                 extra: list[tuple[str, str]] | None = None) -> None:
    """An answer of the proxy's own: errors as the API's JSON error body."""
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


def quickack(w: asyncio.StreamWriter) -> None:
    """ACK at once on this socket (Linux clears TCP_QUICKACK after a while: set it after
    each read): a sandbox's server that writes a response's head and body separately would
    otherwise wait for our delayed ACK (gVisor's netstack holds the second write, Nagle)."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


async def _relay(cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                 ur: asyncio.StreamReader, uw: asyncio.StreamWriter) -> None:
    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter,
                   ack: asyncio.StreamWriter | None = None) -> None:
        try:
            while True:
                chunk = await r.read(CHUNK)
                if ack is not None:
                    quickack(ack)
                if not chunk:
                    break
                w.write(chunk)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                if w.can_write_eof():
                    w.write_eof()

    to_server = asyncio.ensure_future(pump(cr, uw))
    try:
        await pump(ur, cw, ack=uw)  # the server's side ending ends the exchange
    finally:
        to_server.cancel()
        uw.close()
