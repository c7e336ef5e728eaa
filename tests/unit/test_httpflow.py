"""The egress proxy's HTTP follower (cpuosd.network.httpflow), issue 25 finding 4: every
request on a connection checked against the approved name, 101 the only way to raw bytes,
compressed answers on secret-bearing connections decoded before they are masked. Driven
here through in-memory streams (the same attacks run from inside sandboxes against the
fake internet in tests/net/test_egress.py)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Callable, Coroutine
from typing import Any

import h11
import pytest

from cpuosd.network import httpflow, relay
from cpuosd.network.httpflow import (Decoder, Outcome, Refused, Rules, check_request,
                                     parse_authority, relay_http)
from cpuosd.network.relay import CHUNK

SECRET = b"sk-live-0123456789abcdef"
PLACEHOLDER = b"cpuos-secret-00112233445566778899aabb"


class Side:
    """One end of a connection as the relay sees it (the relay.Stream protocol): what
    the test feeds is what the relay reads; what the relay writes is collected."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.sent = bytearray()
        self.eof = False
        self.aborted = False
        self.closed = False
        self.wrote = asyncio.Event()

    async def read(self, n: int) -> bytes:
        return await self.inbox.get()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += bytes(data)
        self.wrote.set()

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def write_eof(self) -> None:
        self.eof = True
        self.wrote.set()

    def abort(self) -> None:
        self.aborted = True
        self.wrote.set()

    def close(self) -> None:
        self.closed = True

    def feed(self, data: bytes) -> None:
        self.inbox.put_nowait(data)

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        async with asyncio.timeout(5):
            while not cond():
                self.wrote.clear()
                await self.wrote.wait()


