"""The NFLOG reader (cpuosd.network.nflog).

Parser tests (no socket, no root): valid messages, batches, and every kind of malformed or
truncated message, which is skipped and counted, never a crash.

Namespace test (root): two network namespaces of the test's own joined by a veth pair;
in one ("fw") an nft table logs (group 7, prefix "sbx-test") and drops what comes in from
the veth, and the reader listens there; from the other ("src") go a UDP datagram to
10.0.0.1:53 and to the peer's :9999, one over IPv6, a TCP SYN to :25 and an ICMP echo.
Topology (all made here, all removed at the end):
    [src netns] nfs<tag> 10.201.0.2/30 fd00:201::2/64
                    <-> nff<tag> 10.201.0.1/30 fd00:201::1/64 [fw netns]
"src" routes everything to "fw", which has no route but its own links and drops it all:
nothing reaches another namespace or the machine's network.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from cpuosd.network.nflog import (
    MSG_PACKET,
    NFULA_IFINDEX_INDEV,
    NFULA_PACKET_HDR,
    NFULA_PAYLOAD,
    NFULA_PREFIX,
    NFULA_TIMESTAMP,
    NLMSG_DONE,
    Dropped,
    NflogError,
    NflogReader,
    config_message,
    parse_datagram,
)

GROUP = 7
PREFIX = "sbx-test"


# ---- building messages --------------------------------------------------------------------

def nlmsg(mtype: int, body: bytes, *, length: int | None = None) -> bytes:
    n = 16 + len(body) if length is None else length
    m = struct.pack("=IHHII", n, mtype, 0, 0, 0) + body
    return m + b"\0" * (-len(m) % 4)


def attr(atype: int, value: bytes, *, length: int | None = None) -> bytes:
    a = struct.pack("=HH", 4 + len(value) if length is None else length, atype) + value
    return a + b"\0" * (-len(a) % 4)


def ipv4(proto: int, src: str, dst: str, l4: bytes, *, ihl: int = 5, frag: int = 0) -> bytes:
    opts = b"\0" * (ihl * 4 - 20) if ihl >= 5 else b""
    return (struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 20 + len(opts) + len(l4), 0, frag,
                        64, proto, 0, socket.inet_aton(src), socket.inet_aton(dst))
            + opts + l4)


def ipv6(nxt: int, src: str, dst: str, rest: bytes) -> bytes:
    return (struct.pack("!IHBB", 6 << 28, len(rest), nxt, 64)
            + socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst)
            + rest)


def ports(sport: int, dport: int) -> bytes:
    return struct.pack("!HH", sport, dport) + b"\0" * 16


def packet(payload: bytes, *, prefix: bytes = PREFIX.encode() + b"\0", indev: int | None = 3,
           ts: tuple[int, int] | None = None, family: int = socket.AF_INET) -> bytes:
    body = struct.pack("!BBH", family, 0, GROUP)
    body += attr(NFULA_PACKET_HDR, struct.pack("!HBB", 0x0800, 0, 0))
    if ts is not None:
        body += attr(NFULA_TIMESTAMP, struct.pack("!QQ", *ts))
    if indev is not None:
        body += attr(NFULA_IFINDEX_INDEV, struct.pack("!I", indev))
    body += attr(NFULA_PAYLOAD, payload)
    body += attr(NFULA_PREFIX, prefix)
    return nlmsg(MSG_PACKET, body)


UDP4 = ipv4(17, "10.201.0.2", "10.0.0.1", ports(40000, 53))
TCP4 = ipv4(6, "10.201.0.2", "10.0.0.1", ports(40001, 25))
ICMP4 = ipv4(1, "10.201.0.2", "10.201.0.1", bytes([8, 0]) + b"\0" * 6)


# ---- the parser ---------------------------------------------------------------------------

def test_parses_ipv4_udp_tcp_icmp() -> None:
    out, bad = parse_datagram(packet(UDP4, ts=(1_700_000_000, 250_000)), received=5.0)
    assert bad == 0
    assert out == [Dropped(PREFIX, 3, None, socket.AF_INET, 17, "10.201.0.2", "10.0.0.1",
                           40000, 53, None, None, 1_700_000_000.25)]
    assert out[0].protocol == "udp"
    (tcp,), _ = parse_datagram(packet(TCP4, indev=None), received=5.0)
    assert (tcp.protocol, tcp.dport, tcp.indev, tcp.time) == ("tcp", 25, None, 5.0)
    (icmp,), _ = parse_datagram(packet(ICMP4))
    assert (icmp.protocol, icmp.icmp_type, icmp.icmp_code, icmp.sport) == ("icmp", 8, 0, None)


def test_parses_ipv6_through_extension_headers() -> None:
    hop = bytes([17, 0]) + b"\0" * 6  # hop-by-hop options, 8 octets, then UDP
    p = ipv6(0, "fd00:201::2", "fd00:201::1", hop + ports(40002, 9999))
    (d,), bad = parse_datagram(packet(p, family=socket.AF_INET6))
    assert bad == 0
    assert (d.family, d.protocol, d.src, d.dst, d.dport) == (
        socket.AF_INET6, "udp", "fd00:201::2", "fd00:201::1", 9999)
    # a fragment that is not the first carries no transport header
    frag = struct.pack("!BBHI", 17, 0, 8 << 3, 1)
    (f,), _ = parse_datagram(packet(ipv6(44, "fd00::2", "fd00::1", frag + ports(1, 2))))
    assert (f.proto, f.sport, f.dport) == (17, None, None)
    # an extension header whose length points past the copied bytes: addresses, no ports
    (e,), _ = parse_datagram(packet(ipv6(60, "fd00::2", "fd00::1", bytes([17, 200]))))
    assert (e.dst, e.dport) == ("fd00::1", None)
    (icmp6,), _ = parse_datagram(packet(ipv6(58, "fd00::2", "fd00::1", bytes([128, 0, 0, 0]))))
    assert (icmp6.protocol, icmp6.icmp_type) == ("icmpv6", 128)


def test_a_batch_and_other_message_types() -> None:
    done = nlmsg(NLMSG_DONE, struct.pack("=i", 0))
    config = config_message(GROUP, 1, 128, 1, 10)
    out, bad = parse_datagram(packet(UDP4) + config + packet(TCP4) + done)
    assert bad == 0
    assert [d.dport for d in out] == [53, 25]


MALFORMED: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("short header", b"\x10\0\0\0\0\0"),
    ("nlmsg_len 0", nlmsg(MSG_PACKET, b"\0" * 8, length=0)),
    ("nlmsg_len 15", nlmsg(MSG_PACKET, b"\0" * 8, length=15)),
    ("nlmsg_len past the datagram", nlmsg(MSG_PACKET, b"\0" * 8, length=1 << 20)),
    ("no nfgenmsg", nlmsg(MSG_PACKET, b"\2\0")),
    ("no payload", nlmsg(MSG_PACKET, struct.pack("!BBH", 2, 0, 7) + attr(NFULA_PREFIX, b"x\0"))),
    ("attribute length 0", nlmsg(MSG_PACKET, struct.pack("!BBH", 2, 0, 7)
                                 + attr(NFULA_PAYLOAD, UDP4, length=0))),
    ("attribute length 3", nlmsg(MSG_PACKET, struct.pack("!BBH", 2, 0, 7)
                                 + attr(NFULA_PAYLOAD, UDP4, length=3))),
    ("attribute past the message", nlmsg(MSG_PACKET, struct.pack("!BBH", 2, 0, 7)
                                         + attr(NFULA_PAYLOAD, UDP4, length=4000))),
    ("payload shorter than an IPv4 header", packet(UDP4[:19])),
    ("IHL below 5", packet(ipv4(17, "10.0.0.2", "10.0.0.1", ports(1, 2), ihl=3))),
    ("IHL past the payload", packet(ipv4(17, "10.0.0.2", "10.0.0.1", b"", ihl=15)[:40])),
    ("IP version 5", packet(bytes([0x55]) + UDP4[1:])),
    ("payload shorter than an IPv6 header", packet(ipv6(17, "::1", "::2", b"")[:39])),
    ("empty payload", packet(b"")),
    ("indev shorter than 4", nlmsg(MSG_PACKET, struct.pack("!BBH", 2, 0, 7)
                                   + attr(NFULA_IFINDEX_INDEV, b"\0\1")
                                   + attr(NFULA_PAYLOAD, UDP4))),
    ("timestamp shorter than 16", nlmsg(MSG_PACKET, struct.pack("!BBH", 2, 0, 7)
                                        + attr(NFULA_TIMESTAMP, b"\0" * 8)
                                        + attr(NFULA_PAYLOAD, UDP4))),
]


@pytest.mark.parametrize("data", [m for _, m in MALFORMED], ids=[n for n, _ in MALFORMED])
def test_malformed_messages_are_skipped(data: bytes) -> None:
    out, bad = parse_datagram(data)
    assert out == []
    assert bad == (0 if data == b"" else 1)


def test_a_malformed_message_does_not_take_the_next_one_with_it() -> None:
    out, bad = parse_datagram(packet(b"") + packet(UDP4) + packet(UDP4[:10]) + packet(TCP4))
    assert ([d.dport for d in out], bad) == ([53, 25], 2)


def test_every_truncation_and_random_corruption() -> None:
    whole = packet(UDP4, ts=(1, 2)) + packet(ipv6(0, "fd00::2", "fd00::1",
                                                  bytes([6, 0]) + b"\0" * 6 + ports(3, 4)))
    first = len(packet(UDP4, ts=(1, 2)))
    for n in range(len(whole)):
        out, bad = parse_datagram(whole[:n])
        assert len(out) == (1 if n >= first else 0), n
        assert bad == (0 if n in (0, first) else 1), n
    rng = random.Random(7)
    for _ in range(3000):
        b = bytearray(whole)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out, bad = parse_datagram(bytes(b[:rng.randint(0, len(b))]))
        assert all(isinstance(d, Dropped) for d in out) and bad >= 0


def test_the_config_message() -> None:
    m = config_message(GROUP, 42, 128, 1, 10)
    n, mtype, flags, seq, _ = struct.unpack_from("=IHHII", m)
    assert (n, mtype, flags, seq) == (len(m), (4 << 8) | 1, 0x1 | 0x4, 42)
    assert struct.unpack_from("!BBH", m, 16) == (socket.AF_UNSPEC, 0, GROUP)
    # CMD=BIND, then MODE: be32 range 128, copy mode packet
    assert m[20:28] == struct.pack("=HH", 5, 1) + b"\1\0\0\0"
    assert m[28:40] == struct.pack("=HH", 10, 2) + struct.pack("!IBB", 128, 2, 0) + b"\0\0"


def test_the_reader_skips_malformed_datagrams_and_reads_on() -> None:
    """The reader's own loop, fed through a socketpair in place of the netlink socket."""
    async def body() -> None:
        reader = NflogReader(GROUP)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        ours.setblocking(False)
        reader._sock = ours
        got: list[Dropped] = []
        arrived = asyncio.Event()

        def on_packet(d: Dropped) -> None:
            got.append(d)
            arrived.set()

        task = asyncio.create_task(reader.run(on_packet))
        try:
            for data in [m for _, m in MALFORMED if m] + [packet(UDP4, indev=None)]:
                theirs.send(data)
            async with asyncio.timeout(10):
                await arrived.wait()
            assert [d.dport for d in got] == [53]
            assert reader.malformed == len([m for _, m in MALFORMED if m])
            assert reader.received == 1
        finally:
            reader.close()
            theirs.close()
            await asyncio.wait_for(task, 10)

    asyncio.run(body())


