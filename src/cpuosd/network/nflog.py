"""A reader of NFLOG: the packets an nftables rule ``log group N prefix "<tag>"`` hands to user
space over a NETLINK_NETFILTER socket, the way the daemon records what its firewall drops.

The kernel side (``nfnetlink_log``): a socket binds one group with an NFULNL_MSG_CONFIG
message (``nfgen_family`` AF_UNSPEC, ``res_id`` the group in network order) carrying
NFULA_CFG_CMD = NFULNL_CFG_CMD_BIND; the same message sets the copy mode (NFULA_CFG_MODE:
the first ``copy_range`` bytes of each packet, from its network header), the queue
threshold (NFULA_CFG_QTHRESH, 1: each packet is sent as it is logged, not batched for up to
a second) and the flush timeout. A group has one listener per network namespace (a second
bind gets EPERM/EBUSY); it lives as long as the socket. ``NFULNL_CFG_CMD_PF_BIND`` and
``PF_UNBIND`` are *not* sent: they only choose a namespace's default logger (the one a bare
``log`` without ``group`` uses, which is nf_log_ipv4 / syslog on the host); a ``log group``
rule always goes to nfnetlink_log, and an unbind would take the host's logger away.

Each logged packet arrives as NFULNL_MSG_PACKET (type ``NFNL_SUBSYS_ULOG << 8 | 0``):
``struct nfgenmsg`` (family = the packet's protocol family, res_id = the group) then
attributes: NFULA_PREFIX (NUL-terminated), NFULA_IFINDEX_INDEV (be32), NFULA_TIMESTAMP (be64
seconds, be64 microseconds; only when the skb has a timestamp), NFULA_PAYLOAD (the IP
packet, cut at ``copy_range``) and others we ignore. Several may share one datagram
(NLM_F_MULTI, ending in NLMSG_DONE) when the kernel batches.

Bounded: no queue of ours. The socket's receive buffer is the only buffer; when it is full
the kernel drops what does not fit and the next ``recv`` fails with ENOBUFS, which is counted
(``overruns``: how many times the kernel said so, not how many messages it dropped) and
read past. The default ``rcvbuf`` (1 MiB, which the kernel doubles; SO_RCVBUFFORCE as root,
past net.core.rmem_max) held about 2,500 unread packets at a 128-byte copy range on 6.18.
Each readiness event reads at most ``BURST`` datagrams, so a flood cannot starve the event
loop. Nothing in a message is trusted: every length is
checked against what was received, and a message that does not parse is counted
(``malformed``) and skipped.

A netlink socket belongs to the network namespace it was created in: with ``netns`` set the
socket (and a datagram socket used to name interfaces by index there) is created in a
short-lived thread of its own that ``setns`` into that namespace; after that the sockets are
used from any thread, the event loop's included.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
CLONE_NEWNET = 0x40000000
SIOCGIFNAME = 0x8910
SO_RCVBUFFORCE = 33

# linux/netlink.h
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE = 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
# linux/netfilter/nfnetlink.h, nfnetlink_log.h
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET, NFULNL_MSG_CONFIG = 0, 1
NFULA_PACKET_HDR, NFULA_TIMESTAMP, NFULA_IFINDEX_INDEV = 1, 3, 4
NFULA_PAYLOAD, NFULA_PREFIX = 9, 10
NFULNL_CFG_CMD_BIND = 1
NFULA_CFG_CMD, NFULA_CFG_MODE, NFULA_CFG_NLBUFSIZ, NFULA_CFG_TIMEOUT, NFULA_CFG_QTHRESH = (
    1, 2, 3, 4, 5)
NFULNL_COPY_PACKET = 2

MSG_PACKET = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET
MSG_CONFIG = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
NFGENMSG = struct.Struct("!BBH")  # family, version, res_id (network order)
NLATTR = struct.Struct("=HH")  # len, type (host order)

IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMPV6 = 1, 6, 17, 58
PORTED = frozenset({IPPROTO_TCP, IPPROTO_UDP, 132, 136})  # + SCTP, UDP-Lite
PROTO_NAMES = {IPPROTO_ICMP: "icmp", IPPROTO_TCP: "tcp", IPPROTO_UDP: "udp",
               IPPROTO_ICMPV6: "icmpv6", 132: "sctp", 136: "udplite"}
# IPv6 extension headers walked to reach the transport header: hop-by-hop, routing,
# destination options (length in 8-octet units past the first 8), AH (4-octet units + 2);
# the fragment header (44) is 8 octets
V6_EXT = frozenset({0, 43, 60, 51})
V6_FRAGMENT = 44
V6_MAX_EXT = 8

BURST = 256  # datagrams read per readiness event
RECV_SIZE = 65536  # one datagram (the kernel's nlbufsiz, a page by default; a longer one is
# cut here, and its cut message counted as malformed)
IFNAME_CACHE = 256


class NflogError(OSError):
    """The kernel refused the group's configuration (EPERM / EBUSY: another socket in that
    namespace listens on the group), or never answered."""


@dataclass(frozen=True, slots=True)
class Dropped:
    """One packet an NFLOG rule logged. ``prefix`` is the rule's tag (the verdict and the
    reason are the rule's: the tag should say them). ``indev`` is the input interface's index
    (None for locally generated packets), ``indev_name`` its name in the reader's namespace
    when it still exists. ``sport``/``dport`` are set for TCP, UDP, SCTP and UDP-Lite,
    ``icmp_type``/``icmp_code`` for ICMP and ICMPv6 (both None for a non-first fragment or a
    header cut short). ``time``: the kernel's timestamp of the packet when it sent one, else
    when the reader received it (``time.time()``)."""

    prefix: str
    indev: int | None
    indev_name: str | None
    family: int  # socket.AF_INET or socket.AF_INET6
    proto: int  # IP protocol number
    src: str
    dst: str
    sport: int | None
    dport: int | None
    icmp_type: int | None
    icmp_code: int | None
    time: float

    @property
    def protocol(self) -> str:
        return PROTO_NAMES.get(self.proto, str(self.proto))


Buffer = bytes | bytearray | memoryview


def _attrs(buf: memoryview) -> dict[int, memoryview] | None:
    """The attributes of one message body (first of each type), None if any is malformed."""
    out: dict[int, memoryview] = {}
    off, end = 0, len(buf)
    while off + NLATTR.size <= end:
        alen, atype = NLATTR.unpack_from(buf, off)
        if alen < NLATTR.size or off + alen > end:
            return None
        out.setdefault(atype & NLA_TYPE_MASK, buf[off + NLATTR.size:off + alen])
        off += (alen + 3) & ~3
    return out


def _transport(proto: int, l4: memoryview) -> tuple[int | None, int | None, int | None, int | None]:
    """(sport, dport, icmp_type, icmp_code) from the start of a transport header."""
    if proto in PORTED and len(l4) >= 4:
        sport, dport = struct.unpack_from("!HH", l4)
        return sport, dport, None, None
    if proto in (IPPROTO_ICMP, IPPROTO_ICMPV6) and len(l4) >= 2:
        return None, None, l4[0], l4[1]
    return None, None, None, None


def parse_ip(payload: memoryview) -> tuple[int, int, str, str, int | None, int | None,
                                           int | None, int | None] | None:
    """(family, proto, src, dst, sport, dport, icmp_type, icmp_code) of an IP packet's start,
    or None when it is not an IPv4/IPv6 header that fits."""
    if len(payload) < 1:
        return None
    version = payload[0] >> 4
    if version == 4:
        if len(payload) < 20:
            return None
        ihl = (payload[0] & 0x0F) * 4
        if ihl < 20 or ihl > len(payload):
            return None
        frag = struct.unpack_from("!H", payload, 6)[0] & 0x1FFF
        proto = payload[9]
        src = str(ipaddress.IPv4Address(bytes(payload[12:16])))
        dst = str(ipaddress.IPv4Address(bytes(payload[16:20])))
        l4 = payload[ihl:] if frag == 0 else payload[0:0]
        return (socket.AF_INET, proto, src, dst, *_transport(proto, l4))
    if version == 6:
        if len(payload) < 40:
            return None
        src = str(ipaddress.IPv6Address(bytes(payload[8:24])))
        dst = str(ipaddress.IPv6Address(bytes(payload[24:40])))
        proto, off, first = payload[6], 40, True
        for _ in range(V6_MAX_EXT):
            if proto in V6_EXT:
                if off + 2 > len(payload):
                    return (socket.AF_INET6, proto, src, dst, None, None, None, None)
                nxt, hlen = payload[off], payload[off + 1]
                off += (hlen + 2) * 4 if proto == 51 else (hlen + 1) * 8
                proto = nxt
            elif proto == V6_FRAGMENT:
                if off + 8 > len(payload):
                    return (socket.AF_INET6, proto, src, dst, None, None, None, None)
                nxt = payload[off]
                first = struct.unpack_from("!H", payload, off + 2)[0] & 0xFFF8 == 0
                off += 8
                proto = nxt
            else:
                break
        l4 = payload[off:] if first and off <= len(payload) else payload[0:0]
        return (socket.AF_INET6, proto, src, dst, *_transport(proto, l4))
    return None


def parse_packet(body: memoryview, received: float) -> Dropped | None:
    """One NFULNL_MSG_PACKET's body (after the nlmsghdr), None if malformed."""
    if len(body) < NFGENMSG.size:
        return None
    attrs = _attrs(body[NFGENMSG.size:])
    if attrs is None or NFULA_PAYLOAD not in attrs:
        return None
    ip = parse_ip(attrs[NFULA_PAYLOAD])
    if ip is None:
        return None
    family, proto, src, dst, sport, dport, icmp_type, icmp_code = ip
    raw = bytes(attrs.get(NFULA_PREFIX, b""))
    prefix = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
    indev = None
    if (a := attrs.get(NFULA_IFINDEX_INDEV)) is not None:
        if len(a) < 4:
            return None
        indev = struct.unpack_from("!I", a)[0]
    when = received
    if (a := attrs.get(NFULA_TIMESTAMP)) is not None:
        if len(a) < 16:
            return None
        sec, usec = struct.unpack_from("!QQ", a)
        if sec:
            when = sec + min(usec, 999_999) / 1e6
    return Dropped(prefix, indev, None, family, proto, src, dst, sport, dport,
                   icmp_type, icmp_code, when)


