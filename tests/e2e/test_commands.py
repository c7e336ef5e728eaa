"""Background commands: they outlive the client that started them and a daemon SIGKILL and
restart; another client lists them, reattaches, reads their output from offset 0, signals
them and gets their exit status; their stdin and their output ring."""

from __future__ import annotations

import signal

import pytest

from cpuos import CommandHandle, InvalidArgument, NotFound, Sandbox
from support.daemon import Daemon, wait_until

pytestmark = pytest.mark.e2e

FETCH = ("python3 -c \"import urllib.request as u; "
         "print(u.urlopen('http://127.0.0.1:{port}/?{path}').status)\"")


def _server(sbx: Sandbox, port: int) -> CommandHandle:
    h = sbx.exec(f"python3 -u -m http.server {port} --bind 127.0.0.1", background=True)
    # serving once a request is answered
    wait_until(lambda: sbx.exec(FETCH.format(port=port, path="")).stdout == "200\n",
               f"http.server on {port}", timeout=60)
    return h


def _stop_and_check(d: Daemon, sandbox_id: str, pid: int, paths: list[str]) -> None:
    """From a client of its own: the command is listed, its output from offset 0 has every
    request, SIGTERM ends it and its status says so."""
    other = Sandbox.connect(sandbox_id, **d.sdk_kwargs())
    try:
        listed = {c.pid: c for c in other.commands.list()}
        assert pid in listed and listed[pid].running, listed
        assert "http.server" in listed[pid].cmd
        h = other.commands.connect(pid)
        out, err = h.output()  # offset 0: all of it so far, without waiting
        for p in paths:
            assert f"GET /?{p} HTTP/1.1" in err.decode(), err[-2000:]
        assert h.offset == len(out) + len(err)
        info = h.kill("TERM")
        seen: list[str] = []
        h2 = other.commands.connect(pid, on_stderr=seen.append)
        res = h2.wait()
        assert (res.exit_code, res.signal) == (128 + signal.SIGTERM, signal.SIGTERM), res
        assert all(f"GET /?{p} HTTP/1.1" in "".join(seen) for p in paths)
        ended = other.commands.connect(pid).info()
        assert not ended.running and ended.exit_code == 143, (info, ended)
    finally:
        other.close()


def test_background_outlives_client_and_daemon_restart(fresh_daemon: Daemon) -> None:
    d = fresh_daemon
    first = Sandbox.create(template="python", timeout="10m", **d.sdk_kwargs())
    sid = first.id
    try:
        h = _server(first, 8000)
        paths = [f"p{i}" for i in range(50)]
        for p in paths:  # 50 foreground execs while it serves
            r = first.exec(FETCH.format(port=8000, path=p))
            assert r.stdout == "200\n", r
        first.close()  # the client that started it is gone
        _stop_and_check(d, sid, h.pid, paths)

        # again across a daemon SIGKILL and restart
        second = Sandbox.connect(sid, **d.sdk_kwargs())
        h = _server(second, 8001)
        assert second.exec(FETCH.format(port=8001, path="before")).stdout == "200\n"
        second.close()
        d.kill9()
        d.start()
        third = Sandbox.connect(sid, **d.sdk_kwargs())
        wait_until(lambda: third.exec(FETCH.format(port=8001, path="after")).ok,
                   "the server answers after the restart")
        third.close()
        _stop_and_check(d, sid, h.pid, ["before", "after"])
    finally:
        Sandbox.connect(sid, **d.sdk_kwargs()).kill()


def test_stdin_ring_and_errors(sbx: Sandbox) -> None:
    # stdin: sent in pieces, then closed: cat ends
    h = sbx.exec("cat", background=True)
    assert h.send_stdin("hello ") == 6
    parts: list[bytes | str] = [b"wor", "ld\n"]
    assert h.send_stdin(iter(parts)) == 6
    h.close_stdin()
    res = h.wait()
    assert (res.exit_code, res.stdout) == (0, "hello world\n"), res
    with pytest.raises(InvalidArgument):
        h.send_stdin("too late")

    # a ring of 4 KiB keeps the tail; a read from 0 after the end starts at the oldest
    # byte held (a reader that follows as it runs gets all of it)
    h = sbx.exec("for i in $(seq 1000); do printf 'line %04d\\n' $i; done", background=True,
                 buffer=4096)
    wait_until(lambda: not h.info().running, "the writer ended")
    res = h.wait()
    assert res.exit_code == 0
    info = h.info()
    assert info.out_end == 10 * 1000 and info.out_start == info.out_end - 4096, info
    assert res.stdout.endswith("line 1000\n") and len(res.stdout_bytes) == 4096
    assert h.offset == info.out_end
    # from an offset inside the ring
    tail = sbx.commands.connect(h.pid, offset=info.out_end - 10).wait()
    assert tail.stdout == "line 1000\n"

    # the whole tree goes with KILL; a timeout of its own
    h = sbx.exec("sleep 300 & sleep 301; wait", background=True)
    wait_until(lambda: "sleep 300" in sbx.exec("ps -eo args").stdout, "children started")
    h.kill()
    assert h.wait().signal == signal.SIGKILL
    wait_until(lambda: "sleep 30" not in sbx.exec("ps -eo args").stdout, "tree gone")
    t = sbx.exec("sleep 60", background=True, timeout=1).wait()
    assert t.timed_out, t

    with pytest.raises(NotFound):
        sbx.commands.connect(999999)
    with pytest.raises(InvalidArgument):
        sbx.commands.kill(h.pid, "NOSUCHSIG")


def test_background_survives_pause_resume(daemon: Daemon, sbx: Sandbox) -> None:
    """A checkpoint carries the agent, its background commands and their rings: after a
    resume the command still runs and its output is there from offset 0."""
    h = sbx.exec("echo before; read line; echo got=$line", background=True)
    wait_until(lambda: h.output()[0] != b"", "its first line")
    sbx.pause()
    back = Sandbox.resume(sbx.id, **daemon.sdk_kwargs())
    h2 = back.commands.connect(h.pid)
    assert h2.info().running
    h2.send_stdin("after-resume\n")
    res = h2.wait()
    back.close()
    assert (res.exit_code, res.stdout) == (0, "before\ngot=after-resume\n"), res
