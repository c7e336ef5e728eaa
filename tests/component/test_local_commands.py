"""Background commands through the real daemon and agent: stdin, output from any offset,
another client reattaching, signals, exit status."""

from __future__ import annotations

import signal

import pytest

from cpuos import Sandbox
from support.daemon import wait_until
from support.local import LocalDaemon

pytestmark = pytest.mark.component


def test_background_stdin_and_exit(sbx: Sandbox) -> None:
    h = sbx.exec("read x; echo got $x; cat", background=True)
    h.send_stdin("hi\n")
    h.send_stdin(b"rest")
    h.close_stdin()
    res = h.wait()
    assert res.exit_code == 0 and res.stdout == "got hi\nrest", res


def test_reattach_list_output_and_signal(sbx: Sandbox, local: LocalDaemon) -> None:
    h = sbx.exec("for i in $(seq 5); do echo line$i; done; exec sleep 60", background=True)
    pid = h.pid
    other = Sandbox.connect(sbx.id, **local.sdk_kwargs())
    try:
        listed = {c.pid: c for c in other.commands.list()}
        assert pid in listed and listed[pid].running, listed
        wait_until(lambda: other.commands.connect(pid).info().out_end >= 30, "its output", 10)
        again = other.commands.connect(pid)
        out, _ = again.output()  # from offset 0: all of it so far
        assert out == b"".join(b"line%d\n" % i for i in range(1, 6)), out
        assert again.offset == len(out)
        again.kill("TERM")
        res = other.commands.connect(pid).wait()
        assert (res.exit_code, res.signal) == (128 + signal.SIGTERM, signal.SIGTERM), res
        assert not other.commands.connect(pid).info().running
    finally:
        other.close()
