"""Preview URLs and the E2B surface through the API tier (issue 24, docs/DEPLOY.md): two node
processes (real runsc) and two API processes over one Postgres and a loopback S3. A preview
request to an API process's preview port reaches the node holding the sandbox (its token
rules as on one host, an upgrade relayed), follows the sandbox to another node after a pause
into the store and its first node's SIGKILL, and answers 404 for an unknown sandbox and 503
for a sandbox whose node is dead; E2B's control plane and envd (by header and by host name)
reach the sandbox's node; the sandbox's JSON and ``cpuos info`` name the node. All traffic
is on loopback."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from cpuos import Sandbox
from support import testbed
from support.daemon import e2e_unavailable, wait_until
from support.testbed import ApiProcess, Cluster, node_of, open_test_store, place_only_on

pytestmark = pytest.mark.cluster

# a server answering an upgrade with 101, then echoing bytes (the WebSocket relay's path)
ECHO_UPGRADE = r"""
import socket, threading
def serve(c):
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(4096)
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
    while True:
        d = c.recv(4096)
        if not d:
            break
        c.sendall(d)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 3001)); s.listen()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


@pytest.fixture(scope="module")
def cluster(pg_server: testbed.PostgresServer, s3_server: testbed.S3Server
            ) -> Iterator[tuple[Cluster, str]]:
    """One cluster for this module's tests (they leave its nodes as they found them)."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    name = "t_" + secrets.token_hex(6)
    url = pg_server.create_database(name)
    bucket = "snap-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    try:
        with testbed.node_cluster(url, s3_server.env(bucket)) as c:
            yield c, url
    finally:
        pg_server.drop_database(name)


def preview(api: ApiProcess, sid: str, port: int, path: str = "/",
            headers: dict[str, str] | None = None) -> httpx.Response:
    """A host-form preview request to ``api``'s preview listener (on loopback)."""
    return httpx.get(f"{api.preview_url}{path}", timeout=120, headers={
        "Host": f"{port}-{sid}.localhost:{api.preview_port}", **(headers or {})})


def serve_site(s: Sandbox, text: str) -> None:
    s.exec(f"mkdir -p /work/site && echo {text} > /work/site/index.html && cd /work/site && "
           "nohup python3 -m http.server 3000 >/dev/null 2>&1 &")


