"""A terminal through the real daemon (its WebSocket) and the real agent (a pty of its
own): size, input, resize, exit status."""

from __future__ import annotations

import threading

import pytest

from cpuos import Sandbox
from support.daemon import wait_until

pytestmark = pytest.mark.component


def test_pty_size_input_resize_exit(sbx: Sandbox) -> None:
    buf = bytearray()
    lock = threading.Lock()

    def on_data(data: bytes) -> None:
        with lock:
            buf.extend(data)

    def screen() -> bytes:
        with lock:
            return bytes(buf)

    t = sbx.pty.create(cols=120, rows=40, cmd=["/bin/sh"], on_data=on_data)
    t.send_input("stty size; tty\n")
    wait_until(lambda: b"40 120" in screen() and b"/dev/pts/" in screen(), "its size", 10)
    t.resize(100, 30)
    t.send_input("stty size; exit 7\n")
    wait_until(lambda: b"30 100" in screen(), "the new size", 10)
    res = t.wait()
    assert res.exit_code == 7, res
