"""The daemon's side of the channel (cpuosd.agentconn, requests built from
cpuos_agent.messages) against the real agent as a local process (not root, no sandbox):
every request kind the host sends, and its answers. The wire format is that of protocol 3
whatever the code on either side: to check the daemon against another agent (one in a
paused sandbox or a template snapshot, made by an older cpuos), run ``_every_request``
with that agent's source directory (issue 26 ran it against main f06d699's agent)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import cast

import cpuos_agent
from cpuos_agent import messages as M
from cpuos_agent import protocol as P
from cpuos_agent.protocol import Kind
from cpuosd.agentconn import (AgentChannel, AgentError, Stream, open_stream,
                              raise_for_agent_error)

SRC = str(Path(cpuos_agent.__file__).resolve().parent.parent)


async def _drain(st: Stream, kind: str = Kind.DATA) -> bytes:
    """A stream's ``kind`` frames' bytes, up to its EOF."""
    got = b""
    while True:
        h, payload = await st.get(10)
        if h["t"] != kind:
            assert h["t"] == Kind.EOF, h
            return got
        got += payload


async def _every_request(agent_src: str, d: Path) -> None:
    sock = d / "agent.sock"
    chan = AgentChannel(sock)
    await chan.listen()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": agent_src, "CPUOS_AGENT_SOCKET": str(sock),
           "PYTHONDONTWRITEBYTECODE": "1"}
    with open(d / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cpuos_agent"], env=env, stdout=log,
                                stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=d)
    path_env = {"PATH": "/usr/bin:/bin"}
    try:
        await chan.wait_connected(20)
        assert chan.hello is not None and chan.hello["version"] == P.PROTOCOL_VERSION
        assert (await chan.call({"t": Kind.PING}))["t"] == Kind.PONG
        assert (await chan.call(M.Identity(t=Kind.IDENTITY)))["t"] == Kind.IDENTITY_OK

        # a command with stdin (credit-controlled)
        st = chan.open()
        cat: M.Exec = {**M.command("cat"), "env": path_env, "cwd": str(d), "timeout": 30,
                       "stdin": True}
        await st.send(cat)
        h, _ = await st.get(10)
        assert h["t"] == Kind.STARTED, h
        await st.send_stdin(b"hello\n", close=True)
        out = b""
        while (fr := await st.get(10))[0]["t"] == Kind.OUT:
            out += fr[1]
        st.close()
        assert fr[0]["t"] == Kind.EXIT and fr[0]["exit_code"] == 0 and out == b"hello\n", fr

        # files: write, read, stat, list, mkdir, an error, tar, untar, remove
        f = str(d / "w" / "f.txt")
        st = chan.open()
        await st.send(M.Write(t=Kind.WRITE, path=f))
        await st.send(M.Data(t=Kind.DATA), b"abc" * 1000)
        await st.send(M.Eof(t=Kind.EOF))
        h, _ = await st.get(10)
        st.close()
        raise_for_agent_error(h)
        assert h["stat"]["size"] == 3000, h
        st, h = await open_stream(chan, M.Read(t=Kind.READ, path=f), 10, "open")
        assert await _drain(st) == b"abc" * 1000
        st.close()
        assert (await chan.call(M.PathRequest(t=Kind.STAT, path=f)))["stat"]["type"] == "file"
        h, payload = await chan.call_full(M.PathRequest(t=Kind.LIST, path=str(d / "w")))
        assert [e["name"] for e in json.loads(payload)] == ["f.txt"], payload
        h = await chan.call(M.PathRequest(t=Kind.MKDIR, path=str(d / "m")))
        assert h["stat"]["type"] == "dir"
        try:
            await chan.call(M.PathRequest(t=Kind.STAT, path=str(d / "nope")))
            raise AssertionError("no error")
        except AgentError as e:
            assert e.code == "not_found", e.code
        st, h = await open_stream(chan, M.PathRequest(t=Kind.TAR, path=str(d / "w")), 10, "tar")
        tb = await _drain(st)
        st.close()
        assert "f.txt" in [n.removeprefix("./") for n in
                           tarfile.open(fileobj=io.BytesIO(tb)).getnames()]
        (d / "up.tar").write_bytes(tb)
        await chan.call(M.Untar(t=Kind.UNTAR, archive=str(d / "up.tar"), path=str(d / "x")))
        assert (d / "x" / "f.txt").read_bytes() == b"abc" * 1000
        await chan.call(M.Remove(t=Kind.REMOVE, path=str(d / "x")))
        assert not (d / "x").exists()

        # a background command: list, info, stdin, attach, signal, wait, resize (no pty)
        st = chan.open()
        bg: M.Exec = {**M.command("read x; echo got $x; sleep 30"), "env": path_env,
                      "cwd": str(d), "timeout": None, "stdin": True, "background": True,
                      "buffer": 65536}
        await st.send(bg)
        h, _ = await st.get(10)
        st.close()
        assert h["t"] == Kind.STARTED and h.get("background"), h
        pid = h["pid"]
        h, payload = await chan.call_full(M.BgList(t=Kind.BG_LIST))
        assert pid in [i["pid"] for i in json.loads(payload)]
        assert (await chan.call(M.BgInfo(t=Kind.BG_INFO, pid=pid)))["info"]["running"] is True
        st = chan.open()
        await st.send(M.BgStdin(t=Kind.BG_STDIN, pid=pid))
        raise_for_agent_error((await st.get(10))[0])
        await st.send_stdin(b"42\n", ack=True)
        raise_for_agent_error((await st.get(10))[0])
        st.close()
        st, h = await open_stream(chan, M.BgAttach(t=Kind.BG_ATTACH, pid=pid, offset=0,
                                                   follow=True), 10, "attach")
        h, payload = await st.get(10)
        assert h["t"] == Kind.OUT and payload == b"got 42\n", (h, payload)
        await chan.call(M.BgSignal(t=Kind.BG_SIGNAL, pid=pid, signal=15))
        assert (await st.get(10))[0]["t"] == Kind.EXIT
        st.close()
        assert (await chan.call(M.BgWait(t=Kind.BG_WAIT, pid=pid, timeout=5)))["ended"] is True
        try:
            await chan.call(M.BgResize(t=Kind.BG_RESIZE, pid=pid, cols=80, rows=24))
            raise AssertionError("no error")
        except AgentError as e:
            assert e.code == "invalid_argument", e.code

        # a dial to no socket; the memory watch (unanswered); an unknown kind
        try:
            await open_stream(chan, M.Dial(t=Kind.DIAL, path=str(d / "none.sock")), 10, "dial")
            raise AssertionError("no error")
        except AgentError as e:
            assert e.code == "not_found", e.code
        await chan.send(M.Memory(t=Kind.MEMORY, id=0, watched=True, high=False))
        try:
            await chan.call(cast(M.Request, {"t": "nope"}))
            raise AssertionError("no error")
        except AgentError as e:
            assert e.code == "invalid_argument" and "unknown" in e.message, e

        # quiesce: the agent hangs up, then comes back
        assert (await chan.call(M.Quiesce(t=Kind.QUIESCE)))["t"] == Kind.OK
        await chan.wait_disconnected(5)
        await chan.wait_connected(20)
        assert (await chan.call({"t": Kind.PING}))["t"] == Kind.PONG

        # a hang-up is seen by whoever waits for it even when the agent is back at once
        waiter = asyncio.ensure_future(chan.wait_disconnected(5))
        await asyncio.sleep(0)  # (one turn of the loop: the waiter starts waiting)
        chan.disconnect()
        await chan.wait_connected(20)
        await waiter
        assert (await chan.call({"t": Kind.PING}))["t"] == Kind.PONG
    finally:
        proc.kill()
        proc.wait()
        await chan.close()


def test_every_request_kind_round_trips(tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(_every_request(SRC, tmp_path), 120))
