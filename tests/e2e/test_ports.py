"""Issue 13: preview URLs for servers inside a sandbox, through the daemon's preview proxy
(its own listener): token or public, path and host forms, the caller's Authorization never
reaching the sandbox, streaming and WebSocket upgrades passing through, unexposed ports
unreachable, and a request to a paused sandbox resuming it."""

from __future__ import annotations

import base64
import hashlib
import os
import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from cpuos import Sandbox
from cpuosd.testing import Daemon, e2e_unavailable, new_daemon, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.net]

# a server inside the sandbox: /headers echoes the request's headers, /stream sends five
# chunks, a WebSocket upgrade is answered 101 and then echoes what it gets
SERVER = r'''
import base64, hashlib, json, socketserver, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            key = self.headers["Sec-WebSocket-Key"].encode()
            acc = base64.b64encode(hashlib.sha1(
                key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
            self.send_response(101); self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", acc); self.end_headers()
            self.wfile.flush()
            while True:
                b = self.rfile.read1(65536)
                if not b: return
                self.wfile.write(b); self.wfile.flush()
        if self.path == "/stream":
            self.send_response(200); self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                c = f"event {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c)); self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n"); return
        body = json.dumps({"path": self.path, "headers": dict(self.headers)}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
S(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
'''


@pytest.fixture(scope="module")
def pd() -> Iterator[Daemon]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon(CPUOS_POOL_SIZE="0")  # network "off": previews need no egress
    d.start()
    yield d
    assert not d.teardown(False)


@pytest.fixture
def web(pd: Daemon) -> Iterator[Sandbox]:
    s = Sandbox.create(template="python", timeout="10m", **pd.sdk_kwargs())
    s.files.write("/work/server.py", SERVER)
    s.exec("nohup python3 /work/server.py 3000 >/tmp/server.log 2>&1 &")
    yield s
    s.kill()


def expose(d: Daemon, sid: str, port: int, public: bool = False) -> dict[str, Any]:
    with d.client() as c:
        r = c.post(f"/sandboxes/{sid}/ports", json={"port": port, "public": public})
        assert r.status_code == 201, r.text
        out: dict[str, Any] = r.json()
        return out


def get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=30, **kw)


