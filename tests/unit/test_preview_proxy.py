"""The preview proxy's HTTP handling against a local upstream server (no sandbox): every
request on a connection parsed and checked on its own, bodies framed right both ways
(length, chunked, to close, none), a bad body cut, pipelined requests, uploads, and the
bounds on connections that wait for a request head. The real thing (runsc, a sandbox's
server, nginx in front) is tests/security/test_preview_requests.py."""

from __future__ import annotations

import asyncio
import json
import socket
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
import contextlib
from contextlib import asynccontextmanager
from typing import Any, cast

import httpx
import pytest

from cpuosd.store import RowSpec
from cpuosd.config import PreviewConfig
from cpuosd.network import preview
from support.daemon import closed_by_peer, until

SID = "sbx-aaaaaaaaaaaa"
TOKEN = "t0ken"


class _Store:
    def __init__(self, port: int, public: bool) -> None:
        self.row = types.SimpleNamespace(
            id=SID, workspace_id="ws", state="running",
            spec=RowSpec(ports={str(port): {"public": public, "token": TOKEN}}))

    def get_sandbox(self, sid: str) -> Any:
        return self.row if sid == SID else None


@contextlib.contextmanager
def _using(sid: str) -> Iterator[None]:  # Manager.using: the sandbox is in use meanwhile
    yield


def _fakes(port: int, public: bool) -> tuple[Any, Any]:
    mgr = types.SimpleNamespace(store=_Store(port, public),
                                events=types.SimpleNamespace(emit=lambda ev: None),
                                using=_using, idle=types.SimpleNamespace(touch=lambda sid: None))
    net = types.SimpleNamespace(by_sid={SID: types.SimpleNamespace(
        slot=types.SimpleNamespace(address="127.0.0.1"))})
    return mgr, net


# an upstream server: (reader, writer, the request heads it got, to append to)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, list[bytes]], Awaitable[None]]


@asynccontextmanager
async def proxied(handler: Handler, public: bool = False, cfg: PreviewConfig | None = None
                  ) -> AsyncIterator[tuple[preview.Preview, str, list[bytes]]]:
    """(the proxy, its path-form base URL, the raw request heads the upstream got)."""
    heads: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await handler(r, w, heads)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    mgr, net = _fakes(port, public)
    pv = preview.Preview(cast(Any, mgr), cast(Any, net), 0, cfg=cfg)
    await pv.start()
    try:
        yield pv, f"http://127.0.0.1:{pv.port}/sandboxes/{SID}/ports/{port}/", heads
    finally:
        await pv.close()
        srv.close()


async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter, heads: list[bytes]) -> None:
    """Keep-alive: answers each request with its path, headers and body (Content-Length);
    /chunked in chunks, /close to the end of the connection, /empty with 204."""
    while True:
        head = await r.readuntil(b"\r\n\r\n")
        heads.append(head)
        lines = head.decode().split("\r\n")
        path = lines[0].split(" ")[1]
        hdrs = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        body = b""
        if "content-length" in hdrs:
            body = await r.readexactly(int(hdrs["content-length"]))
        elif hdrs.get("transfer-encoding") == "chunked":
            while n := int((await r.readuntil(b"\r\n")).split(b";")[0], 16):
                body += (await r.readexactly(n + 2))[:-2]
            while await r.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
        out = json.dumps({"path": path, "headers": hdrs, "body": body.decode()}).encode()
        if path.startswith("/chunked"):
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (out[:10], out[10:]):
                w.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
                await w.drain()
            w.write(b"0\r\nX-Trailer: 1\r\n\r\n")
        elif path.startswith("/close"):
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + out)
            await w.drain()
            return
        elif path.startswith("/empty"):
            w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        elif path.startswith("/badchunk"):
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n")
            await w.drain()
            return
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
        await w.drain()


def run(coro: Awaitable[None]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, 60)

    asyncio.run(bounded())