def parse_datagram(data: Buffer, received: float | None = None) -> tuple[list[Dropped], int]:
    """The packets in one netlink datagram, and how many of its messages were malformed
    (skipped). A header whose length does not fit ends the datagram (nothing after it can be
    found); other message types (NLMSG_DONE, NOOP, errors, config) are passed over."""
    buf = memoryview(data)
    when = time.time() if received is None else received
    out: list[Dropped] = []
    bad = 0
    off = 0
    while off + NLMSGHDR.size <= len(buf):
        mlen, mtype, _flags, _seq, _pid = NLMSGHDR.unpack_from(buf, off)
        if mlen < NLMSGHDR.size or off + mlen > len(buf):
            return out, bad + 1
        if mtype == MSG_PACKET:
            p = parse_packet(buf[off + NLMSGHDR.size:off + mlen], when)
            if p is None:
                bad += 1
            else:
                out.append(p)
        off += (mlen + 3) & ~3
    if off < len(buf):
        bad += 1  # a tail too short for a header
    return out, bad


def _netns_path(netns: str) -> str:
    return netns if "/" in netns else f"/var/run/netns/{netns}"


def _sockets_in(netns: str | None) -> tuple[socket.socket, socket.socket]:
    """The NETLINK_NETFILTER socket and a datagram socket (for naming interfaces), both
    created in ``netns`` (the caller's namespace when None)."""
    def make() -> tuple[socket.socket, socket.socket]:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            ifs = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except BaseException:
            nl.close()
            raise
        return nl, ifs

    if netns is None:
        return make()
    path = _netns_path(netns)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    result: list[tuple[socket.socket, socket.socket]] = []
    failure: list[BaseException] = []

    def run() -> None:
        # a thread of its own, which ends here: the namespace it enters goes with it
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
            result.append(make())
        except BaseException as e:
            failure.append(e)

    try:
        t = threading.Thread(target=run, name=f"nflog-netns-{netns}", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(fd)
    if failure:
        raise failure[0]
    return result[0]


def _attr(atype: int, value: bytes) -> bytes:
    a = NLATTR.pack(NLATTR.size + len(value), atype) + value
    return a + b"\0" * (-len(a) % 4)


def config_message(group: int, seq: int, copy_range: int, qthresh: int,
                   timeout_cs: int) -> bytes:
    """NFULNL_MSG_CONFIG: bind ``group`` to the sending socket, copy the first
    ``copy_range`` bytes of each packet, send after ``qthresh`` packets or
    ``timeout_cs`` hundredths of a second."""
    body = (NFGENMSG.pack(socket.AF_UNSPEC, 0, group)
            + _attr(NFULA_CFG_CMD, struct.pack("B", NFULNL_CFG_CMD_BIND))
            + _attr(NFULA_CFG_MODE, struct.pack("!IBB", copy_range, NFULNL_COPY_PACKET, 0))
            + _attr(NFULA_CFG_QTHRESH, struct.pack("!I", qthresh))
            + _attr(NFULA_CFG_TIMEOUT, struct.pack("!I", timeout_cs)))
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK,
                         seq, 0) + body


