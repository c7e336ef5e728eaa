"""The egress proxy: every TCP connection a sandbox opens (redirected here by firewall.py,
its original destination read back with SO_ORIGINAL_DST) is decided and relayed here.

- The mail ports and the deny sets are refused in every mode.
- ``on``: the original destination, if it is in no deny set; the name (TLS SNI or HTTP
  Host, when the client speaks first) is noted for the record.
- ``allowlist``: the name is required (TLS SNI, HTTP Host, or an HTTP CONNECT's authority),
  must be allowed, and is resolved here: every address it resolves to must be outside the
  deny sets, and the connection goes to that address, never to the one the sandbox chose
  (so a rebinding answer or a name like 169.254.169.254.nip.io gains nothing). A client
  that sends nothing within FIRST_BYTE_WAIT (a protocol whose server speaks first) has no
  name: refused then. Plaintext HTTP is followed request by request (httpflow): each must
  name the approved host. A CONNECT tunnel is answered, then what it carries is checked
  before anything is connected: TLS must name the tunnel's host in its SNI, plaintext is
  HTTP checked like any other, anything else is refused.
- TLS to a host a secret is meant for (any mode) is ended here with the sandbox's CA and
  followed request by request too (every request's Host must be that host: a shared front
  end would route another Host, secret included, elsewhere).
The proxy never follows a redirect (a redirect is a new connection, checked anew). Every
connection is recorded: destination, port, name, verdict and rule, bytes each way; one the
proxy cut is ``denied`` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .dns import Upstream
from .httpflow import (Outcome, Rules, TlsServerStream, parse_authority, relay_http,
                       same_name)
from .relay import CHUNK, PlainStream, quickack, relay
from .secrets import SecretStore
from .policy import NAME_RE, Deny, Policy
from ..fdbudget import BUDGET
from .uplink import Uplink

log = logging.getLogger("cpuosd.network")
SO_ORIGINAL_DST = 80
MAX_HELLO = 16 * 1024
NAME_WAIT = 10.0  # s an allowlisted connection may take to name its host
# s a client may stay silent before its first byte: a client speaks at once (TLS ClientHello,
# an HTTP request); one that waits for the server (SSH banner, SMTP, MySQL...) cannot be
# named, and is refused then rather than after NAME_WAIT
FIRST_BYTE_WAIT = 2.0
MAX_CONNS = 512  # open connections per sandbox through the proxy

Lookup = Callable[[str], tuple[str, Policy] | None]
Record = Callable[..., None]


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


def tls_sni(data: bytes) -> str | Literal[False] | None:
    """The server name of a TLS ClientHello: the name, None if it has none, False if more
    bytes are needed; raises ValueError if this is not a ClientHello, or not one that reads
    one way only. The handshake message is put together from as many records as it spans (a
    server does so: a name cut at a record's end must not read as a shorter one), and every
    length is checked against what holds it."""
    msg, off = b"", 0
    while True:
        if len(data) < off + 5:
            if off + 5 > MAX_HELLO:
                raise ValueError("a ClientHello over 16 KiB")
            return False
        if data[off] != 0x16:
            raise ValueError("not TLS" if off == 0 else "a ClientHello broken by another record")
        rec_len = struct.unpack_from("!H", data, off + 3)[0]
        if rec_len == 0 or off + 5 + rec_len > MAX_HELLO:
            raise ValueError("not a ClientHello the proxy reads (empty or over 16 KiB)")
        if len(data) < off + 5 + rec_len:
            return False
        msg += data[off + 5:off + 5 + rec_len]
        off += 5 + rec_len
        if len(msg) >= 4:
            if msg[0] != 1:
                raise ValueError("not a ClientHello")
            end = 4 + int.from_bytes(msg[1:4], "big")
            if end > MAX_HELLO:
                raise ValueError("a ClientHello over 16 KiB")
            if len(msg) >= end:
                if len(msg) > end:
                    raise ValueError("more than a ClientHello in its records")
                return _sni(msg[4:end])


def _sni(hello: bytes) -> str | None:
    """The server name in a ClientHello's body (ValueError if any length is off)."""
    r = _Reader(hello)
    r.take(2 + 32)  # version, random
    r.take(r.int(1))  # session id
    r.take(r.int(2))  # cipher suites
    r.take(r.int(1))  # compression methods
    if r.left() == 0:
        return None  # (no extensions)
    exts = _Reader(r.take(r.int(2)))
    r.end()
    name: str | None = None
    seen: set[int] = set()
    while exts.left():
        etype, body = exts.int(2), _Reader(exts.take(exts.int(2)))
        if etype in seen:
            raise ValueError(f"extension {etype} twice")
        seen.add(etype)
        if etype != 0:  # server_name
            continue
        names = _Reader(body.take(body.int(2)))
        body.end()
        while names.left():
            ntype, value = names.int(1), names.take(names.int(2))
            if ntype == 0:
                if name is not None:
                    raise ValueError("two host names")
                name = value.decode("ascii").lower()  # (UnicodeDecodeError is a ValueError)
    return name


class _Reader:
    def __init__(self, b: bytes) -> None:
        self.b, self.i = b, 0

    def left(self) -> int:
        return len(self.b) - self.i

    def take(self, n: int) -> bytes:
        if n > self.left():
            raise ValueError("a length past its end")
        out = self.b[self.i:self.i + n]
        self.i += n
        return out

    def int(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def end(self) -> None:
        if self.left():
            raise ValueError("bytes after the end")


def http_target(data: bytes) -> tuple[str | None, int | None, bool] | bool:
    """(host, port from CONNECT or Host, is CONNECT) of an HTTP/1 request head (host None
    when it has none, or none that is plainly host[:port]); False if more bytes are needed;
    raises ValueError if this is not HTTP."""
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        if len(data) > MAX_HELLO:
            raise ValueError("request head too long")
        first = data.split(b" ", 1)[0]
        if data and not (first.isalpha() and first.isupper()) and len(first) < len(data):
            raise ValueError("not HTTP")
        return False
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not HTTP")
    if parts[0] == "CONNECT":
        a = parse_authority(parts[1])
        return (a[0], a[1], True) if a else (None, None, True)
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.lower() == "host":  # (httpflow refuses "Host :" and a second Host anyway)
            a = parse_authority(v.strip())
            return (a[0], a[1], False) if a else (None, None, False)
    return None, None, False


def host_name(name: str) -> bool:
    """A DNS host name (letters, digits, '-', '_', dots), not a pattern."""
    return len(name) <= 253 and "*" not in name and bool(NAME_RE.fullmatch(name.rstrip(".")))


def reset(sock: socket.socket) -> None:
    """Close with a RST (SO_LINGER 0): the client sees its connection refused/reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class EgressProxy:
    def __init__(self, uplink: Uplink, upstream: Upstream, lookup: Lookup,
                 record: Record, host_address: Callable[[str], bool] = lambda a: False,
                 secrets: SecretStore | None = None, deny: Deny | None = None,
                 upstream_ca_file: str | None = None) -> None:
        self.uplink, self.upstream, self.lookup, self.record = uplink, upstream, lookup, record
        self.deny = deny or Deny()
        self.upstream_ca_file = upstream_ca_file
        self.host_address = host_address
        self.secrets = secrets
        self.conns: set[asyncio.Task[None]] = set()
        self.by_sid: dict[str, set[asyncio.Task[None]]] = {}
        self.open_count: dict[str, int] = {}
        self._upstream_tls: ssl.SSLContext | None = None
        # each relayed connection holds two descriptors (issue 25: cpuosd.fdbudget)
        BUDGET.count(lambda: 2 * sum(self.open_count.values()))

    def _denied(self, addr: str) -> str | None:
        """The deny sets, and the daemon's own host: its API and services are not for
        sandboxes, at any of its addresses."""
        rule = self.deny.address(addr)
        if rule is None and self.host_address(addr):
            rule = "deny an address of the daemon's host"
        return rule

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.conns.add(task)
        try:
            await self._handle(reader, writer)
        except Exception as e:
            log.debug("egress proxy: %s", e)
        finally:
            self.conns.discard(task)
            writer.close()

    def close_sandbox(self, sid: str) -> None:
        """The sandbox stopped: its connections end now (they would outlive it)."""
        for t in list(self.by_sid.pop(sid, ())):
            t.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        who = self.lookup(str(peer[0])) if peer else None
        if who is None:
            return
        sid, policy = who
        sock = writer.get_extra_info("socket")
        dst, port = original_dst(sock)
        rec: dict[str, object] = {"proto": "tcp", "dst": dst, "port": port}
        if self.open_count.get(sid, 0) >= MAX_CONNS or not BUDGET.room(2):
            self.record(sid, verdict="denied", rule=f"over {MAX_CONNS} open connections"
                        if self.open_count.get(sid, 0) >= MAX_CONNS
                        else "the daemon's descriptor budget is spent", **rec)
            reset(sock)
            return
        self.open_count[sid] = self.open_count.get(sid, 0) + 1
        task = asyncio.current_task()
        assert task is not None
        self.by_sid.setdefault(sid, set()).add(task)
        try:
            await self._serve(sid, policy, reader, writer, sock, dst, port, rec)
        except Exception as e:
            # every attempt is on record, also one that failed half-way
            if not isinstance(e, ValueError | OSError | ssl.SSLError | TimeoutError):
                log.warning("egress proxy: %s", type(e).__name__, exc_info=True)
            self.record(sid, verdict="error", rule=f"{type(e).__name__}: {str(e)[:200]}",
                        **rec)
        finally:
            self.by_sid.get(sid, set()).discard(task)
            left = self.open_count.get(sid, 1) - 1
            if left > 0:
                self.open_count[sid] = left
            else:
                self.open_count.pop(sid, None)

    async def _serve(self, sid: str, policy: Policy, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, sock: socket.socket, dst: str, port: int,
                     rec: dict[str, object]) -> None:
        allowlist = policy.mode == "allowlist"
        hello = Hello()
        if allowlist or (policy.secrets and policy.mode == "on"):
            hello = await self._hello(reader, allowlist)
        name = hello.name
        if name and not allowlist and not host_name(name):
            name = None  # (mode on: noted for the record only; no secrets for it)
        tunnel = allowlist and hello.connect  # (only allowlist answers CONNECT itself)
        if tunnel and hello.port:
            port = hello.port
            rec["port"] = port
        rule = self.deny.port(port)
        if rule is None and allowlist:
            rule = hello.why or await self._allowlist_rule(policy, name, rec)
        elif rule is None:
            rule = self._denied(dst) or (None if policy.mode == "on" else
                                         f"network {policy.mode}")
        if name:
            rec["name"] = name
        if rule is not None:
            self.record(sid, verdict="denied", rule=rule, **rec)
            reset(sock)
            return
        head = hello.data
        if tunnel:
            assert name is not None
            # answered at once; what the tunnel carries is checked before a connection is
            # made for it
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            head = head[head.find(b"\r\n\r\n") + 4:]
            head, rule = await self._tunnel(reader, head, name)
            if rule is not None:
                self.record(sid, verdict="denied", rule=rule, **rec)
                reset(sock)
                return
        addr = str(rec["dst"])
        client = PlainStream(reader, writer, ack=quickack)
        tls = head[:1] == b"\x16"
        # secrets only into TLS we end and re-open to the name itself, verified: never on
        # plaintext (the sandbox chooses where a plaintext connection goes)
        subs = self._substitutions(policy, name) if tls else {}
        if subs and policy.ca and self.secrets is not None and name:
            rec["secrets"] = len(subs)
            o = await self._mitm(client, head, addr, port, name, policy.ca, subs)
        elif allowlist and not tls:
            o = await relay_http(client, head, lambda: self._open(addr, port),
                                 Rules(name, port))
        else:
            try:
                up = await self._open(addr, port)
            except (OSError, TimeoutError) as e:
                self.record(sid, verdict="error", rule=f"connect: {e}", **rec)
                return
            try:
                sent, got = await relay(
                    client, up, head, first=(lambda b: self._sniff(b, rec))
                    if policy.mode == "on" and "name" not in rec else None)
            finally:
                up.close()
            o = Outcome(sent=sent, got=got)
        self._record(sid, rec, o)

    def _record(self, sid: str, rec: dict[str, object], o: Outcome) -> None:
        rec = {**rec, "bytes_out": o.sent, "bytes_in": o.got}
        if o.denied:
            self.record(sid, verdict="denied", rule=f"connection cut: {o.denied}", **rec)
        elif o.error:
            self.record(sid, verdict="error", rule=o.error, **rec)
        else:
            self.record(sid, verdict="allowed", **rec)

    async def _open(self, addr: str, port: int) -> PlainStream:
        sock = await self.uplink.connect(addr, port)
        ur, uw = await asyncio.open_connection(sock=sock, limit=CHUNK)
        return PlainStream(ur, uw)

    async def _tunnel(self, reader: asyncio.StreamReader, head: bytes, name: str
                      ) -> tuple[bytes, str | None]:
        """The first bytes a CONNECT tunnel carries, and why they are refused (None: they
        may go on). TLS must name the tunnel's host (no fronting another name through an
        allowed one); anything else must be HTTP (httpflow checks every request)."""
        if not head:
            try:
                async with asyncio.timeout(FIRST_BYTE_WAIT):
                    head = await reader.read(MAX_HELLO)
            except TimeoutError:
                return b"", (f"allowlist: nothing sent in the tunnel to {name!r} within "
                             f"{FIRST_BYTE_WAIT:g} s (a protocol whose server speaks first "
                             "cannot be checked)")
        if head[:1] == b"\x16":
            head, sni = await self._client_hello(reader, head)
            if sni is False:
                return head, f"allowlist: a bad ClientHello in a tunnel to {name!r}"
            if sni is None:  # (what it routes by would be up to the server)
                return head, f"allowlist: a ClientHello without a server name in a tunnel " \
                             f"to {name!r}"
            if not same_name(sni, name):
                return head, f"allowlist: TLS SNI {sni[:253]!r} in a tunnel to {name!r}"
        return head, None

    @staticmethod
    async def _client_hello(reader: asyncio.StreamReader, head: bytes
                            ) -> tuple[bytes, str | Literal[False] | None]:
        """The first bytes of a tunnel, read on until its TLS ClientHello is whole (within
        MAX_HELLO and NAME_WAIT): (bytes, its SNI or None; False if it is not a whole
        ClientHello)."""
        try:
            async with asyncio.timeout(NAME_WAIT):
                while True:
                    try:
                        sni = tls_sni(head)
                    except ValueError:
                        return head, False
                    if sni is not False:
                        return head, sni
                    more = await reader.read(max(0, MAX_HELLO - len(head)))
                    if not more:
                        return head, False
                    head += more
        except TimeoutError:
            return head, False

    def _substitutions(self, policy: Policy, name: str | None) -> dict[bytes, bytes]:
        """placeholder -> value for the secrets meant for this host (values read now, from
        the host's store; never logged)."""
        if self.secrets is None or not policy.secrets:
            return {}
        out = {}
        for token in policy.substitutions(name):
            value = self.secrets.value(token)
            if value is not None:
                out[token.encode()] = value.encode()
        return out

    def _upstream_context(self) -> ssl.SSLContext:
        if self._upstream_tls is None:
            self._upstream_tls = ssl.create_default_context(
                cafile=self.upstream_ca_file)
            self._upstream_tls.set_alpn_protocols(["http/1.1"])
        return self._upstream_tls

    async def _mitm(self, client: PlainStream, head: bytes, addr: str, port: int, name: str,
                    ca: str, subs: dict[bytes, bytes]) -> Outcome:
        """TLS for a host a secret is meant for: ended here with a certificate from the
        sandbox's CA; each request checked (its Host must be ``name``), the placeholders
        replaced in its credential headers, and sent on over a verified TLS connection of
        our own, made once the first request passed; each answer masked (httpflow)."""
        assert self.secrets is not None
        ctx = await asyncio.to_thread(self.secrets.server_context, ca, name)
        if ctx is None:
            return Outcome(error="the sandbox's CA is gone")
        async with asyncio.timeout(NAME_WAIT):
            tls = await TlsServerStream.accept(client, ctx, head)

        async def open_upstream() -> PlainStream:
            sock = await self.uplink.connect(addr, port)
            try:
                async with asyncio.timeout(NAME_WAIT):
                    ur, uw = await asyncio.open_connection(
                        sock=sock, ssl=self._upstream_context(), server_hostname=name,
                        limit=CHUNK)
            except BaseException:
                sock.close()
                raise
            return PlainStream(ur, uw)

        return await relay_http(tls, b"", open_upstream, Rules(name, port, subs))

    async def _hello(self, reader: asyncio.StreamReader, allowlist: bool) -> Hello:
        """The first bytes and the host they name. Allowlist: a client silent for
        FIRST_BYTE_WAIT is refused then (``why``), one that names nothing within NAME_WAIT
        has no name; otherwise (secrets in mode on) FIRST_BYTE_WAIT in all."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (NAME_WAIT if allowlist else FIRST_BYTE_WAIT)
        try:
            async with asyncio.timeout(FIRST_BYTE_WAIT):
                data = await reader.read(4096)
        except TimeoutError:
            return Hello(why=f"allowlist: nothing sent within {FIRST_BYTE_WAIT:g} s (a "
                             "protocol whose server speaks first has no name to check)")
        try:
            async with asyncio.timeout_at(deadline):
                while data and len(data) <= MAX_HELLO:
                    try:
                        sni = tls_sni(data)
                        if sni is not False:
                            return Hello(data, sni if isinstance(sni, str) else None)
                    except ValueError:
                        try:
                            target = http_target(data)
                        except ValueError:
                            break
                        if target is not False:
                            assert not isinstance(target, bool)
                            return Hello(data, target[0], target[1], target[2])
                    chunk = await reader.read(4096)
                    if not chunk:
                        break
                    data += chunk
        except TimeoutError:
            pass
        return Hello(data)

    async def _allowlist_rule(self, policy: Policy, name: str | None,
                              rec: dict[str, object]) -> str | None:
        if not name:
            return "allowlist: no host name (TLS SNI, HTTP Host or CONNECT) in the request"
        if is_ip(name):
            return "allowlist: an address, not a name"
        if not host_name(name):
            return f"allowlist: {name[:100]!r} is not a host name"
        if not policy.allows_name(name):
            return "not in the allowlist"
        try:
            addrs = await self.upstream.resolve(name)
        except Exception as e:
            return f"allowlist: resolving {name} failed ({type(e).__name__})"
        if not addrs:
            return f"allowlist: {name} has no address"
        for a in addrs:
            bad = self._denied(a)
            if bad:
                rec["dst"] = a
                return f"{name} resolves to {a} ({bad})"
        rec["dst"] = addrs[0]
        return None

    @staticmethod
    def _sniff(chunk: bytes, rec: dict[str, object]) -> None:
        with contextlib.suppress(ValueError):
            sni = tls_sni(chunk)
            if isinstance(sni, str):
                rec["name"] = sni
                return
        with contextlib.suppress(ValueError):
            t = http_target(chunk)
            if isinstance(t, tuple) and t[0]:
                rec["name"] = t[0]


@dataclass
class Hello:
    """What a connection's first bytes say: the bytes, the host they name (TLS SNI, HTTP
    Host or CONNECT), the CONNECT's port, and why there is no name when the client sent
    nothing."""

    data: bytes = b""
    name: str | None = None
    port: int | None = None
    connect: bool = False
    why: str | None = None
