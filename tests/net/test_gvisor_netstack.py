"""gVisor's own netstack (``--network=sandbox``) inside a network namespace of ours, with the
current runsc: a sandbox starts there, reaches a server in a fake "internet" namespace
(ours, with no route off this machine), is checkpointed, restored, and reaches it again.
The ground the per-sandbox network builds on.

Topology (all made here, all removed at the end):
    [sandbox netns]  veth-s 10.200.0.2/30  <->  veth-i 10.200.0.1/30  [inet netns]
                                                 198.51.100.1/32 on lo, an HTTP server
Traffic goes only to those two namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuosd.backends.runsc import Runsc, RunscUnavailable, find_runsc
from support.daemon import TEMPLATES

pytestmark = [pytest.mark.net, pytest.mark.e2e]

SERVER = "198.51.100.1"
PORT = 8080


def sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{argv}: rc={r.returncode}: {r.stderr[-800:]}")
    return r


@pytest.fixture
def runsc() -> Runsc:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, runsc)")
    try:
        r = find_runsc()
    except RunscUnavailable as e:
        pytest.fail(f"no runsc: {e}")
    if r.platform == "ptrace" and "systrap" not in r.platforms:
        pytest.skip("Debian's 2022 runsc refuses --network=sandbox here (see DESIGN.md)")
    return r


def address(sbx_ns: str, tag: str) -> None:
    sh("ip", "-n", sbx_ns, "addr", "add", "10.200.0.2/30", "dev", f"vs{tag}")
    sh("ip", "-n", sbx_ns, "route", "add", "default", "via", "10.200.0.1")


@pytest.fixture
def topology() -> Iterator[tuple[str, str]]:
    tag = secrets.token_hex(3)
    sbx_ns, inet_ns = f"cpuos-t-s-{tag}", f"cpuos-t-i-{tag}"
    made: list[str] = []
    server: subprocess.Popen[bytes] | None = None
    try:
        for ns in (sbx_ns, inet_ns):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", f"vs{tag}", "netns", sbx_ns, "type", "veth",
           "peer", "name", f"vi{tag}", "netns", inet_ns)
        sh("ip", "-n", sbx_ns, "link", "set", f"vs{tag}", "up")
        sh("ip", "-n", sbx_ns, "link", "set", "lo", "up")
        address(sbx_ns, tag)
        sh("ip", "-n", inet_ns, "addr", "add", "10.200.0.1/30", "dev", f"vi{tag}")
        sh("ip", "-n", inet_ns, "link", "set", f"vi{tag}", "up")
        sh("ip", "-n", inet_ns, "link", "set", "lo", "up")
        sh("ip", "-n", inet_ns, "addr", "add", f"{SERVER}/32", "dev", "lo")
        # the inet namespace has no route anywhere but the /30: nothing leaves the machine
        server = subprocess.Popen(
            ["ip", "netns", "exec", inet_ns, sys.executable, "-c",
             "import http.server as h\n"
             "class H(h.BaseHTTPRequestHandler):\n"
             "    def do_GET(self):\n"
             "        self.send_response(200); self.end_headers(); self.wfile.write(b'hello')\n"
             "    def log_message(self, *a): pass\n"
             f"h.HTTPServer(('{SERVER}', {PORT}), H).serve_forever()\n"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        yield sbx_ns, tag
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)


GET = ("import urllib.request, sys\n"
       f"print(urllib.request.urlopen('http://{SERVER}:{PORT}/', timeout=5).read().decode())\n")


def test_netstack_starts_checkpoints_and_restores_in_a_netns(
        runsc: Runsc, topology: tuple[str, str], tmp_path: Path) -> None:
    info = json.loads((TEMPLATES / "python.json").read_text())
    sbx_ns, tag = topology
    root, image, bundle = tmp_path / "root", tmp_path / "image", tmp_path / "bundle"
    for d in (root, bundle):
        d.mkdir()
    spec = {
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 1000, "gid": 1000}, "cwd": "/",
                    "args": ["/usr/bin/python3", "-c", "import time\nwhile True: time.sleep(1)"],
                    "env": ["PATH=/usr/bin:/bin"]},
        "root": {"path": info["rootfs"], "readonly": True},
        "hostname": "netstack",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                                 {"type": "mount"},
                                 {"type": "network", "path": f"/var/run/netns/{sbx_ns}"}]},
    }
    (bundle / "config.json").write_text(json.dumps(spec))
    g = [runsc.path, "--root", str(root), f"--platform={runsc.platform}", "--network=sandbox",
         "--gofer-network-namespace=new"]
    cid = "netstack-" + secrets.token_hex(3)
    log = tmp_path / "runsc.log"

    def get() -> str:
        r = sh(*g, "exec", cid, "/usr/bin/python3", "-c", GET, check=False)
        assert r.returncode == 0, f"{r.stderr[-500:]} / {log.read_text()[-500:]}"
        return r.stdout.strip()

    try:
        with open(log, "ab") as f:
            rc = subprocess.run([*g, "run", "--detach", "--bundle", str(bundle), cid],
                                stdout=f, stderr=f, stdin=subprocess.DEVNULL, timeout=60,
                                start_new_session=True).returncode
        assert rc == 0, log.read_text()[-800:]
        assert get() == "hello"
        # the sandbox sees the namespace's interface through its own stack
        r = sh(*g, "exec", cid, "cat", "/proc/net/dev")
        assert "vs" in r.stdout
        image.mkdir()
        sh(*g, "checkpoint", f"--image-path={image}", cid, timeout=120)
        sh(*g, "delete", "--force", cid, check=False)
        # runsc moves the interface's addresses and routes into its netstack and removes
        # them from the namespace ("No usable IP addresses found ... skipping" on a restore
        # without them): whoever restores gives them back first (the daemon's network
        # module will: each clone gets its own address)
        assert "10.200.0.2" not in sh("ip", "-n", sbx_ns, "addr").stdout
        address(sbx_ns, tag)
        with open(log, "ab") as f:
            rc = subprocess.run([*g, "restore", "--detach", f"--image-path={image}",
                                 "--bundle", str(bundle), cid], stdout=f, stderr=f,
                                stdin=subprocess.DEVNULL, timeout=120,
                                start_new_session=True).returncode
        assert rc == 0, log.read_text()[-800:]
        assert get() == "hello"
    finally:
        sh(*g, "delete", "--force", cid, check=False)
        left = sh(*g, "list", "-format=json", check=False).stdout
        assert not json.loads(left or "null"), left