# ---- the real thing: nftables, NFLOG, network namespaces ----------------------------------

def sh(*argv: str, check: bool = True, input: str | None = None,
       timeout: float = 30) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, input=input,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{argv}: rc={r.returncode}: {r.stderr[-800:]}")
    return r


@dataclass
class Topology:
    src: str  # the namespace the packets come from
    fw: str  # the namespace whose nft table logs and drops them, where the reader listens
    fw_if: str  # the veth end in fw


@pytest.fixture
def topology() -> Iterator[Topology]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, nftables)")
    tag = secrets.token_hex(3)
    src, fw = f"cpuos-t-nfl-{tag}-s", f"cpuos-t-nfl-{tag}-f"
    src_if, fw_if = f"nfs{tag}", f"nff{tag}"
    made: list[str] = []
    try:
        for ns in (src, fw):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", src_if, "netns", src, "type", "veth",
           "peer", "name", fw_if, "netns", fw)
        for ns, dev, v4, v6 in ((src, src_if, "10.201.0.2/30", "fd00:201::2/64"),
                                (fw, fw_if, "10.201.0.1/30", "fd00:201::1/64")):
            sh("ip", "-n", ns, "addr", "add", v4, "dev", dev)
            sh("ip", "-n", ns, "addr", "add", v6, "dev", dev, "nodad")
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        # src sends everything to fw (10.0.0.1 included); fw has no route but its /30 and /64
        sh("ip", "-n", src, "route", "add", "default", "via", "10.201.0.1")
        # neighbour discovery passes (else no IPv6 packet leaves src); everything else from
        # the veth is logged and dropped before routing
        sh("ip", "netns", "exec", fw, "nft", "-f", "-", input=f"""
table inet cpuostest {{
    chain pre {{
        type filter hook prerouting priority filter; policy accept;
        iifname "{fw_if}" icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept
        iifname "{fw_if}" log group {GROUP} prefix "{PREFIX}" drop
    }}
}}
""")
        yield Topology(src, fw, fw_if)
    finally:
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)


