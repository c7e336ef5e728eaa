"""Issue 25, findings 2 and 7: every request through the preview proxy is checked on its own
(also behind a real front proxy that reuses its connections: nginx with an upstream
keepalive pool, on loopback), and a browser is served each sandbox's port on an origin of
its own, with no cookie on the shared one.

Before: the proxy checked a connection's first request only. Through nginx a request with
no token rode on the victim's authorised connection and got 200, and after an attacker's
request to its own public port the victim's next request (token and all) reached the
attacker's server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from cpuos import Sandbox
from support.daemon import Daemon, e2e_unavailable, free_port, new_daemon, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.net]

# inside each sandbox: answers who it is (NAME), what it got and from which connection, and
# logs every request; /cookie sets cookies for the whole preview domain
SERVER = r'''
import json, os, socketserver, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
NAME = os.environ["NAME"]
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        seen = {"name": NAME, "path": self.path, "headers": dict(self.headers),
                "peer_port": self.client_address[1]}
        with open("/tmp/requests.log", "a") as f:
            f.write(json.dumps(seen) + "\n")
        body = json.dumps(seen).encode()
        self.send_response(200)
        if self.path.startswith("/cookie"):
            self.send_header("Set-Cookie", "app=1; Domain=localhost; Path=/; HttpOnly")
            self.send_header("Set-Cookie", "other=2; path=/; domain=.localhost")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
S(("0.0.0.0", 3000), H).serve_forever()
'''

NGINX = """
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream preview {{ server 127.0.0.1:{upstream}; keepalive 8; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://preview;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_buffering off;
    }}
  }}
}}
"""


@pytest.fixture(scope="module")
def pd() -> Iterator[Daemon]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon(CPUOS_POOL_SIZE="0")
    d.start()
    yield d
    assert not d.teardown(False)


def serve(d: Daemon, name: str, key: str | None = None, public: bool = False
          ) -> tuple[Sandbox, dict[str, Any]]:
    s = Sandbox.create(template="python", timeout="10m", **d.sdk_kwargs(key))
    s.files.write("/work/server.py", SERVER)
    assert s.exec(f"NAME={name} nohup python3 /work/server.py >/tmp/server.log 2>&1 &"
                  ).exit_code == 0
    with d.client(key) as c:
        r = c.post(f"/sandboxes/{s.id}/ports", json={"port": 3000, "public": public})
        assert r.status_code == 201, r.text
        p: dict[str, Any] = r.json()
    tok = {} if public else {"X-Cpuos-Token": p["token"]}
    wait_until(lambda: httpx.get(p["url"] + "up", headers=tok, timeout=30).status_code
               == 200, f"the {name} server", 60)
    return s, p


def seen(s: Sandbox) -> list[dict[str, Any]]:
    return [json.loads(line) for line in s.files.read_text("/tmp/requests.log").splitlines()]


@pytest.fixture(scope="module")
def tenants(pd: Daemon) -> Iterator[tuple[tuple[Sandbox, dict[str, Any]],
                                          tuple[Sandbox, dict[str, Any]]]]:
    """The victim (a token port) and, in another workspace, the attacker (a public port)."""
    with pd.client() as c:
        key = c.post("/workspaces", json={"name": "attacker"}).json()["key"]
    victim = serve(pd, "victim")
    attacker = serve(pd, "attacker", key, public=True)
    yield victim, attacker
    victim[0].kill()
    attacker[0].kill()


@pytest.fixture(scope="module")
def nginx(pd: Daemon, tenants: Any) -> Iterator[str]:
    """nginx (Debian's) on loopback in front of the preview port, one worker, an upstream
    keepalive pool; started and stopped by pid."""
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(exe):
        pytest.skip("nginx is not installed (scripts/setup.sh --dev installs it)")
    upstream = urlsplit(tenants[0][1]["url"]).port
    d = Path(tempfile.mkdtemp(prefix="cpuos-nginx-"))
    port = free_port()
    (d / "nginx.conf").write_text(NGINX.format(dir=d, upstream=upstream, port=port))
    proc = subprocess.Popen([exe, "-p", str(d), "-c", str(d / "nginx.conf"),
                             "-e", str(d / "error.log")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                assert proc.poll() is None, (d / "error.log").read_text()
                return False

        wait_until(up, "nginx to listen", 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def via(front: str, where: tuple[str | None, str], tail: str, **headers: str
        ) -> httpx.Response:
    """One request through nginx, on a new client connection (nginx reuses its own)."""
    host, prefix = where
    return httpx.get(front + prefix + tail, headers={**({"Host": host} if host else {}),
                                                    **headers}, timeout=30)


def target(form: str, front: str, sbx: Sandbox, p: dict[str, Any]) -> tuple[str | None, str]:
    """(the Host header, the path prefix) of sbx's port 3000 through nginx, in one form."""
    if form == "host":
        return f"3000-{sbx.id}.localhost:{urlsplit(front).port}", "/"
    return None, urlsplit(p["url"]).path


@pytest.mark.parametrize("form", ["host", "path"])
def test_no_request_rides_on_an_authorised_connection(nginx: str, tenants: Any, form: str
                                                      ) -> None:
    (vs, vp), _ = tenants
    victim = target(form, nginx, vs, vp)
    base = len(seen(vs))
    reused = 0
    for i in range(6):
        r = via(nginx, victim, f"mine-{i}", **{"X-Cpuos-Token": vp["token"]})
        assert r.status_code == 200 and r.json()["name"] == "victim"
        again = via(nginx, victim, f"mine-{i}", **{"X-Cpuos-Token": vp["token"]})
        # (one sandbox connection per client connection: the same peer port means nginx
        # sent both on one connection)
        reused += again.json()["peer_port"] == r.json()["peer_port"]
        # the next request nginx sends on that same connection has no token
        r = via(nginx, victim, f"theirs-{i}")
        assert r.status_code == 401, r.text
        r = via(nginx, victim, f"theirs-{i}", **{"X-Cpuos-Token": "wrong"})
        assert r.status_code == 403, r.text
    assert reused >= 3, reused  # nginx did reuse its connections
    got = seen(vs)[base:]
    assert [g["path"] for g in got] == [f"/mine-{i}" for i in range(6) for _ in (0, 1)]
    for g in got:  # stripped on every request, not only a connection's first
        h = {k.lower() for k in g["headers"]}
        assert "x-cpuos-token" not in h and "authorization" not in h


@pytest.mark.parametrize("form", ["host", "path"])
def test_no_request_lands_on_another_sandbox(nginx: str, tenants: Any, form: str) -> None:
    (vs, vp), (as_, ap) = tenants
    victim, attacker = target(form, nginx, vs, vp), target(form, nginx, as_, ap)
    before = len(seen(as_))
    for i in range(6):
        r = via(nginx, attacker, f"bait-{i}")  # the attacker's own public port
        assert r.status_code == 200 and r.json()["name"] == "attacker"
        r = via(nginx, victim, f"secret-{i}", **{"X-Cpuos-Token": vp["token"]},
                Cookie=f"cpuos_token_3000={vp['token']}; app=1")
        assert r.status_code == 200 and r.json()["name"] == "victim", r.text
        assert r.json()["headers"].get("Cookie") == "app=1"
    got = seen(as_)[before:]
    assert [g["path"] for g in got] == [f"/bait-{i}" for i in range(6)]
    assert vp["token"] not in json.dumps(got)


def test_pipelined_requests_each_checked(pd: Daemon, tenants: Any) -> None:
    """Two requests in one write: the second, without a token, is refused."""
    (vs, vp), _ = tenants
    u = urlsplit(vp["url"])
    base = len(seen(vs))
    with socket.create_connection((u.hostname or "", u.port or 80), timeout=30) as s:
        s.sendall((f"GET {u.path}one HTTP/1.1\r\nHost: {u.netloc}\r\n"
                   f"X-Cpuos-Token: {vp['token']}\r\n\r\n"
                   f"GET {u.path}two HTTP/1.1\r\nHost: {u.netloc}\r\n\r\n").encode())
        got = b""
        while got.count(b"HTTP/1.1 ") < 2 or not got.endswith(b"}"):
            b = s.recv(65536)
            if not b:
                break
            got += b
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert b"HTTP/1.1 401" in got, got[-400:]
    assert [g["path"] for g in seen(vs)[base:]] == ["/one"]


def host_get(front: str, host: str, path: str, **headers: str) -> httpx.Response:
    return httpx.get(front + path, headers={"Host": host, **headers}, timeout=30)


def test_one_origin_per_sandbox_and_port(pd: Daemon, tenants: Any) -> None:
    (vs, vp), (as_, ap) = tenants
    u = urlsplit(vp["url"])
    front = f"http://{u.netloc}"
    vhost = f"3000-{vs.id}.localhost:{u.port}"
    nav = {"Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    # a browser opening the path form (the URL sbx.ports.expose gives) is sent to the
    # sandbox's own origin, the token still in the query
    r = httpx.get(vp["url"] + "page?cpuos_token=" + vp["token"] + "&x=1", headers=nav,
                  timeout=30)
    assert r.status_code == 303, r.text
    assert r.headers["location"] == f"//{vhost}/page?cpuos_token={vp['token']}&x=1"
    assert "set-cookie" not in r.headers
    # there, the token becomes a host-only cookie (no Domain: no other sandbox's host gets
    # it) and the URL loses it
    r = host_get(front, vhost, f"/page?cpuos_token={vp['token']}&x=1", **nav)
    assert r.status_code == 303 and r.headers["location"] == "/page?x=1"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"cpuos_token_3000={vp['token']};")
    assert "domain" not in cookie.lower() and "Path=/;" in cookie and "HttpOnly" in cookie
    r = host_get(front, vhost, "/page?x=1", Cookie=f"cpuos_token_3000={vp['token']}")
    assert r.status_code == 200 and r.json()["name"] == "victim"
    assert r.json()["path"] == "/page?x=1" and "Cookie" not in r.json()["headers"]
    # a cookie of the same name tossed in from elsewhere neither locks the visitor out nor
    # reaches the server
    r = host_get(front, vhost, "/page", Cookie=f"cpuos_token_3000=tossed; cpuos_token_3000="
                 f"{vp['token']}; cpuos_token_9=x; app=1")
    assert r.status_code == 200 and r.json()["headers"]["Cookie"] == "app=1"
    # the path form (one origin for everyone) takes no cookie and keeps none
    r = httpx.get(vp["url"] + "page", headers={"Cookie": f"cpuos_token_3000={vp['token']}"},
                  timeout=30)
    assert r.status_code == 401
    r = httpx.get(vp["url"] + "cookie", headers={"X-Cpuos-Token": vp["token"]}, timeout=30)
    assert r.status_code == 200 and "set-cookie" not in r.headers
    assert r.headers["content-security-policy"].startswith("sandbox")
    assert "allow-same-origin" not in r.headers["content-security-policy"]
    # on its own origin a sandbox's cookies stay there: Domain removed
    r = host_get(front, vhost, "/cookie", **{"X-Cpuos-Token": vp["token"]})
    cookies = r.headers.get_list("set-cookie")
    assert cookies == ["app=1; Path=/; HttpOnly", "other=2; path=/"], cookies
    assert "content-security-policy" not in r.headers
    # another sandbox's origin is another origin: B's cookie opens nothing at A, A's token
    # nothing at B; a look-alike host is no preview
    ahost = f"3000-{as_.id}.localhost:{u.port}"
    assert host_get(front, ahost, "/x").json()["name"] == "attacker"  # (public)
    assert host_get(front, vhost, "/x", Cookie="cpuos_token_3000=" + ap["token"]
                    ).status_code == 403
    for bad in (f"3000-{vs.id}.evil.localhost", f"3000-{vs.id}.localhost.evil",
                f"x3000-{vs.id}.localhost"):
        r = host_get(front, bad, "/x", **{"X-Cpuos-Token": vp["token"]})
        assert r.status_code == 404, (bad, r.status_code)