def test_each_request_checked_and_bodies_framed() -> None:
    async def main() -> None:
        async with proxied(echo) as (_, url, heads):
            tok = {"X-Cpuos-Token": TOKEN}
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.get(url + "a?cpuos_token=" + TOKEN + "&x=1")
                assert r.status_code == 200 and r.json()["path"] == "/a?x=1"
                # one client connection: each request is checked, also after a good one
                assert (await c.get(url + "b")).status_code == 401
                r = await c.get(url + "c", headers=tok)
                assert r.status_code == 200
                r = await c.get(url + "chunked", headers=tok)
                assert r.json()["path"] == "/chunked" and "x-trailer" not in r.headers
                r = await c.get(url + "empty", headers=tok)
                assert r.status_code == 204 and r.content == b""
                r = await c.head(url + "d", headers=tok)
                assert r.status_code == 200 and r.content == b""
                r = await c.post(url + "up", headers=tok, content=b"x" * 300_000)
                assert r.json()["body"] == "x" * 300_000
                async def parts() -> AsyncIterator[bytes]:
                    for part in (b"ab", b"cd"):
                        yield part

                r = await c.post(url + "up", headers=tok, content=parts())
                assert r.json()["body"] == "abcd"  # (sent chunked)
                r = await c.get(url + "close", headers=tok)
                assert r.status_code == 200 and r.json()["path"] == "/close"
                r = await c.get(url + "e", headers={
                    **tok, "Cookie": f"cpuos_token_1={TOKEN}; keep=1",
                    "Authorization": "Bearer secret", "Connection": "keep-alive, X-Hop",
                    "X-Hop": "1"})
                seen = r.json()["headers"]
                assert seen["cookie"] == "keep=1" and "authorization" not in seen
                assert "x-cpuos-token" not in seen and "x-hop" not in seen
                with pytest.raises(httpx.HTTPError):  # a bad chunk: the answer is cut
                    await c.get(url + "badchunk", headers=tok)
            assert all(TOKEN.encode() not in h for h in heads)

    run(main())


def test_pipelined_requests_and_bad_heads() -> None:
    async def main() -> None:
        async with proxied(echo) as (_, url, heads):
            u = httpx.URL(url)
            r, w = await asyncio.open_connection(u.host, u.port)
            w.write(f"GET {u.path}one HTTP/1.1\r\nHost: h\r\nX-Cpuos-Token: {TOKEN}\r\n\r\n"
                    f"GET {u.path}two HTTP/1.1\r\nHost: h\r\n\r\n".encode())
            got = await r.read()  # the proxy closes after its 401
            assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 401" in got
            assert len(heads) == 1
            w.close()
            for bad, status in ((b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"400"),
                                (b"GET / HTTP/1.1\r\nX: " + b"a" * 40000, b"431"),
                                (b"CONNECT x:1 HTTP/1.1\r\nHost: x\r\n\r\n", b"400")):
                r, w = await asyncio.open_connection(u.host, u.port)
                w.write(bad)
                got = await r.read()
                assert got.startswith(b"HTTP/1.1 " + status), (bad[:30], got[:80])
                w.close()

    run(main())


def test_connections_waiting_for_a_head_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # (long enough for the checks below to come before it ends, on a loaded host too)
    monkeypatch.setattr(preview, "HEAD_TIMEOUT", 2.0)

    async def main() -> None:
        cfg = PreviewConfig(max_pending_per_ip=5, max_pending=8)
        async with proxied(echo, cfg=cfg) as (pv, url, _):
            u = httpx.URL(url)
            socks = []
            for _ in range(20):
                s = socket.create_connection((u.host, u.port or 80))
                s.sendall(b"GET / HTTP/1.1\r\nHost: ")
                socks.append(s)
            # (closed: refused, or made way for a newer one whose head had not been read;
            # one that made way leaves the proxy's clients when its task sees it closed)
            await until(lambda: sum(map(closed_by_peer, socks)) >= 15
                        and len(pv.clients) <= 5, "15 of 20 closed, 5 held at most")
            assert len(pv.pending) <= 5 and len(pv.clients) <= 5
            # from another address there is room, up to the global cap
            others = []
            for i in range(6):
                s = socket.socket()
                s.bind((f"127.0.0.{2 + i}", 0))
                s.connect((u.host, u.port or 80))
                others.append(s)
            await until(lambda: len(pv.pending) == 8, "the global cap")
            # and an idle kept-alive connection makes way for a new one from its address
            for s in socks + others:
                s.close()
            # (the head timeout ends what is left)
            await until(lambda: not pv.pending, "nothing pending")
            assert not pv.pending and not pv.clients
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(
                    max_keepalive_connections=10)) as c:
                await asyncio.gather(*(c.get(url + "k", headers={"X-Cpuos-Token": TOKEN})
                                       for _ in range(5)))
                assert len(pv.pending) == 5  # five idle kept-alive connections
                extra = socket.create_connection((u.host, u.port or 80))
                extra.sendall(b"GET / HTTP/1.1\r\nHost: ")
                await until(lambda: len(pv.clients) == 5, "an idle one closed")
                assert len(pv.pending) == 5 and len(pv.clients) == 5  # one idle one closed
                extra.close()

    run(main())