# sent from src; the raw socket's ICMP echo stands in for ping (not installed here)
SEND = """
import socket, struct
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.sendto(b"q", ("10.0.0.1", 53))
u.sendto(b"x", ("10.201.0.1", 9999))
u6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
u6.sendto(b"x", ("fd00:201::1", 9999))
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
t.settimeout(0.5)
try:
    t.connect(("10.0.0.1", 25))
except OSError:
    pass
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF
echo = struct.pack("!BBHHH", 8, 0, 0, 0x4321, 1) + b"cpuos-nflog-test"
echo = echo[:2] + struct.pack("!H", csum(echo)) + echo[4:]
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
r.sendto(echo, ("10.201.0.1", 0))
"""


def wanted(fw_if: str) -> dict[str, Callable[[Dropped], bool]]:
    def base(d: Dropped) -> bool:
        return d.prefix == PREFIX and d.indev_name == fw_if and d.indev is not None

    return {
        "udp 10.0.0.1:53": lambda d: base(d) and d.protocol == "udp"
        and d.family == socket.AF_INET and (d.src, d.dst, d.dport) == (
            "10.201.0.2", "10.0.0.1", 53) and d.sport is not None,
        "udp 10.201.0.1:9999": lambda d: base(d) and d.protocol == "udp"
        and (d.dst, d.dport) == ("10.201.0.1", 9999),
        "udp [fd00:201::1]:9999": lambda d: base(d) and d.protocol == "udp"
        and d.family == socket.AF_INET6 and (d.src, d.dst, d.dport) == (
            "fd00:201::2", "fd00:201::1", 9999),
        "tcp 10.0.0.1:25": lambda d: base(d) and d.protocol == "tcp"
        and (d.dst, d.dport) == ("10.0.0.1", 25),
        "icmp echo 10.201.0.1": lambda d: base(d) and d.protocol == "icmp"
        and (d.dst, d.icmp_type, d.icmp_code, d.dport) == ("10.201.0.1", 8, 0, None),
    }


