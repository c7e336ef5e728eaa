"""``cpuos mcp`` end to end: an MCP client from the official SDK starts the server over
stdio, lists the tools and runs code that draws a figure; the server's sandbox is killed
when the client goes."""

from __future__ import annotations

import base64
import json
import sys

import anyio
import pytest

from cpuos import Sandbox
from support.daemon import Daemon

pytestmark = pytest.mark.e2e

mcp_client = pytest.importorskip("mcp.client.stdio", reason="the mcp package (cpuos[mcp])")
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402


def test_mcp_over_stdio_runs_code_with_an_image(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "cpuos.cli.main", "mcp", "--timeout", "5m"],
        env={"CPUOS_API_URL": str(kw["api_url"]), "CPUOS_API_KEY": str(kw["api_key"])})
    got: dict[str, object] = {}

    async def session() -> None:
        with anyio.fail_after(240):
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write) as s:
                await s.initialize()
                listed = await s.list_tools()
                got["tools"] = {t.name for t in listed.tools}
                made = await s.call_tool("create_sandbox", {})
                got["created"] = json.loads(made.content[0].text)  # type: ignore[union-attr]
                r = await s.call_tool("run_code", {
                    "code": "import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\n"
                            "print('drawn')\n6 * 7"})
                got["run"] = r
                got["exec"] = await s.call_tool("exec", {"command": "echo hi; exit 3"})
                got["bad"] = await s.call_tool("run_code", {"cod": "1"})

    anyio.run(session)
    assert {"create_sandbox", "run_code", "exec", "write_file", "read_file", "list_files",
            "expose_port", "pause", "resume", "kill"} <= got["tools"]  # type: ignore[operator]
    r = got["run"]
    assert not r.is_error  # type: ignore[attr-defined]
    texts = [c for c in r.content if c.type == "text"]  # type: ignore[attr-defined]
    images = [c for c in r.content if c.type == "image"]  # type: ignore[attr-defined]
    data = json.loads(texts[0].text)
    assert data["result"] == "42" and data["stdout"] == "drawn\n" and data["images"] == 1
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data)[:8] == b"\x89PNG\r\n\x1a\n"
    x = got["exec"]
    assert x.is_error  # type: ignore[attr-defined]
    assert json.loads(x.content[0].text) == {  # type: ignore[attr-defined]
        "exit_code": 3, "stdout": "hi\n", "stderr": "", "images": 0}
    bad = got["bad"]
    assert bad.is_error and "missing argument 'code'" in bad.content[0].text  # type: ignore[attr-defined]
    # the server killed its sandbox when the client went
    sid = got["created"]["sandbox_id"]  # type: ignore[index]
    assert all(s.id != sid for s in Sandbox.list(**kw))


def test_mcp_over_streamable_http_needs_its_token(daemon: Daemon) -> None:
    """Over HTTP the server acts with its API key (the admin's here) for whoever reaches it:
    without the token it printed at start (or with a wrong one) the real MCP client gets 401
    and nothing runs; with it, the tools work."""
    import socket
    import subprocess

    import httpx
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    from support.daemon import wait_until

    kw = daemon.sdk_kwargs()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"CPUOS_API_URL": str(kw["api_url"]), "CPUOS_API_KEY": str(kw["api_key"]),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "cpuos.cli.main", "mcp", "--http",
                             "--port", str(port), "--timeout", "5m"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/mcp"
    got: dict[str, object] = {}
    before = {x.id for x in Sandbox.list(**kw)}

    def listening() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
        with socket.socket() as c:
            return c.connect_ex(("127.0.0.1", port)) == 0

    async def session(token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        with anyio.fail_after(240):
            async with create_mcp_http_client(headers=headers) as client, \
                    streamable_http_client(url, http_client=client) as (read, write), \
                    ClientSession(read, write) as s:
                await s.initialize()
                got["tools"] = {t.name for t in (await s.list_tools()).tools}
                r = await s.call_tool("exec", {"command": "echo over-http"})
                got["exec"] = json.loads(r.content[0].text)  # type: ignore[union-attr]

    try:
        assert proc.stderr is not None
        first = proc.stderr.readline().decode()  # printed before it listens
        assert f"http://127.0.0.1:{port}/mcp" in first, first
        token = first.split("Bearer ", 1)[1].strip().rstrip("'")
        assert token.startswith("cpm_") and len(token) > 40
        wait_until(listening, "the MCP server listens", timeout=60)
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"}}}
        hdrs = {"Accept": "application/json, text/event-stream"}
        for auth in (None, "Bearer nope", f"Bearer {token}x", f"Basic {token}", token):
            h = {**hdrs, **({"Authorization": auth} if auth else {})}
            r = httpx.post(url, json=init, headers=h, timeout=30)
            assert r.status_code == 401, (auth, r.status_code, r.text)
            assert r.json()["error"]["code"] == "unauthorized"
        for bad in (None, "wrong"):  # the real client: its initialize fails
            with pytest.raises(BaseException) as e:
                anyio.run(session, bad)
            assert "error response" in repr(e.value), repr(e.value)
        assert "tools" not in got
        anyio.run(session, token)
    finally:
        proc.terminate()
        proc.wait(60)
    assert "run_code" in got["tools"]  # type: ignore[operator]
    assert got["exec"] == {"exit_code": 0, "stdout": "over-http\n", "stderr": "", "images": 0}
    # the server made a sandbox on first use, and killed it when it was stopped
    assert {x.id for x in Sandbox.list(**kw)} - before == set()


def test_mcp_http_refuses_a_public_address_without_a_token() -> None:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "cpuos.cli.main", "mcp", "--http", "--host",
                        "0.0.0.0", "--port", "1"], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "CPUOS_API_KEY": "k"})
    assert r.returncode == 2
    assert "needs --token" in r.stderr and "\n" not in r.stderr.strip()