def test_a_connection_silent_past_the_head_timeout_is_served_and_makes_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A browser opens connections ahead of its requests: one that sends its first request
    later than a head may take is served (the head's deadline starts at its first byte),
    and silent ones make way for a new client at the cap."""
    monkeypatch.setattr(preview, "HEAD_TIMEOUT", 0.3)

    async def main() -> None:
        cfg = PreviewConfig(max_pending_per_ip=3, max_pending=8)
        async with proxied(echo, cfg=cfg) as (pv, url, _):
            u = httpx.URL(url)
            target = (u.host, u.port or 80)
            req = (f"GET {u.raw_path.decode()}late HTTP/1.1\r\nHost: {u.host}\r\n"
                   f"X-Cpuos-Token: {TOKEN}\r\n\r\n").encode()
            r, w = await asyncio.open_connection(*target)
            # silent for longer than a head may take: a head begun at the same time is cut
            br, bw = await asyncio.open_connection(*target)
            bw.write(b"GET / HTTP/1.1\r\n")
            assert await asyncio.wait_for(br.read(), 10) == b""
            bw.close()
            w.write(req)
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            w.close()
            silent = [await asyncio.open_connection(*target) for _ in range(3)]
            await until(lambda: pv.pending_by_ip == {"127.0.0.1": 3}, "three pending")
            r, w = await asyncio.open_connection(*target)
            w.write(req)
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            w.close()
            # the oldest silent one was closed to make way
            assert await asyncio.wait_for(silent[0][0].read(), 10) == b""
            for _, sw in silent:
                sw.close()

    run(main())


def test_host_form_cookie_and_redirects() -> None:
    async def main() -> None:
        async with proxied(echo) as (_, url, heads):
            assert not heads
            u = httpx.URL(url)
            port = u.path.rstrip("/").rsplit("/", 1)[1]
            host = {"Host": f"{port}-{SID}.localhost:{u.port}"}
            nav = {"Sec-Fetch-Mode": "navigate"}
            base = f"http://{u.host}:{u.port}"
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.get(base + f"//evil.example/x?cpuos_token={TOKEN}",
                                headers={**host, **nav})
                assert r.status_code == 303 and r.headers["location"] == "/evil.example/x"
                r = await c.get(url + f"/evil.example/x?cpuos_token={TOKEN}", headers=nav)
                assert r.headers["location"].startswith(f"//{port}-{SID}.localhost:{u.port}"
                                                        "/evil.example/x?")
                c.cookies.clear()  # (the redirect's cookie: sent by hand below)
                # the cookie may come in a second Cookie header; none reaches the server
                r = await c.get(base + "/k", headers=[
                    *host.items(), ("Cookie", "a=1"),
                    ("Cookie", f"cpuos_token_{port}={TOKEN}")])
                assert r.status_code == 200, r.text
                assert r.json()["headers"]["cookie"] == "a=1"
                assert (await c.get(base + "/k", headers=host)).status_code == 401
            assert len(heads) == 1 and TOKEN.encode() not in heads[0]

    run(main())
