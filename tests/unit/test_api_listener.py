"""The API listener's bounds (cpuosd.api.listener) on a real uvicorn server on loopback.

A connection that has sent nothing is kept like an idle kept-alive one (a browser opens
connections ahead of its requests and may send one on it ~10 s later: a deadline from the
connect cut such a request, which the browser does not resend); it makes way for a new
client at the cap; a request head still has the head deadline from its first byte."""

from __future__ import annotations

import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import uvicorn

from cpuosd.api.listener import guarded_http
from cpuosd.config import ApiConfig
from support.daemon import closed_by_peer, wait_until

HEAD_TIMEOUT = 0.3
KEEPALIVE = 2.0
CAP = 4


async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
              send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server() -> Iterator[int]:
    cfg = ApiConfig(max_connections=CAP, head_timeout=HEAD_TIMEOUT, keepalive=KEEPALIVE)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", log_config=None, access_log=False,
                            http=guarded_http(cfg), timeout_keep_alive=int(KEEPALIVE),
                            lifespan="off")
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    wait_until(lambda: srv.started or not t.is_alive(), "uvicorn started", 30)
    assert srv.started, "uvicorn did not start"
    yield port
    srv.should_exit = True
    t.join(30)
    sock.close()


def get(s: socket.socket) -> bytes:
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while not got.endswith(b"ok"):
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return got


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_used_after_the_head_timeout_is_answered(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=30) as s, \
            socket.create_connection(("127.0.0.1", server), timeout=30) as begun:
        # silent for longer than a head may take: a head begun at the same time is cut
        begun.sendall(b"GET / HTTP/1.1\r\n")
        assert closed(begun)
        assert get(s).startswith(b"HTTP/1.1 200")


def test_a_head_begun_must_end_within_the_head_timeout(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=30) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and no end
        assert closed(s)


def test_a_silent_connection_is_closed_after_the_keepalive(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=30) as s:
        assert closed(s)  # (and not at the head deadline: the first test)


def test_silent_connections_make_way_for_a_client_at_the_cap(server: int) -> None:
    silent = [socket.create_connection(("127.0.0.1", server), timeout=30)
              for _ in range(CAP)]
    try:
        with socket.create_connection(("127.0.0.1", server), timeout=30) as s:
            assert get(s).startswith(b"HTTP/1.1 200")
        # one of them was closed to make way (before the new one was served)
        assert sum(map(closed_by_peer, silent)) == 1
    finally:
        for c in silent:
            c.close()