def test_token_path_and_host_forms(pd: Daemon, web: Sandbox) -> None:
    """Issue 25: the path form (programs) takes the token per request and sets no cookie;
    a browser is served the host form, its own origin per sandbox and port."""
    p = expose(pd, web.id, 3000)
    url, token = p["url"], p["token"]
    assert url.endswith(f"/sandboxes/{web.id}/ports/3000/")
    tok = {"X-Cpuos-Token": token}
    wait_until(lambda: get(url + "headers", headers=tok).status_code == 200,
               "the server inside to answer", 60)
    r = get(url + "headers")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = get(url + "headers", headers={"X-Cpuos-Token": "nope"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert get(url + "headers?cpuos_token=nope").status_code == 403
    # the token in the query (a program): served as it is, without the token
    r = get(url + "headers?cpuos_token=" + token + "&x=1")
    assert r.status_code == 200 and r.json()["path"] == "/headers?x=1"
    assert "set-cookie" not in r.headers
    # a browser is sent to the sandbox's own origin (the host form), which sets the cookie
    r = get(url + "headers?cpuos_token=" + token + "&x=1",
            headers={"Sec-Fetch-Mode": "navigate"})
    assert r.status_code == 303
    assert r.headers["location"].startswith(f"//3000-{web.id}.localhost:")
    assert "set-cookie" not in r.headers
    # the caller's Authorization, the token header and the cookie never reach the sandbox
    r = get(url + "headers", headers={**tok, "Authorization": "Bearer caller-secret",
                                      "Cookie": f"cpuos_token_3000={token}; mine=1"})
    h = {k.lower(): v for k, v in r.json()["headers"].items()}
    assert "authorization" not in h and "x-cpuos-token" not in h
    assert h.get("cookie") == "mine=1" and token not in json.dumps(h)
    # host form: <port>-<id>.localhost; a browser's token becomes a cookie of that host
    hu = urlsplit(p["host_url"])
    assert hu.hostname == f"3000-{web.id}.localhost"
    host = {"Host": f"{hu.hostname}:{hu.port}"}
    r = get(f"http://127.0.0.1:{hu.port}/headers", headers={**host, **tok})
    assert r.status_code == 200 and r.json()["path"] == "/headers"
    r = get(f"http://127.0.0.1:{hu.port}/headers?cpuos_token={token}&x=1",
            headers={**host, "Upgrade-Insecure-Requests": "1"})
    assert r.status_code == 303 and r.headers["location"] == "/headers?x=1"
    assert token in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
    r = get(f"http://127.0.0.1:{hu.port}/headers",
            headers={**host, "Cookie": f"cpuos_token_3000={token}"})
    assert r.status_code == 200, r.text
    # streaming passes through as it comes
    with httpx.stream("GET", url + "stream", headers=tok, timeout=30) as s:
        chunks = [c for c in s.iter_text() if c]
    assert "".join(chunks) == "".join(f"event {i}\n" for i in range(5))
    # a port not exposed, and one unexposed, are unreachable
    assert get(url.replace("/3000/", "/3001/") + "headers", headers=tok).status_code == 404
    with pd.client() as c:
        assert [x["port"] for x in c.get(f"/sandboxes/{web.id}/ports").json()["ports"]] \
            == [3000]
        assert c.delete(f"/sandboxes/{web.id}/ports/3000").status_code == 200
        assert c.delete(f"/sandboxes/{web.id}/ports/3000").status_code == 404
    assert get(url + "headers", headers=tok).status_code == 404


def test_public_port_and_websocket(pd: Daemon, web: Sandbox) -> None:
    p = expose(pd, web.id, 3000, public=True)
    wait_until(lambda: get(p["url"] + "headers").status_code == 200, "the server inside", 60)
    u = urlsplit(p["url"])
    key = base64.b64encode(b"0123456789abcdef").decode()
    with socket.create_connection((u.hostname or "", u.port or 80), timeout=10) as s:
        s.sendall((f"GET {u.path}ws HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                   "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            b = s.recv(4096)
            assert b, head
            head += b
        assert head.startswith(b"HTTP/1.0 101") or head.startswith(b"HTTP/1.1 101"), head
        lower = head.lower()  # what a WebSocket client checks (Playwright's does)
        assert b"\r\nupgrade: websocket\r\n" in lower and b"\r\nconnection: upgrade" in lower
        assert b"sec-websocket-accept: " in lower, head
        s.sendall(b"ping-through-the-proxy")
        got = head.split(b"\r\n\r\n", 1)[1]
        while len(got) < len(b"ping-through-the-proxy"):
            got += s.recv(4096)
        assert got == b"ping-through-the-proxy"


def test_request_wakes_a_paused_sandbox(pd: Daemon, web: Sandbox) -> None:
    p = expose(pd, web.id, 3000)
    tok = {"X-Cpuos-Token": p["token"]}
    wait_until(lambda: get(p["url"] + "headers", headers=tok).status_code == 200,
               "the server inside", 60)
    web.pause()
    assert web.info().state == "paused"
    with concurrent.futures.ThreadPoolExecutor(20) as ex:
        codes = list(ex.map(lambda _: get(p["url"] + "headers", headers=tok).status_code,
                            range(20)))
    assert codes == [200] * 20
    with pd.client() as c:
        assert c.get(f"/sandboxes/{web.id}").json()["state"] == "running"


def test_sdk_and_cli(pd: Daemon, web: Sandbox) -> None:
    from typer.testing import CliRunner

    from cpuos.cli import main as cli

    url = web.ports.expose(3000)
    assert "cpuos_token=" in url
    wait_until(lambda: get(url, follow_redirects=True).status_code == 200,
               "the server inside", 60)
    assert web.get_host(3000).startswith(f"http://3000-{web.id}.localhost:")
    assert [p["port"] for p in web.ports.list()] == [3000]
    api = ["--api-url", pd.url, "--api-key", pd.key]
    r = CliRunner().invoke(cli.app, ["port", "expose", web.id, "8080", *api])
    assert r.exit_code == 0 and r.stdout.strip().endswith(
        f"/sandboxes/{web.id}/ports/8080/?cpuos_token=" + web.ports.info(8080)["token"])
    r = CliRunner().invoke(cli.app, ["port", "ls", web.id, *api])
    assert r.exit_code == 0 and "8080" in r.stdout and "3000" in r.stdout
    assert CliRunner().invoke(cli.app, ["port", "rm", web.id, "8080", *api]).exit_code == 0
    web.ports.unexpose(3000)
    assert web.ports.list() == []


def test_big_download_websocket_order_and_other_tokens(pd: Daemon, web: Sandbox) -> None:
    """A 100 MiB download arrives whole; 1000 WebSocket-channel messages round-trip in
    order; another sandbox's token opens nothing here."""
    p = expose(pd, web.id, 3000)
    tok = {"X-Cpuos-Token": p["token"]}
    web.exec("head -c 104857600 /dev/urandom > /work/big.bin")
    want = web.exec("sha256sum /work/big.bin").stdout.split()[0]
    other = Sandbox.create(template="python", timeout="5m", **pd.sdk_kwargs())
    try:
        other_token = expose(pd, other.id, 3000)["token"]
        wait_until(lambda: get(p["url"] + "headers", headers=tok).status_code == 200,
                   "the server inside", 60)
        r = get(p["url"] + "headers", headers={"X-Cpuos-Token": other_token})
        assert r.status_code == 403
    finally:
        other.kill()
    web.exec("cd /work && nohup python3 -m http.server 3001 >/dev/null 2>&1 &")
    p2 = expose(pd, web.id, 3001)
    h = hashlib.sha256()
    wait_until(lambda: get(p2["url"], headers={"X-Cpuos-Token": p2["token"]}).status_code
               == 200, "http.server inside", 60)
    with httpx.stream("GET", p2["url"] + "big.bin", timeout=120,
                      headers={"X-Cpuos-Token": p2["token"]}) as s:
        assert s.status_code == 200
        for chunk in s.iter_bytes():
            h.update(chunk)
    assert h.hexdigest() == want
    u = urlsplit(p["url"])
    key = base64.b64encode(b"0123456789abcdef").decode()
    with socket.create_connection((u.hostname or "", u.port or 80), timeout=30) as c:
        c.sendall((f"GET {u.path}ws HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                   f"X-Cpuos-Token: {p['token']}\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += c.recv(4096)
        buf = buf.split(b"\r\n\r\n", 1)[1]
        msgs = [f"message {i:04d};".encode() for i in range(1000)]
        for m in msgs:
            c.sendall(m)
        want_all = b"".join(msgs)
        while len(buf) < len(want_all):
            b = c.recv(65536)
            assert b
            buf += b
        assert buf == want_all


def test_bad_input_and_no_leaks(pd: Daemon, web: Sandbox) -> None:
    with pd.client() as c:
        for bad in (0, 65536, "x", None):
            r = c.post(f"/sandboxes/{web.id}/ports", json={"port": bad})
            assert r.status_code == 422, (bad, r.text)
        key = c.post("/workspaces", json={"name": "ports-other"}).json()["key"]
        r = c.post(f"/sandboxes/{web.id}/ports", json={"port": 3000},
                   headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 404
    p = expose(pd, web.id, 3000)
    base = p["url"].split("/sandboxes/")[0]
    r = get(base + "/", headers={"Host": "nosuch.localhost"})
    assert r.status_code == 404 and "error" in r.json()
    r = get(base + "/", headers={"Host": "3000-sbx-000000000000.localhost"})
    assert r.status_code == 404
    assert get(base + "/sandboxes/sbx-000000000000/ports/3000/").status_code == 404
    tok = {"X-Cpuos-Token": p["token"]}
    wait_until(lambda: get(p["url"] + "headers", headers=tok).status_code == 200,
               "the server inside", 60)
    assert pd.proc is not None
    pid = pd.proc.pid

    def fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    before = fds()
    u = urlsplit(p["url"])
    for _ in range(200):  # a client that goes away in the middle of a request body
        with socket.create_connection((u.hostname or "", u.port or 80), timeout=10) as conn:
            conn.sendall((f"POST {u.path}headers HTTP/1.1\r\nHost: {u.netloc}\r\n"
                       f"X-Cpuos-Token: {p['token']}\r\nContent-Length: 100000\r\n\r\n"
                       "partial").encode())
    wait_until(lambda: fds() <= before + 5, "the proxy's connections closed", 60)


def test_connections_to_a_public_port_are_coalesced_in_the_audit(pd: Daemon,
                                                                 web: Sandbox) -> None:
    """Issue 25, finding 6: anyone may connect to a public port, and each connection used to
    be an audit row. 150 connections from one peer, each a request of its own: one row at
    once, then one with a ``count`` per 5 s window (at most two rows a window), every
    connection counted."""
    t0 = time.monotonic()
    p = expose(pd, web.id, 3000, public=True)
    wait_until(lambda: get(p["url"] + "headers").status_code == 200, "the server inside", 60)

    def connects() -> list[dict[str, Any]]:
        with pd.client() as c:
            r = c.get(f"/sandboxes/{web.id}/audit", params={"kind": "port", "limit": 10000})
        assert r.status_code == 200, r.text
        return [x["detail"] for x in r.json()["rows"]
                if x["detail"].get("action") == "connect" and x["detail"].get("port") == 3000]

    def counted() -> int:
        return sum(int(d.get("count") or 1) for d in connects())

    wait_until(lambda: counted() >= 1, "the first connection on record", 30)
    before = counted()
    for _ in range(150):  # a new connection each (no keep-alive)
        assert get(p["url"] + "headers", headers={"Connection": "close"}).status_code == 200
    wait_until(lambda: counted() >= before + 150, "every connection counted", 60)
    rows = connects()
    assert counted() == before + 150
    windows = (time.monotonic() - t0) / 5 + 2
    assert len(rows) <= 2 * windows and len(rows) < counted(), rows  # not one a connection
    assert any(int(d.get("count") or 1) > 1 for d in rows)
