"""How the egress proxy reads the name a connection's first bytes give (TLS SNI, an HTTP
request's Host or CONNECT): one way only, or not at all (issue 25: a ClientHello split
over two records read as a shorter name than the server saw)."""

from __future__ import annotations

import ssl

import pytest

from cpuosd.network.proxy import MAX_HELLO, http_target, tls_sni


def client_hello(name: str | None) -> bytes:
    """A real ClientHello (Python's ssl), as one TLS record."""
    ctx = ssl.create_default_context()
    if name is None:
        ctx.check_hostname = False
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    t = ctx.wrap_bio(inc, out, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        t.do_handshake()
    return out.read()


def records(handshake: bytes, *cuts: int) -> bytes:
    """The handshake message in several records, cut at ``cuts``."""
    out, last = b"", 0
    for c in (*cuts, len(handshake)):
        part = handshake[last:c]
        out += b"\x16\x03\x01" + len(part).to_bytes(2, "big") + part
        last = c
    return out


def test_a_clienthello_names_its_host_whole_or_not_at_all() -> None:
    hello = client_hello("allowed.test.evil.example")
    assert tls_sni(hello) == "allowed.test.evil.example"
    assert tls_sni(hello[:40]) is False  # more bytes needed
    # split over records, the name cut where "allowed.test" ends: read whole, as a server
    # puts the message together
    hs = hello[5:]
    cut = hs.index(b"allowed.test") + len(b"allowed.test")
    split = records(hs, cut)
    assert tls_sni(split) == "allowed.test.evil.example"
    assert tls_sni(split[:len(split) - 3]) is False
    assert tls_sni(records(hs, 10, 20, cut, cut + 1)) == "allowed.test.evil.example"
    assert tls_sni(client_hello(None)) is None


@pytest.mark.parametrize("bad", [
    b"GET / HTTP/1.1\r\n\r\n",
    b"\x16\x03\x01\x00\x00",  # an empty record
    b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # a ServerHello
])
def test_not_a_clienthello_raises(bad: bytes) -> None:
    with pytest.raises(ValueError):
        tls_sni(bad)


def test_lengths_that_do_not_add_up_raise() -> None:
    hs = bytearray(client_hello("allowed.test")[5:])
    i = hs.index(b"allowed.test")
    hs[i - 2:i] = (len(b"allowed.test") + 40).to_bytes(2, "big")  # the name's length past it
    with pytest.raises(ValueError):
        tls_sni(records(bytes(hs)))
    with pytest.raises(ValueError):  # a record of something else in the middle
        hello = client_hello("allowed.test")[5:]
        tls_sni(records(hello, 30)[:35] + b"\x17" + records(hello, 30)[36:])
    with pytest.raises(ValueError):  # over MAX_HELLO
        tls_sni(b"\x16\x03\x01" + (MAX_HELLO).to_bytes(2, "big") + b"\x01")


def test_http_target_takes_plain_authorities_only() -> None:
    assert http_target(b"GET / HTTP/1.1\r\nHost: Allowed.Test.:8080\r\n\r\n") == (
        "allowed.test", 8080, False)
    assert http_target(b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n") == (
        "allowed.test", 443, True)
    assert http_target(b"GET / HTTP/1.1\r\nHost: allowed.test@other.test\r\n\r\n") == (
        None, None, False)
    assert http_target(b"GET / HTTP/1.1\r\nHost: allowed") is False
    with pytest.raises(ValueError):
        http_target(b"\x16\x03\x01 hello\r\n\r\n")