class Run:
    """relay_http between a fake sandbox (``client``) and a fake server (``server``, made
    when the relay asks for it: ``opened`` says whether it did)."""

    def __init__(self, rules: Rules) -> None:
        self.client, self.server = Side(), Side()
        self.opened = 0
        self.rules = rules

    async def open(self) -> relay.Stream:
        self.opened += 1
        return self.server

    def start(self, first: bytes = b"") -> asyncio.Task[Outcome]:
        return asyncio.ensure_future(relay_http(self.client, first, self.open, self.rules))


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def get(path: str, host: str = "allowed.test", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
RULES = Rules("allowed.test", 80)


def test_first_request_for_another_host_is_refused_before_any_connection() -> None:
    async def body() -> None:
        r = Run(RULES)
        task = r.start(get("/", "other.test"))
        o = await task
        assert r.opened == 0
        assert o.denied == "a request for 'other.test' on a connection to 'allowed.test'"
        assert r.client.sent.startswith(b"HTTP/1.1 403 ") and r.client.aborted
    run(body)


def test_pipelined_requests_are_checked_each_after_the_answer_before() -> None:
    async def body() -> None:
        r = Run(RULES)
        task = r.start(get("/one") + get("/two", "cdn-neighbour.test"))
        await r.server.until(lambda: b"/one" in r.server.sent, "the first request")
        assert b"cdn-neighbour" not in r.server.sent  # held until the first answer is over
        r.server.feed(OK)
        o = await task
        assert b"cdn-neighbour" not in r.server.sent
        assert r.client.sent.startswith(OK) and b"403" in r.client.sent[len(OK):]
        assert o.denied is not None and "cdn-neighbour.test" in o.denied
        assert o.requests == 1
    run(body)


def test_upgrade_answered_200_keeps_every_request_checked() -> None:
    async def body() -> None:
        r = Run(RULES)
        task = r.start(get("/ws", extra="Upgrade: websocket\r\nConnection: Upgrade\r\n")
                       + get("/x", "other.test"))
        await r.server.until(lambda: b"/ws" in r.server.sent, "the upgrade request")
        r.server.feed(OK)  # not 101: still HTTP
        o = await task
        assert b"other.test" not in r.server.sent and not o.switched
        assert o.denied is not None and "other.test" in o.denied
    run(body)


def test_only_a_101_switches_to_raw_bytes() -> None:
    async def body() -> None:
        r = Run(RULES)
        task = r.start(get("/ws", extra="Upgrade: websocket\r\nConnection: Upgrade\r\n")
                       + b"GET /raw HTTP/1.1\r\nHost: other.test\r\n\r\n")
        await r.server.until(lambda: b"/ws" in r.server.sent, "the upgrade request")
        r.server.feed(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                      b"Connection: Upgrade\r\n\r\nframe-from-server")
        # after a real 101 the bytes are another protocol's: passed as they are
        await r.server.until(lambda: b"Host: other.test" in r.server.sent, "raw bytes on")
        await r.client.until(lambda: b"frame-from-server" in r.client.sent, "raw bytes back")
        r.client.feed(b"")
        r.server.feed(b"")
        o = await task
        assert o.switched and o.denied is None and o.error is None
    run(body)


def test_connect_inside_names_the_host_and_only_2xx_switches() -> None:
    async def body() -> None:
        r = Run(RULES)
        o = await r.start(b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n")
        assert r.opened == 0 and o.denied is not None and "other.test" in o.denied
    run(body)


def test_client_that_closes_after_its_answer_ends_the_exchange() -> None:
    async def body() -> None:
        r = Run(RULES)
        task = r.start(get("/"))
        await r.server.until(lambda: b"GET /" in r.server.sent, "the request")
        r.server.feed(OK)
        await r.client.until(lambda: bytes(r.client.sent) == OK, "the answer")
        r.client.feed(b"")  # the sandbox is done; the server keeps its connection open
        o = await task
        assert o.denied is None and o.error is None and r.server.closed
    run(body)


def test_first_request_that_never_completes_is_refused(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(httpflow, "FIRST_REQUEST_WAIT", 0.05)

    async def body() -> None:
        r = Run(RULES)
        o = await r.start(b"SSH-2.0-OpenSSH_9.2\r\n")
        assert r.opened == 0 and o.denied is not None and "no whole HTTP request" in o.denied
    run(body)


@pytest.mark.parametrize("pieces", [1, 8])
def test_a_head_over_the_limit_is_one_refusal_however_it_arrives(pieces: int) -> None:
    """A request head over MAX_HEAD is refused with the same reason whether it came whole
    (checked once parsed) or in reads (h11 gives up on the incomplete head first)."""
    async def body() -> None:
        r = Run(RULES)
        big = get("/x", extra="X: " + "a" * 100_000 + "\r\n")
        step = -(-len(big) // pieces)
        task = r.start(big[:step])
        for i in range(step, len(big), step):
            r.client.feed(big[i:i + step])
        o = await task
        assert o.denied == f"a request head over {httpflow.MAX_HEAD // 1024} KiB", o
        assert bytes(r.client.sent).split(b" ", 2)[1] == b"403" and b"/x" not in r.server.sent
    run(body)


def req(head: bytes) -> h11.Request:
    c = h11.Connection(h11.SERVER)
    c.receive_data(head)
    ev = c.next_event()
    assert isinstance(ev, h11.Request), ev
    return ev


@pytest.mark.parametrize(("head", "why"), [
    (b"GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "'other.test'"),
    (b"GET http://allowed.test@other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
     "is not host[:port]"),
    (b"GET / HTTP/1.1\r\nHost: allowed.test@other.test\r\n\r\n", "is not host[:port]"),
    (b"GET / HTTP/1.1\r\nHost: allowed.test:80@other.test\r\n\r\n", "is not host[:port]"),
    (b"GET / HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n", "port 8080"),
    (b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n", "'other.test'"),
    (b"GET / HTTP/1.1\r\nHost: allowed.test.evil\r\n\r\n", "'allowed.test.evil'"),
    (b"GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n", "'::1'"),
    (b"POST / HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", "both Content-Length and Transfer-Encoding"),
    (b"GET / HTTP/2.0\r\nHost: allowed.test\r\n\r\n", "is not HTTP/1.x"),
    (b"GET allowed.test HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "request target"),
    (b"CONNECT other.test:443 HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "'other.test'"),
    (b"GET / HTTP/1.1\r\nHost: allowed.test\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "over 64 KiB"),
])
def test_requests_that_name_another_host_or_read_two_ways_are_refused(head: bytes,
                                                                      why: str) -> None:
    with pytest.raises(Refused) as e:
        check_request(req(head), RULES)
    assert why in str(e.value)


def test_host_goes_on_as_the_approved_name() -> None:
    out = check_request(req(b"GET / HTTP/1.1\r\nHost:   ALLOWED.TEST.  \r\n\r\n"), RULES)
    assert list(out.headers.raw_items()) == [(b"Host", b"allowed.test")]
    out = check_request(req(b"GET / HTTP/1.0\r\n\r\n"), RULES)  # HTTP/1.0: Host added
    assert (b"Host", b"allowed.test") in list(out.headers.raw_items())
    out = check_request(req(b"GET / HTTP/1.1\r\nHost: Allowed.Test:80\r\n\r\n"), RULES)
    assert (b"Host", b"allowed.test:80") in list(out.headers.raw_items())


def test_secrets_only_in_credential_headers_and_answers_asked_uncompressed() -> None:
    rules = Rules("allowed.test", 443, {PLACEHOLDER: SECRET})
    out = check_request(req(b"GET /" + PLACEHOLDER + b" HTTP/1.1\r\nHost: allowed.test\r\n"
                            b"Authorization: Bearer " + PLACEHOLDER + b"\r\n"
                            b"Origin: https://" + PLACEHOLDER + b"\r\n"
                            b"Accept-Encoding: gzip, br\r\nTE: gzip\r\n\r\n"), rules)
    headers = dict((k.lower(), v) for k, v in out.headers.raw_items())
    assert headers[b"authorization"] == b"Bearer " + SECRET
    assert SECRET not in bytes(out.target) and SECRET not in headers[b"origin"]
    assert headers[b"accept-encoding"] == b"identity" and b"te" not in headers
    with pytest.raises(Refused, match="Upgrade other than websocket"):
        check_request(req(b"GET / HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: h2c\r\n"
                          b"Connection: Upgrade\r\n\r\n"), rules)


@pytest.mark.parametrize("authority,want", [
    ("allowed.test", ("allowed.test", None)), ("Allowed.Test.:443", ("allowed.test", 443)),
    ("[2001:db8::1]:80", ("2001:db8::1", 80)), ("a@b", None), ("a:", None), ("a:0", None),
    ("a:65536", None), ("a b", None), ("a:80:81", None), ("", None), ("%61", None),
])
def test_parse_authority(authority: str, want: tuple[str, int | None] | None) -> None:
    assert parse_authority(authority) == want


def answer(body: bytes, coding: str, chunked: bool = False) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: " + coding.encode() + b"\r\n"
    if not chunked:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    out = head + b"Transfer-Encoding: chunked\r\n\r\n"
    for i in range(0, len(body), 5):
        out += b"%x\r\n%s\r\n" % (len(body[i:i + 5]), body[i:i + 5])
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("coding,chunked", [("gzip", False), ("gzip", True),
                                            ("deflate", False), ("x-gzip", True)])
def test_compressed_echo_of_a_secret_is_decoded_then_masked(coding: str, chunked: bool
                                                            ) -> None:
    echo = b'{"authorization": "Bearer ' + SECRET + b'"}'
    packed = zlib.compress(echo) if coding == "deflate" else gzip.compress(echo)

    async def body() -> None:
        r = Run(Rules("allowed.test", 443, {PLACEHOLDER: SECRET}))
        task = r.start(get("/echo", extra="Authorization: Bearer " + PLACEHOLDER.decode()
                           + "\r\nAccept-Encoding: gzip\r\n"))
        await r.server.until(lambda: b"\r\n\r\n" in r.server.sent, "the request")
        assert SECRET in r.server.sent and b"Accept-Encoding: identity" in r.server.sent
        r.server.feed(answer(packed, coding, chunked))
        await r.client.until(lambda: b"0\r\n\r\n" in r.client.sent, "the whole answer")
        r.client.feed(b"")
        o = await task
        got = bytes(r.client.sent)
        assert o.denied is None and SECRET not in got and b"Content-Encoding" not in got
        assert b"Transfer-Encoding: chunked" in got and PLACEHOLDER[:20] in got
    run(body)


def test_a_compression_the_proxy_cannot_decode_is_refused() -> None:
    async def body() -> None:
        r = Run(Rules("allowed.test", 443, {PLACEHOLDER: SECRET}))
        task = r.start(get("/echo"))
        await r.server.until(lambda: b"\r\n\r\n" in r.server.sent, "the request")
        r.server.feed(answer(b"\x1b\x00" + SECRET, "br"))
        o = await task
        assert o.denied is not None and "br answer" in o.denied
        assert r.client.sent.startswith(b"HTTP/1.1 502 ") and SECRET not in r.client.sent
    run(body)


def test_secret_in_status_line_headers_and_split_across_reads_is_masked() -> None:
    async def body() -> None:
        r = Run(Rules("allowed.test", 443, {PLACEHOLDER: SECRET}))
        task = r.start(get("/"))
        await r.server.until(lambda: b"\r\n\r\n" in r.server.sent, "the request")
        whole = (b"HTTP/1.1 200 " + SECRET + b"\r\nX-Echo: " + SECRET + b"\r\n"
                 b"Content-Length: %d\r\n\r\n" % (len(SECRET) + 2) + b"<" + SECRET + b">")
        for i in range(0, len(whole), 7):  # a few bytes at a time
            r.server.feed(whole[i:i + 7])
        await r.client.until(lambda: r.client.sent.endswith(b">"), "the whole answer")
        r.client.feed(b"")
        await task
        assert SECRET not in r.client.sent and r.client.sent.count(PLACEHOLDER[:10]) == 3
    run(body)


def test_a_decompression_bomb_is_passed_on_in_bounded_pieces() -> None:
    d = Decoder()
    packed = gzip.compress(b"\0" * (64 * CHUNK)) + gzip.compress(b"second member")
    sizes = [len(p) for p in d.feed(packed)]
    assert max(sizes) <= CHUNK and sum(sizes) == 64 * CHUNK + len(b"second member")
    with pytest.raises(Refused):
        list(Decoder().feed(b"\x1f\x8b not gzip at all"))