def test_previews_through_the_api_tier(cluster: tuple[Cluster, str]) -> None:
    c, url = cluster
    api1, api2 = c.apis
    key = c.key
    place_only_on(url, key, c.apis, "node-b")
    s = Sandbox.create(template="python", timeout="10m", api_url=api1.url, api_key=key)
    try:
        assert node_of(url, s.id) == "node-b"
        # the sandbox's JSON and `cpuos info` name its node
        assert s.info().node_id == "node-b"
        r = subprocess.run([sys.executable, "-m", "cpuos.cli.main", "info", s.id],
                           env={**os.environ, "CPUOS_API_URL": api2.url, "CPUOS_API_KEY": key},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "node-b" in r.stdout, (r.stdout, r.stderr)

        serve_site(s, "hello-from-b")
        s.exec("nohup python3 -c '" + ECHO_UPGRADE.replace("'", "'\\''")
               + "' >/dev/null 2>&1 &")
        p = httpx.post(f"{api2.url}/sandboxes/{s.id}/ports", json={"port": 3000},
                       headers={"Authorization": f"Bearer {key}"}).json()
        # the URLs in the answer name the API tier's preview listener
        assert p["host_url"] == f"http://3000-{s.id}.localhost:{api1.preview_port}/", p
        tok = {"X-Cpuos-Token": p["token"]}
        wait_until(lambda: preview(api1, s.id, 3000, headers=tok).status_code == 200,
                   "the server inside, through the API tier", timeout=60)
        for api in (api1, api2):
            got = preview(api, s.id, 3000, "/index.html", tok)
            assert got.status_code == 200 and got.text == "hello-from-b\n"
            # the node's token rules, as on one host
            r0 = preview(api, s.id, 3000)
            assert r0.status_code == 401 and r0.json()["error"]["code"] == "unauthorized"
            assert preview(api, s.id, 3000, headers={"X-Cpuos-Token": "x" * 32}
                           ).status_code == 403
            # the path form, token in the query
            got = httpx.get(f"{api.preview_url}/sandboxes/{s.id}/ports/3000/index.html",
                            params={"cpuos_token": p["token"]}, timeout=60)
            assert got.status_code == 200 and got.text == "hello-from-b\n"
            assert "sandbox" in got.headers["content-security-policy"]
        # two requests on one kept-alive connection: each routed and checked on its own
        with httpx.Client(timeout=60) as kc:
            h = {"Host": f"3000-{s.id}.localhost:{api1.preview_port}"}
            assert kc.get(api1.preview_url + "/", headers={**h, **tok}).status_code == 200
            assert kc.get(api1.preview_url + "/", headers=h).status_code == 401
        # unknown sandbox: 404; no preview at all: 404
        r404 = preview(api1, "sbx-000000000000", 3000)
        assert r404.status_code == 404 and r404.json()["error"]["code"] == "not_found"
        assert httpx.get(api1.preview_url + "/", timeout=30).status_code == 404

        # an upgrade (as a WebSocket's) relayed both ways, through the API tier and the node
        httpx.post(f"{api1.url}/sandboxes/{s.id}/ports", json={"port": 3001, "public": True},
                   headers={"Authorization": f"Bearer {key}"}).raise_for_status()

        def upgraded() -> bytes:
            with socket.create_connection(("127.0.0.1", api2.preview_port), timeout=30) as so:
                so.sendall(f"GET / HTTP/1.1\r\nHost: 3001-{s.id}.localhost\r\n"
                           "Connection: Upgrade\r\nUpgrade: echo\r\n\r\n".encode())
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = so.recv(4096)
                    if not chunk:
                        return head
                    head += chunk
                if not head.startswith(b"HTTP/1.1 101"):
                    return head
                so.sendall(b"ping-42")
                got = b""
                while len(got) < 7:
                    chunk = so.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                return got
        wait_until(lambda: upgraded() == b"ping-42", "an upgraded connection's echo",
                   timeout=60)
    finally:
        s.kill()

    # paused into the store on node-a; node-a SIGKILLed; the preview URL through the API
    # tier wakes it on node-b. A sandbox still running on node-a answers 503 meanwhile.
    place_only_on(url, key, c.apis, "node-a")
    moved = Sandbox.create(template="python", timeout="10m", api_url=api1.url, api_key=key)
    stuck = Sandbox.create(template="python", timeout="10m", api_url=api1.url, api_key=key)
    try:
        assert node_of(url, moved.id) == node_of(url, stuck.id) == "node-a"
        for x in (moved, stuck):
            serve_site(x, "moved" if x is moved else "stuck")
        pm = moved.ports.info(3000)
        ps = stuck.ports.info(3000)
        wait_until(lambda: preview(api1, moved.id, 3000, headers={
            "X-Cpuos-Token": pm["token"]}).status_code == 200, "the server in moved", 60)
        moved.pause()
        assert node_of(url, moved.id) is None  # (in the store, on no node)
        c.nodes[0].kill9()
        place_only_on(url, key, c.apis, "node-b")
        wait_until(lambda: api1.health().get("nodes_alive") == 1, "node-a dead", timeout=30)
        got = preview(api1, moved.id, 3000, "/index.html", {"X-Cpuos-Token": pm["token"]})
        assert got.status_code == 200 and got.text == "moved\n", got.text
        assert node_of(url, moved.id) == "node-b"
        assert moved.info().node_id == "node-b"
        dead = preview(api2, stuck.id, 3000, headers={"X-Cpuos-Token": ps["token"]})
        assert dead.status_code == 503 and dead.json()["error"]["code"] == "unavailable"
    finally:
        moved.kill()
        if c.nodes[0].proc is not None and c.nodes[0].proc.poll() is not None:
            c.nodes[0].start()  # (its sandbox reattached, then killed)
        wait_until(lambda: api1.health().get("nodes_alive") == 2, "node-a back", timeout=60)
        Sandbox.connect(stuck.id, api_url=api1.url, api_key=key).kill()
        place_only_on(url, key, c.apis, None)


def signed(path: str, token: str) -> dict[str, str]:
    """The query of E2B's signed read URL (the SDK's download_url) for path."""
    raw = f"{path}:read:user:{token}".encode()
    sig = "v1_" + base64.b64encode(hashlib.sha256(raw).digest()).rstrip(b"=").decode()
    return {"path": path, "username": "user", "signature": sig}


def test_e2b_requests_reach_the_sandboxs_node(cluster: tuple[Cluster, str]) -> None:
    c, url = cluster
    api1, api2 = c.apis
    key = c.key
    control = {"X-API-Key": key}
    made: dict[str, dict[str, str]] = {}
    try:
        for here in ("node-a", "node-b"):
            place_only_on(url, key, c.apis, here)
            r = httpx.post(f"{api1.url}/e2b/sandboxes", headers=control, timeout=120,
                           json={"templateID": "base", "timeout": 300})
            assert r.status_code == 201, r.text
            made[here] = r.json()
            assert node_of(url, r.json()["sandboxID"]) == here
        place_only_on(url, key, c.apis, None)
        # a bad key is refused by the API process (E2B's X-API-Key)
        r = httpx.get(f"{api2.url}/e2b/v2/sandboxes", headers={"X-API-Key": "e2b_" + "0" * 40})
        assert r.status_code == 401
        for here, sb in made.items():
            sid, token = sb["sandboxID"], sb["envdAccessToken"]
            envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                    "X-Access-Token": token}
            # envd by header, through the other API process: a file written and read back
            # (on another node than the sandbox's this is no sandbox running there)
            w = httpx.post(f"{api2.url}/e2b/files", params={"path": "/home/user/where.txt"},
                           headers={**envd, "Content-Type": "application/octet-stream"},
                           content=here.encode(), timeout=60)
            assert w.status_code == 200, w.text
            g = httpx.get(f"{api2.url}/e2b/files", params={"path": "/home/user/where.txt"},
                          headers=envd, timeout=60)
            assert g.status_code == 200 and g.content == here.encode(), g.text
            bad = httpx.get(f"{api2.url}/e2b/files", params={"path": "/home/user/where.txt"},
                            headers={**envd, "X-Access-Token": "0" * 64}, timeout=60)
            assert bad.status_code == 401
            # a signed file URL (E2B's download_url: no headers): its signature names it
            g = httpx.get(f"{api2.url}/files", params=signed("/home/user/where.txt", token),
                          timeout=60)
            assert g.status_code == 200 and g.content == here.encode(), g.text
            # envd by host name, through the API tier's preview listener
            h = httpx.get(f"{api1.preview_url}/files", params={"path": "/home/user/where.txt"},
                          headers={"Host": f"49983-{sid}.localhost:{api1.preview_port}",
                                   "X-Access-Token": token}, timeout=60)
            assert h.status_code == 200 and h.content == here.encode(), h.text
            # that hand-off carries the node token to the node's own API: it reaches E2B's
            # surface only, never the node's own routes (a drain)
            d = httpx.post(f"{api1.preview_url}/node/drain", timeout=60, headers={
                "Host": f"49983-{sid}.localhost:{api1.preview_port}", "X-Access-Token": token})
            assert "paused" not in d.text, d.text
            nodes = httpx.get(api1.url + "/nodes", headers={"Authorization": f"Bearer {key}"})
            assert not any(n["cordoned"] for n in nodes.json()["nodes"]), nodes.text
            # the control plane by the sandbox in the path: its node
            info = httpx.get(f"{api1.url}/e2b/sandboxes/{sid}", headers=control, timeout=60)
            assert info.status_code == 200 and info.json()["sandboxID"] == sid
        # a pause through the control plane runs on the sandbox's node
        sid_a = made["node-a"]["sandboxID"]
        r = httpx.post(f"{api2.url}/e2b/sandboxes/{sid_a}/pause", headers=control, timeout=120)
        assert r.status_code == 204, r.text
        store = open_test_store(url)
        try:
            row = store.get_sandbox(sid_a)
            assert row is not None and row.state == "paused" and row.node_id is None
        finally:
            store.close()
        # resumed on node-b (node-a cordoned): its access token still holds (one E2B key
        # on every node), and node-b answers with the facts node-a kept (its template name)
        place_only_on(url, key, c.apis, "node-b")
        r = httpx.post(f"{api1.url}/e2b/sandboxes/{sid_a}/connect", headers=control,
                       json={"timeout": 300}, timeout=120)
        assert r.status_code == 201 and r.json()["templateID"] == "base", r.text
        assert node_of(url, sid_a) == "node-b"
        envd = {"E2b-Sandbox-Id": sid_a, "X-Access-Token": made["node-a"]["envdAccessToken"]}
        g = httpx.get(f"{api2.url}/e2b/files", params={"path": "/home/user/where.txt"},
                      headers=envd, timeout=60)
        assert g.status_code == 200 and g.content == b"node-a", g.text
        # E2B's ports are public (no cpuos token) wherever the sandbox runs now
        httpx.post(f"{api1.url}/e2b/files", params={"path": "/home/user/s/index.html"},
                   headers={**envd, "Content-Type": "application/octet-stream"},
                   content=b"e2b-site\n", timeout=60).raise_for_status()
        httpx.post(f"{api1.url}/sandboxes/{sid_a}/exec", headers={
            "Authorization": f"Bearer {key}"}, json={
            "cmd": "cd /home/user/s && nohup python3 -m http.server 3000 >/dev/null 2>&1 &"},
            timeout=60).raise_for_status()
        wait_until(lambda: preview(api1, sid_a, 3000, "/index.html").text == "e2b-site\n",
                   "the E2B sandbox's public port through the API tier", timeout=60)
    finally:
        place_only_on(url, key, c.apis, None)
        for sb in made.values():
            httpx.delete(f"{api1.url}/e2b/sandboxes/{sb['sandboxID']}", headers=control,
                         timeout=120)


def test_big_bodies_stream_both_ways_through_the_api_tier(cluster: tuple[Cluster, str]
                                                          ) -> None:
    """A body larger than the API process reads whole (SMALL_BODY, 64 KiB) is streamed to
    the node as it comes, and a big answer back: the bytes arrive exact both ways."""
    c, _ = cluster
    s = Sandbox.create(template="python", timeout="10m", api_url=c.apis[0].url,
                       api_key=c.key)
    try:
        data = os.urandom(3 << 20)
        s.files.write("/work/big.bin", data)
        inside = s.exec("sha256sum /work/big.bin").stdout.split()[0]
        assert inside == hashlib.sha256(data).hexdigest()
        assert s.files.read("/work/big.bin") == data
    finally:
        s.kill()