class NflogReader:
    """Listens on one NFLOG group, in ``netns`` (a name under /var/run/netns, or a path) or
    the caller's namespace. ``open()`` binds (blocking, a kernel round trip; ``run`` opens if
    not yet open), ``run(on_packet)`` delivers each packet until ``close()``. Counters:
    ``received`` (packets delivered), ``malformed`` (messages skipped), ``overruns``
    (ENOBUFS seen: the kernel dropped log messages our buffer could not hold, how many it
    does not say)."""

    def __init__(self, group: int, netns: str | None = None, *, copy_range: int = 128,
                 rcvbuf: int = 1 << 20, qthresh: int = 1, timeout_cs: int = 10) -> None:
        if not 0 <= group <= 0xFFFF:
            raise ValueError(f"NFLOG group {group}: not 0..65535")
        if not 40 <= copy_range <= 0xFFFF - NLATTR.size:
            raise ValueError(f"copy_range {copy_range}: not 40..{0xFFFF - NLATTR.size}")
        self.group, self.netns = group, netns
        self.copy_range, self.rcvbuf = copy_range, rcvbuf
        self.qthresh, self.timeout_cs = max(1, qthresh), max(0, timeout_cs)
        self.received = self.malformed = self.overruns = 0
        self._sock: socket.socket | None = None
        self._ifs: socket.socket | None = None
        self._buf = bytearray(RECV_SIZE)
        self._names: dict[int, str | None] = {}
        # packets read while waiting for the bind's acknowledgement
        self._early: deque[Dropped] = deque(maxlen=BURST)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None
        self._closed = False

    def fileno(self) -> int:
        if self._sock is None:
            raise ValueError("NflogReader is not open")
        return self._sock.fileno()

    def open(self, timeout: float = 5.0) -> None:
        if self._closed:
            raise ValueError("NflogReader is closed")
        if self._sock is not None:
            return
        nl, ifs = _sockets_in(self.netns)
        try:
            try:  # past net.core.rmem_max where we may (root)
                nl.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf)
            except PermissionError:
                nl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            nl.bind((0, 0))
            seq = int.from_bytes(os.urandom(4), "little") or 1
            nl.settimeout(timeout)
            nl.send(config_message(self.group, seq, self.copy_range, self.qthresh,
                                   self.timeout_cs))
            self._await_ack(nl, seq, timeout)
            nl.setblocking(False)
        except BaseException:
            nl.close()
            ifs.close()
            raise
        self._sock, self._ifs = nl, ifs

    def _await_ack(self, nl: socket.socket, seq: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NflogError(errno.ETIMEDOUT, f"NFLOG group {self.group}: no answer")
            nl.settimeout(left)
            try:
                n = nl.recv_into(self._buf)
            except TimeoutError:
                continue
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.overruns += 1
                    continue
                raise
            buf = memoryview(self._buf)[:n]
            off = 0
            while off + NLMSGHDR.size <= n:
                mlen, mtype, _f, mseq, _p = NLMSGHDR.unpack_from(buf, off)
                if mlen < NLMSGHDR.size or off + mlen > n:
                    break
                if mtype == NLMSG_ERROR and mseq == seq and mlen >= NLMSGHDR.size + 4:
                    code = -struct.unpack_from("=i", buf, off + NLMSGHDR.size)[0]
                    if code:
                        raise NflogError(code, f"NFLOG group {self.group} "
                                               f"(netns {self.netns or 'own'}): "
                                               f"{os.strerror(code)}")
                    return
                off += (mlen + 3) & ~3
            # packets logged between the bind and its acknowledgement
            packets, bad = parse_datagram(buf)
            self.malformed += bad
            self._early.extend(packets)

    def ifname(self, index: int) -> str | None:
        """The name of interface ``index`` in the reader's namespace (None if gone)."""
        if index in self._names:
            return self._names[index]
        name: str | None = None
        if self._ifs is not None:
            req = struct.pack("16si20x", b"", index)
            try:
                res = fcntl.ioctl(self._ifs.fileno(), SIOCGIFNAME, req)
                name = res[:16].split(b"\0", 1)[0].decode("utf-8", "replace")
            except OSError:
                return None  # gone (or never was): not cached, an index may come later
        if len(self._names) >= IFNAME_CACHE:
            self._names.clear()
        self._names[index] = name
        return name

    def _named(self, p: Dropped) -> Dropped:
        if p.indev is None:
            return p
        return replace(p, indev_name=self.ifname(p.indev))

    def read_ready(self, on_packet: Callable[[Dropped], None]) -> None:
        """Read what the socket holds (at most BURST datagrams) and deliver it."""
        sock = self._sock
        for _ in range(BURST):
            if sock is None or self._sock is not sock:
                return  # closed by on_packet
            try:
                n = sock.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.overruns += 1
                    continue
                log.error("NFLOG group %d: recv: %s", self.group, e)
                self._finish(e)
                return
            packets, bad = parse_datagram(memoryview(self._buf)[:n])
            self.malformed += bad
            for p in packets:
                if self._sock is not sock:
                    return  # closed by on_packet
                self._deliver(on_packet, p)

    def _deliver(self, on_packet: Callable[[Dropped], None], p: Dropped) -> None:
        self.received += 1
        try:
            on_packet(self._named(p))
        except Exception:
            log.exception("NFLOG group %d: on_packet failed", self.group)

    async def run(self, on_packet: Callable[[Dropped], None]) -> None:
        """Deliver each logged packet to ``on_packet`` (called in the event loop; it must not
        block) until ``close()``; a socket error other than ENOBUFS ends it with that error."""
        if self._done is not None:
            raise RuntimeError("NflogReader.run is already running")
        self.open()
        loop = asyncio.get_running_loop()
        self._loop, self._done = loop, loop.create_future()
        fd = self.fileno()
        while self._early:
            self._deliver(on_packet, self._early.popleft())
        loop.add_reader(fd, self.read_ready, on_packet)
        try:
            await self._done
        finally:
            if self._sock is not None:
                loop.remove_reader(fd)
            self._done = self._loop = None

    def _finish(self, error: BaseException | None) -> None:
        done = self._done
        if self._loop is not None and self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
        if done is not None and not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def close(self) -> None:
        """Stop ``run`` (it returns) and close the sockets; the kernel drops the group's
        binding with the socket. Call it from the event loop's thread while ``run`` runs."""
        self._closed = True
        self._finish(None)
        for s in (self._sock, self._ifs):
            if s is not None:
                s.close()
        self._sock = self._ifs = None

    def __enter__(self) -> NflogReader:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
