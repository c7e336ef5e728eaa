"""Only the agent can use the agent channel: code inside a sandbox (the commands' uid, the
agent's too) cannot read the agent's key, cannot take over the channel, and never sees a
request meant for the agent, also across a pause and resume."""

from __future__ import annotations

import secrets

import pytest

from cpuos import Sandbox
from support.daemon import Daemon

pytestmark = pytest.mark.e2e

# Knocks on every unix socket it can find, as fast as it can, until /tmp/impostor.stop
# appears (at most 60 s): connects, sends a well-formed hello (current protocol version,
# a made-up key), then listens for anything the host sends and logs every frame it gets.
IMPOSTOR = r"""
import json, os, socket, struct, sys, threading, time
from cpuos_agent import protocol as P
stats = {"connects": 0, "frames": []}
def paths():
    out = set()
    for root in ("/run", "/tmp", "/opt", "/home", "/work"):
        for d, _, files in os.walk(root):
            for f in files:
                out.add(os.path.join(d, f))
    try:
        for line in open("/proc/net/unix").read().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith("/"):
                out.add(parts[7])
    except OSError:
        pass
    return [p for p in out if p.endswith(".sock") or "cpuos" in p]
def knock(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return
    stats["connects"] += 1
    try:
        s.sendall(P.encode({"t": "hello", "version": P.PROTOCOL_VERSION, "pid": 1,
                            "uid": os.getuid(), "transport": "socket", "key": "0" * 64}))
        while True:
            pre = s.recv(8, socket.MSG_WAITALL)
            if len(pre) < 8:
                return
            hl, pl = struct.unpack("!II", pre)
            body = s.recv(hl + pl, socket.MSG_WAITALL)
            stats["frames"].append(json.loads(body[:hl]))
    except (OSError, ValueError):
        pass
    finally:
        s.close()
open("/tmp/impostor.ready", "w").close()
end = time.time() + 60
while time.time() < end and not os.path.exists("/tmp/impostor.stop"):
    for p in paths():
        threading.Thread(target=knock, args=(p,), daemon=True).start()
    time.sleep(0.01)
    with open("/tmp/impostor.json.tmp", "w") as f:
        json.dump(stats, f)
    os.replace("/tmp/impostor.json.tmp", "/tmp/impostor.json")
"""


def test_agent_key_and_memory_are_out_of_reach(sbx: Sandbox) -> None:
    r = sbx.exec("ls -a /run/cpuos; cat /run/cpuos/agent.key; cat /proc/1/environ; "
                 "head -c 1 /proc/1/mem; echo x >> /proc/1/fd/2; echo done")
    assert "agent.key" not in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "done"
    for path in ("/run/cpuos/agent.key", "/proc/1/environ", "/proc/1/mem", "/proc/1/fd/2"):
        assert path in r.stderr, (path, r.stderr)  # each one refused
    assert "PYTHONPATH" not in r.stdout  # (the agent's environment)


def _wait_file(sbx: Sandbox, path: str) -> None:
    for _ in range(600):  # bounded: 600 round trips
        if sbx.files.exists(path):
            return
    raise AssertionError(f"{path} never appeared")


def test_impostor_never_gets_the_channel(daemon: Daemon, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/impostor.py", IMPOSTOR)
    r = sbx.exec("cd /tmp && PYTHONPATH=/opt/cpuos nohup python3 impostor.py "
                 ">/tmp/impostor.log 2>&1 &")
    assert r.exit_code == 0
    _wait_file(sbx, "/tmp/impostor.ready")
    _wait_file(sbx, "/tmp/impostor.json")

    def check_execs(sbx: Sandbox, n: int) -> None:
        for _ in range(n):
            nonce = secrets.token_hex(8)
            r = sbx.exec(f"echo {nonce}")
            assert (r.exit_code, r.stdout) == (0, nonce + "\n")

    check_execs(sbx, 20)
    sbx.pause()  # the impostor races the agent to the socket as the sandbox comes back
    resumed = Sandbox.resume(sbx.id, **daemon.sdk_kwargs())
    try:
        check_execs(resumed, 10)
        resumed.files.write("/tmp/impostor.stop", b"")
        stats = __import__("json").loads(resumed.files.read_text("/tmp/impostor.json"))
    finally:
        resumed.close()
    assert stats["connects"] > 0, "the impostor never reached the agent socket"
    assert stats["frames"] == [], stats["frames"][:5]
    # and the daemon said so, without flooding its log
    log = daemon.log.read_text()
    assert "refused a connection" in log
    assert log.count("refused a connection") < 50
