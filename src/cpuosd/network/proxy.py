"""The egress proxy: every TCP connection a sandbox opens (redirected here by firewall.py,
its original destination read back with SO_ORIGINAL_DST) is decided and relayed here.

- The mail ports and the deny sets are refused in every mode.
- ``on``: the original destination, if it is in no deny set; the name (TLS SNI or HTTP
  Host, when the client speaks first) is noted for the record.
- ``allowlist``: the name is required (TLS SNI, HTTP Host, or an HTTP CONNECT's authority),
  must be allowed, and is resolved here: every address it resolves to must be outside the
  deny sets, and the connection goes to that address, never to the one the sandbox chose
  (so a rebinding answer or a name like 169.254.169.254.nip.io gains nothing). The proxy is
  a TCP relay: it never follows a redirect (a redirect is a new connection, checked anew).
Every connection is recorded: destination, port, name, verdict and rule, bytes each way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import struct
from collections.abc import Callable

from .dns import Upstream
from .secrets import HeaderRewriter, NotHttp, Scrubber, SecretStore
from .policy import Policy, denied_address, denied_port
from ..fdbudget import BUDGET
from ..proxy.preview import quickack
from .uplink import Uplink

log = logging.getLogger("cpuosd.network")
SO_ORIGINAL_DST = 80
MAX_HELLO = 16 * 1024
NAME_WAIT = 10.0  # s an allowlisted connection may take to name its host
CHUNK = 256 * 1024
MAX_CONNS = 512  # open connections per sandbox through the proxy

Lookup = Callable[[str], tuple[str, Policy] | None]
Record = Callable[..., None]


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


def tls_sni(data: bytes) -> str | bool | None:
    """The server name of a TLS ClientHello: the name, None if it has none, False if more
    bytes are needed; raises ValueError if this is not a ClientHello."""
    if len(data) < 5:
        return False
    if data[0] != 0x16:
        raise ValueError("not TLS")
    rec_len = struct.unpack_from("!H", data, 3)[0]
    if len(data) < 5 + rec_len:
        return False if 5 + rec_len <= MAX_HELLO else None
    p = data[5:5 + rec_len]
    if len(p) < 4 or p[0] != 1:
        raise ValueError("not a ClientHello")
    i = 4 + 2 + 32  # handshake header, version, random
    try:
        i += 1 + p[i]  # session id
        i += 2 + struct.unpack_from("!H", p, i)[0]  # cipher suites
        i += 1 + p[i]  # compression methods
        end = i + 2 + struct.unpack_from("!H", p, i)[0]
        i += 2
        while i + 4 <= min(end, len(p)):
            etype, elen = struct.unpack_from("!HH", p, i)
            i += 4
            if etype == 0:  # server_name
                j = i + 2
                while j + 3 <= i + elen:
                    ntype, nlen = p[j], struct.unpack_from("!H", p, j + 1)[0]
                    j += 3
                    if ntype == 0:
                        return p[j:j + nlen].decode("ascii", "strict").lower()
                    j += nlen
                return None
            i += elen
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def http_target(data: bytes) -> tuple[str | None, int | None, bool] | bool:
    """(host, port from CONNECT or Host, is CONNECT) of an HTTP/1 request head; False if
    more bytes are needed; raises ValueError if this is not HTTP."""
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
        host, port = _authority(parts[1])
        return host, port, True
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "host":
            host, port = _authority(v.strip())
            return host, port, False
    return None, None, False


def _authority(a: str) -> tuple[str | None, int | None]:
    if a.startswith("["):
        host, _, rest = a[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = a.partition(":")
    p = int(port) if port.isdigit() and len(port) <= 5 else None
    return (host.lower() or None), (p if p is not None and 0 < p < 65536 else None)


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
                 secrets: SecretStore | None = None) -> None:
        self.uplink, self.upstream, self.lookup, self.record = uplink, upstream, lookup, record
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
        rule = denied_address(addr)
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
        except (NotHttp, ValueError, OSError, ssl.SSLError, TimeoutError) as e:
            # every attempt is on record, also one that failed half-way
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
        head = b""
        name: str | None = None
        connect_req = False
        if policy.mode == "allowlist" or (policy.secrets and policy.mode == "on"):
            head, name, cport, connect_req = await self._name(
                reader, NAME_WAIT if policy.mode == "allowlist" else 2.0)
            if connect_req and cport:
                port = cport
                rec["port"] = port
        rule = denied_port(port)
        if rule is None and policy.mode == "allowlist":
            rule = await self._allowlist_rule(policy, name, rec)
        elif rule is None:
            rule = self._denied(dst) or (None if policy.mode == "on" else
                                         f"network {policy.mode}")
        if name:
            rec["name"] = name
        if rule is not None:
            self.record(sid, verdict="denied", rule=rule, **rec)
            reset(sock)
            return
        try:
            up = await self.uplink.connect(str(rec["dst"]), port)
        except (OSError, TimeoutError) as e:
            self.record(sid, verdict="error", rule=f"connect: {e}", **rec)
            return
        if connect_req:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if len(head) > 0 and head.find(b"\r\n\r\n") >= 0:
                head = head[head.find(b"\r\n\r\n") + 4:]
            if not head:
                async with asyncio.timeout(NAME_WAIT):
                    head = await reader.read(MAX_HELLO)
            # allowlist: the TLS inside the tunnel names the approved host, or nothing (no
            # fronting another name through an allowed one)
            sni: str | bool | None = None
            if policy.mode == "allowlist" and head[:1] == b"\x16":
                head, sni = await self._client_hello(reader, head)
            if sni is False or (isinstance(sni, str) and name and
                                sni.rstrip(".").lower() != name.rstrip(".").lower()):
                up.close()
                what = f"TLS SNI {sni[:253]!r}" if isinstance(sni, str) else "a bad ClientHello"
                self.record(sid, verdict="denied", rule=f"allowlist: {what} in a tunnel to "
                            f"{name!r}", **rec)
                reset(sock)
                return
        # secrets only into TLS we end and re-open to the name itself, verified: never on
        # plaintext (the sandbox chooses where a plaintext connection goes)
        subs = self._substitutions(policy, name) if head[:1] == b"\x16" else {}
        guard = self._host_guard(policy, name)
        if subs and policy.ca and self.secrets is not None:
            rec["secrets"] = len(subs)
            sent, got = await self._mitm(reader, writer, head, up, str(name), policy.ca, subs,
                                         guard)
            self.record(sid, verdict="allowed", bytes_out=sent, bytes_in=got, **rec)
            return
        ur, uw = await asyncio.open_connection(sock=up, limit=CHUNK)
        # allowlist, plaintext HTTP: every request on the connection names the approved host
        check = (HeaderRewriter({}, guard).feed
                 if guard is not None and head[:1] != b"\x16" and not connect_req else None)
        sent, got = await self._relay(reader, writer, ur, uw, head,
                                      sniff=policy.mode == "on", rec=rec, rewrite=check)
        self.record(sid, verdict="allowed", bytes_out=sent, bytes_in=got, **rec)

    @staticmethod
    async def _client_hello(reader: asyncio.StreamReader, head: bytes
                            ) -> tuple[bytes, str | bool | None]:
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
                    if sni is not False or len(head) >= MAX_HELLO:
                        return head, sni
                    more = await reader.read(MAX_HELLO - len(head))
                    if not more:
                        return head, False
                    head += more
        except TimeoutError:
            return head, False

    @staticmethod
    def _host_guard(policy: Policy, name: str | None) -> Callable[[str | None], None] | None:
        """In allowlist mode: a check that a request's Host is the approved name."""
        if policy.mode != "allowlist" or not name:
            return None

        def check(host: str | None) -> None:
            if host is not None and host != name:
                raise NotHttp(f"a request for {host!r} on a connection to {name!r}")
        return check

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

    async def _mitm(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    head: bytes, up: socket.socket, name: str, ca: str,
                    subs: dict[bytes, bytes], guard: Callable[[str | None], None] | None
                    ) -> tuple[int, int]:
        """TLS for a host a secret is meant for: terminated here with a certificate from the
        sandbox's CA, the placeholders replaced in the request headers, and sent on over a
        verified TLS connection of our own."""
        assert self.secrets is not None
        ctx = await asyncio.to_thread(self.secrets.server_context, ca, name)
        if ctx is None:
            up.close()
            return 0, 0
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(inc, out, server_side=True)
        inc.write(head)
        async with asyncio.timeout(NAME_WAIT):
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    if out.pending:
                        writer.write(out.read())
                        await writer.drain()
                    data = await reader.read(CHUNK)
                    if not data:
                        up.close()
                        return 0, 0
                    inc.write(data)
        if out.pending:
            writer.write(out.read())
        if self._upstream_tls is None:
            self._upstream_tls = ssl.create_default_context(
                cafile=os.environ.get("CPUOS_UPSTREAM_CA_FILE"))
            self._upstream_tls.set_alpn_protocols(["http/1.1"])
        async with asyncio.timeout(NAME_WAIT):
            ur, uw = await asyncio.open_connection(sock=up, ssl=self._upstream_tls,
                                                   server_hostname=name, limit=CHUNK)
        rewrite = HeaderRewriter(subs, guard)
        scrub = Scrubber(subs)
        counts = [0, 0]

        async def to_server() -> None:
            try:
                while True:
                    try:
                        data = tls.read(CHUNK)
                    except ssl.SSLWantReadError:
                        raw = await reader.read(CHUNK)
                        if not raw:
                            break
                        inc.write(raw)
                        if out.pending:
                            writer.write(out.read())
                        continue
                    if not data:
                        break
                    counts[0] += len(data)
                    uw.write(rewrite.feed(data))
                    await uw.drain()
            except (ssl.SSLError, ConnectionError, OSError, NotHttp):
                pass
            finally:
                uw.close()

        async def to_client() -> None:
            try:
                while True:
                    data = await ur.read(CHUNK)
                    if not data:
                        break
                    counts[1] += len(data)
                    clean = scrub.feed(data)  # a value echoed back is the placeholder again
                    if clean:
                        tls.write(clean)
                    writer.write(out.read())
                    await writer.drain()
                rest = scrub.flush()
                if rest:
                    tls.write(rest)
                with contextlib.suppress(ssl.SSLError):
                    tls.unwrap()
                writer.write(out.read())
            except (ssl.SSLError, ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.write_eof()

        await asyncio.gather(to_server(), to_client())
        return counts[0], counts[1]

    async def _name(self, reader: asyncio.StreamReader, wait: float = NAME_WAIT
                    ) -> tuple[bytes, str | None, int | None, bool]:
        """The first bytes and the host they name: (bytes, name, CONNECT port, is CONNECT)."""
        data = b""
        try:
            async with asyncio.timeout(wait):
                while len(data) <= MAX_HELLO:
                    chunk = await reader.read(4096)
                    if not chunk:
                        break
                    data += chunk
                    try:
                        sni = tls_sni(data)
                        if sni is not False:
                            return data, sni if isinstance(sni, str) else None, None, False
                        continue
                    except ValueError:
                        pass
                    try:
                        target = http_target(data)
                    except ValueError:
                        break
                    if target is not False:
                        assert not isinstance(target, bool)
                        host, cport, is_connect = target
                        return data, host, cport, is_connect
        except TimeoutError:
            pass
        return data, None, None, False

    async def _allowlist_rule(self, policy: Policy, name: str | None,
                              rec: dict[str, object]) -> str | None:
        if not name:
            return "allowlist: no host name (TLS SNI, HTTP Host or CONNECT) in the request"
        if is_ip(name):
            return "allowlist: an address, not a name"
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

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                     ur: asyncio.StreamReader, uw: asyncio.StreamWriter, head: bytes, *,
                     sniff: bool, rec: dict[str, object],
                     rewrite: Callable[[bytes], bytes] | None = None) -> tuple[int, int]:
        counts = [0, 0]

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, i: int,
                       first: bytes) -> None:
            edit = rewrite if i == 0 else None
            try:
                if first:
                    w.write(edit(first) if edit else first)
                    counts[i] += len(first)
                    await w.drain()
                while True:
                    chunk = await r.read(CHUNK)
                    if i == 0:  # from the sandbox: ACK at once (see preview.quickack)
                        quickack(cw)
                    if not chunk:
                        break
                    if sniff and i == 0 and counts[0] == 0 and "name" not in rec:
                        self._sniff(chunk, rec)
                    counts[i] += len(chunk)
                    w.write(edit(chunk) if edit else chunk)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            except NotHttp as e:  # allowlist: a request for another host; the rest is cut
                rec["rule"] = f"connection ended: {e}"
                cw.transport.abort()
                uw.transport.abort()
            finally:
                with contextlib.suppress(Exception):
                    if w.can_write_eof():
                        w.write_eof()

        try:
            await asyncio.gather(pump(cr, uw, 0, head), pump(ur, cw, 1, b""))
        finally:
            uw.close()
        return counts[0], counts[1]

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