@pytest.mark.net
@pytest.mark.e2e
def test_dropped_packets_are_reported_from_inside_a_netns(topology: Topology) -> None:
    async def body() -> None:
        got: list[Dropped] = []
        arrived = asyncio.Event()
        want = wanted(topology.fw_if)

        def missing() -> list[str]:
            return [name for name, ok in want.items() if not any(ok(d) for d in got)]

        def on_packet(d: Dropped) -> None:
            got.append(d)
            arrived.set()

        reader = NflogReader(GROUP, netns=topology.fw)
        reader.open()
        task = asyncio.create_task(reader.run(on_packet))
        try:
            # a second listener on the same group in that namespace is refused
            with pytest.raises(NflogError), NflogReader(GROUP, netns=topology.fw):
                pass
            r = await asyncio.to_thread(
                sh, "ip", "netns", "exec", topology.src, sys.executable, "-c", SEND)
            assert r.returncode == 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(15):
                    while missing():
                        arrived.clear()
                        await arrived.wait()
            assert not missing(), f"not reported: {missing()}; got {got}"
            assert reader.malformed == 0 and reader.overruns == 0
        finally:
            reader.close()
            await asyncio.wait_for(task, 10)

    asyncio.run(body())


FLOOD = """
import socket, sys
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[1])):
    u.sendto(b"f", ("10.201.0.1", int(sys.argv[2])))
"""


@pytest.mark.net
@pytest.mark.e2e
def test_a_flood_overruns_the_socket_and_the_reader_reads_on(topology: Topology) -> None:
    """With a small receive buffer and no one reading, a flood fills the socket: the kernel
    drops the rest, the reader counts the overrun (ENOBUFS) and goes on to the next packet."""
    async def body() -> None:
        marker: list[Dropped] = []
        arrived = asyncio.Event()
        flood = 0

        def on_packet(d: Dropped) -> None:
            nonlocal flood
            if d.dport == 7001:
                marker.append(d)
                arrived.set()
            elif d.dport == 7000:
                flood += 1

        reader = NflogReader(GROUP, netns=topology.fw, rcvbuf=4096)
        reader.open()  # bound, nobody reading yet
        task: asyncio.Task[None] | None = None
        try:
            r = await asyncio.to_thread(sh, "ip", "netns", "exec", topology.src,
                                        sys.executable, "-c", FLOOD, "2000", "7000")
            assert r.returncode == 0
            task = asyncio.create_task(reader.run(on_packet))
            r = await asyncio.to_thread(sh, "ip", "netns", "exec", topology.src,
                                        sys.executable, "-c", FLOOD, "1", "7001")
            assert r.returncode == 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(15):
                    await arrived.wait()
            assert marker, "the packet after the flood was not reported"
            assert reader.overruns >= 1
            assert 0 < flood < 2000
            assert reader.malformed == 0
        finally:
            reader.close()
            if task is not None:
                await asyncio.wait_for(task, 10)

    asyncio.run(body())


def test_no_such_netns() -> None:
    with pytest.raises(FileNotFoundError):
        NflogReader(GROUP, netns=f"cpuos-t-nfl-absent-{secrets.token_hex(3)}").open()
