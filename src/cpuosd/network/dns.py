"""The daemon's DNS resolver for sandboxes (dnslib), and its upstream client.

Every sandbox's UDP port 53 traffic is redirected here (firewall.py). A query is answered
by the upstream resolver (``CPUOS_DNS_UPSTREAM``, ``ip[:port]``; default the first
nameserver of /etc/resolv.conf), asked from the uplink namespace, and only:
- ``allowlist``: for names the allowlist allows (others: NXDOMAIN);
- ``on``: for any name.
Addresses in an answer that fall in the deny sets are removed from it (a name that
resolves to 10.x answers nothing). Every query is recorded. The proxy checks again at
connect time with its own lookup, so a changing answer (DNS rebinding) gains nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable
from typing import Any

from dnslib import QTYPE, RCODE, DNSRecord

from .policy import Deny, Policy
from .uplink import Uplink

log = logging.getLogger("cpuosd.network")
MAX_QUERY = 4096
PER_SANDBOX = 32  # queries of one sandbox in flight
UPSTREAM_TIMEOUT = 3.0


def default_upstream(v: str | None = None) -> tuple[str, int]:
    """``v`` (CPUOS_DNS_UPSTREAM: host[:port]), else the first nameserver of
    /etc/resolv.conf."""
    if v:
        host, _, port = v.rpartition(":") if v.count(":") == 1 else (v, "", "")
        return host or v, int(port or 53)
    with contextlib.suppress(OSError), open("/etc/resolv.conf") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                return parts[1], 53
    return "127.0.0.1", 53


class Upstream:
    """Asks the upstream resolver, from the uplink namespace."""

    def __init__(self, uplink: Uplink, server: tuple[str, int] | None = None) -> None:
        self.uplink = uplink
        self.server = server or default_upstream()

    async def ask(self, packet: bytes) -> bytes:
        fam = socket.AF_INET6 if ":" in self.server[0] else socket.AF_INET
        s = await self.uplink.new_socket(fam, socket.SOCK_DGRAM)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(UPSTREAM_TIMEOUT):
                await loop.sock_connect(s, self.server)
                await loop.sock_sendall(s, packet)
                while True:
                    reply = await loop.sock_recv(s, 65535)
                    if reply[:2] == packet[:2]:  # the id matches
                        return reply
        finally:
            s.close()

    async def resolve(self, name: str) -> list[str]:
        """The name's IPv4 addresses (empty if none)."""
        q = DNSRecord.question(name, "A")
        q.header.id = random.randrange(65536)
        reply = DNSRecord.parse(await self.ask(q.pack()))
        return [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]


Lookup = Callable[[str], tuple[str, Policy] | None]  # source address -> (sandbox, policy)
Record = Callable[..., None]


class Resolver(asyncio.DatagramProtocol):
    def __init__(self, upstream: Upstream, lookup: Lookup, record: Record,
                 deny: Deny | None = None) -> None:
        self.upstream, self.lookup, self.record = upstream, lookup, record
        self.deny = deny or Deny()
        self.transport: Any = None  # uvloop's UDP transport is no DatagramTransport
        self.inflight = 0
        self.per_sandbox: dict[str, int] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        who = self.lookup(str(addr[0]))
        if who is None or len(data) > MAX_QUERY or self.inflight > 1024:
            return  # not a sandbox (or a flood): no answer
        sid = who[0]
        if self.per_sandbox.get(sid, 0) >= PER_SANDBOX:
            return  # one sandbox may not take everyone's resolver
        self.inflight += 1
        self.per_sandbox[sid] = self.per_sandbox.get(sid, 0) + 1
        task = asyncio.get_running_loop().create_task(self._answer(data, addr, *who))
        task.add_done_callback(lambda _: self._done(sid))

    def _done(self, sid: str) -> None:
        self.inflight -= 1
        left = self.per_sandbox.get(sid, 1) - 1
        if left > 0:
            self.per_sandbox[sid] = left
        else:
            self.per_sandbox.pop(sid, None)

    async def _answer(self, data: bytes, addr: tuple[str | Any, int], sid: str,
                      policy: Policy) -> None:
        try:
            q = DNSRecord.parse(data)
        except Exception:
            return
        if q.header.opcode != 0 or len(q.questions) != 1 or q.header.qr:
            return  # one plain question (no updates, no smuggled extra questions)
        name = str(q.q.qname).rstrip(".").lower()
        qtype = QTYPE.get(q.q.qtype, str(q.q.qtype))
        reply = q.reply()
        if not policy.allows_name(name):
            reply.header.rcode = RCODE.NXDOMAIN if policy.mode == "allowlist" else RCODE.REFUSED
            self.record(sid, proto="dns", name=name, port=53, verdict="denied",
                        rule="not in the allowlist" if policy.mode == "allowlist"
                        else f"network {policy.mode}", qtype=qtype)
            self._send(reply.pack(), addr)
            return
        # a query of our own making carries the question on, and nothing else of theirs
        fresh = DNSRecord.question(name or ".", qtype if isinstance(qtype, str) else "A")
        fresh.header.id = q.header.id
        fresh.header.rd = q.header.rd
        try:
            answer = DNSRecord.parse(await self.upstream.ask(fresh.pack()))
        except Exception as e:
            reply.header.rcode = RCODE.SERVFAIL
            self.record(sid, proto="dns", name=name, port=53, verdict="error",
                        rule=f"upstream: {type(e).__name__}", qtype=qtype)
            self._send(reply.pack(), addr)
            return
        kept, dropped = [], []
        for rr in answer.rr:
            if rr.rtype == QTYPE.AAAA:
                continue  # sandboxes have no IPv6: a name gives none (a literal is refused)
            if rr.rtype == QTYPE.A and self.deny.address(str(rr.rdata)):
                dropped.append(str(rr.rdata))
            else:
                kept.append(rr)
        answer.rr = kept
        answer.ar = [rr for rr in answer.ar if rr.rtype != QTYPE.AAAA
                     and (rr.rtype != QTYPE.A or not self.deny.address(str(rr.rdata)))]
        if dropped:
            self.record(sid, proto="dns", name=name, port=53, verdict="denied",
                        rule=f"answer in a deny set: {', '.join(dropped[:4])}",
                        dst=dropped[0], qtype=qtype)
        else:
            self.record(sid, proto="dns", name=name, port=53, verdict="allowed", qtype=qtype)
        self._send(answer.pack(), addr)

    def _send(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(data, addr)
