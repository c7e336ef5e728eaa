"""Issue 11, finding 3: the key is checked before a byte of the body is read, and a JSON
body has a size limit — a client without a key cannot make the daemon hold 300 MiB."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.daemon import Daemon

pytestmark = pytest.mark.e2e

MiB = 1 << 20
BIG = 300 * MiB


def rss_peak(d: Daemon) -> int:
    """The daemon's peak resident memory so far (VmHWM), bytes."""
    assert d.proc is not None
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def send_big(d: Daemon, path: str, headers: dict[str, str], chunked: bool) -> bytes:
    """POST ``BIG`` bytes of JSON-ish body, as fast as the daemon takes them; returns what
    the daemon answered (it may answer and close before the body is sent)."""
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{d.port}",
            "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {BIG}")
    s = socket.create_connection(("127.0.0.1", d.port), timeout=30)
    try:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        chunk = b'{"template": "' + b"a" * (MiB - 20) + b'"}'
        try:
            for _ in range(BIG // len(chunk)):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and closed: what we want
        out = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                out += b
        except (ConnectionResetError, TimeoutError):
            pass
        return out
    finally:
        s.close()


@pytest.fixture
def peak(daemon: Daemon) -> Iterator[int]:
    yield rss_peak(daemon)


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_no_key_big_body_is_refused_unread(daemon: Daemon, peak: int, chunked: bool) -> None:
    out = send_big(daemon, "/sandboxes", {}, chunked)
    assert out == b"" or out.startswith(b"HTTP/1.1 401"), out[:200]
    out = send_big(daemon, "/sandboxes/sbx-x/exec", {"Authorization": "Bearer wrong"}, chunked)
    assert out == b"" or out.startswith(b"HTTP/1.1 401"), out[:200]
    grown = rss_peak(daemon) - peak
    assert grown < 64 * MiB, f"the daemon's peak memory grew by {grown / MiB:.0f} MiB"


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_keyed_oversized_json_is_413(daemon: Daemon, peak: int, chunked: bool) -> None:
    out = send_big(daemon, "/sandboxes", {"Authorization": f"Bearer {daemon.key}"}, chunked)
    assert out == b"" or out.startswith(b"HTTP/1.1 413"), out[:200]
    if out:
        body = json.loads(out.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "too_large"
    grown = rss_peak(daemon) - peak
    assert grown < 64 * MiB, f"the daemon's peak memory grew by {grown / MiB:.0f} MiB"


def test_answers_are_json_errors(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/sandboxes", json={"template": "python"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = httpx.get(daemon.url + "/sandboxes", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("invalid API key")
    r = httpx.post(daemon.url + "/sandboxes", content=b"x" * (9 * MiB),
                   headers={"Authorization": f"Bearer {daemon.key}",
                            "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert httpx.get(daemon.url + "/health").status_code == 200  # open
