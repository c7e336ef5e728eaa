"""HTTP/1.x through the egress proxy, request by request, in both directions (h11).

Where the proxy must know what each request names (``allowlist`` plaintext HTTP, also inside
a CONNECT tunnel; every TLS connection it ends to put secrets in), it does not relay bytes:
it parses every request the sandbox sends and every response the server sends back, checks
each request, and writes both out again in h11's canonical form. What it cannot parse it
does not pass. So:

- every request must name the connection's approved host: its Host (exactly one; HTTP/1.0
  without one gets the approved name), an absolute-form target's authority and a CONNECT's
  authority alike. A name is compared after lower-casing and one trailing dot; a port, where
  one is given, must be the connection's; userinfo, spaces or anything else in an authority
  refuse the request;
- framing is unambiguous: h11 refuses conflicting Content-Lengths, a transfer coding other
  than chunked, bad chunks, overlong heads (``MAX_HEAD``) and unknown HTTP versions, and
  the proxy refuses a request with both Content-Length and Transfer-Encoding; what goes on
  is re-framed by h11, so a server never sees bytes the proxy read differently;
- pipelined requests wait for the answer to the one before (h11 reads the next request
  once the exchange before it is over), so each is checked in turn;
- an ``Upgrade`` (or a CONNECT to the approved name) hands the connection over to raw
  bytes only when the server answers 101 (2xx to CONNECT); any other answer keeps every
  request checked;
- a refused request ends the connection with a 403 that says why (``Refused``); the
  proxy's record says ``denied`` with the reason.

On a connection carrying secrets (``Rules.subs``), the placeholders are replaced in the
credential headers only, ``Accept-Encoding: identity`` is asked of the server, and every
answer is masked before the sandbox sees it (status line, headers, body, trailers): a body
the server compresses anyway (gzip, deflate) is decoded here, in bounded pieces, then
masked; any other content coding is refused (502). Only a WebSocket upgrade is let through
there (its compression extension removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import h11

from .relay import CHUNK, PlainStream, Stream, relay
from .secrets import CREDENTIAL_HEADERS, Scrubber

MAX_HEAD = 64 * 1024  # one request or response head (h11's max_incomplete_event_size)
FIRST_REQUEST_WAIT = 10.0  # s the first request head may take to arrive
AUTHORITY = re.compile(r"^(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9_.-]+))(?::([0-9]{1,5}))?$")
SCHEME = re.compile(rb"^[A-Za-z][A-Za-z0-9+.-]*://")
DECODABLE = {"gzip", "x-gzip", "deflate"}


class Refused(Exception):
    """The proxy will not pass this: the connection ends, the record says why."""


class TlsServerStream:
    """The sandbox's side of a TLS connection the proxy ends: an SSLObject over memory BIOs
    on its plain stream (whose first bytes, the ClientHello, were read already)."""

    def __init__(self, plain: PlainStream, tls: ssl.SSLObject, inc: ssl.MemoryBIO,
                 out: ssl.MemoryBIO) -> None:
        self.plain, self.tls, self.inc, self.out = plain, tls, inc, out

    @classmethod
    async def accept(cls, plain: PlainStream, ctx: ssl.SSLContext, first: bytes
                     ) -> TlsServerStream:
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(inc, out, server_side=True)
        inc.write(first)
        self = cls(plain, tls, inc, out)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                await plain.drain()
                data = await plain.read(CHUNK)
                if not data:
                    raise ConnectionError("the sandbox closed during the TLS handshake") from None
                inc.write(data)
        self._flush()
        return self

    def _flush(self) -> None:
        if self.out.pending:
            self.plain.write(self.out.read())

    async def read(self, n: int) -> bytes:
        while True:
            try:
                data = self.tls.read(n)
                self._flush()
                return data
            except ssl.SSLWantReadError:
                self._flush()
                raw = await self.plain.read(CHUNK)
                if raw:
                    self.inc.write(raw)
                else:
                    self.inc.write_eof()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.tls.write(data)
        self._flush()

    async def drain(self) -> None:
        await self.plain.drain()

    def write_eof(self) -> None:
        with contextlib.suppress(ssl.SSLError):
            self.tls.unwrap()  # (close_notify; the sandbox's own is not waited for)
        self._flush()
        self.plain.write_eof()

    def abort(self) -> None:
        self.plain.abort()

    def close(self) -> None:
        self.plain.close()


def parse_authority(a: str) -> tuple[str, int | None] | None:
    """(host, port) of ``host[:port]`` / ``[v6]:port``: lower case, one trailing dot gone;
    None for anything else (userinfo, spaces, an empty or bad port...)."""
    m = AUTHORITY.fullmatch(a)
    if m is None:
        return None
    host = (m.group(1) or m.group(2) or "").lower()
    if host.endswith("."):
        host = host[:-1]
    port = int(m.group(3)) if m.group(3) is not None else None
    if not host or (port is not None and not 0 < port < 65536):
        return None
    return host, port


def same_name(a: str, b: str) -> bool:
    return a.lower().removesuffix(".") == b.lower().removesuffix(".")


@dataclass
class Rules:
    """What every request on a connection must be. ``name``: the approved host (None: not
    checked); ``port``: the connection's destination port; ``subs``: placeholder -> value
    for the secrets meant for ``name`` (a connection the proxy ended TLS for)."""

    name: str | None
    port: int
    subs: dict[bytes, bytes] = field(default_factory=dict)


def check_request(req: h11.Request, rules: Rules) -> h11.Request:
    """The request as it goes on, or Refused: it names another host, or cannot be read one
    way only."""
    if req.http_version not in (b"1.0", b"1.1"):
        raise Refused(f"HTTP/{req.http_version.decode('latin-1')[:8]} is not HTTP/1.x")
    raw = list(req.headers.raw_items())
    if len(req.target) + sum(len(k) + len(v) + 4 for k, v in raw) > MAX_HEAD:
        raise Refused(f"a request head over {MAX_HEAD // 1024} KiB")
    hosts = [v for k, v in raw if k.lower() == b"host"]
    names = {k.lower() for k, _ in raw}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise Refused("a request with both Content-Length and Transfer-Encoding")
    target = bytes(req.target)
    authorities: list[tuple[str, bytes]] = [("Host", h) for h in hosts]
    if req.method == b"CONNECT":
        authorities.append(("CONNECT", target))
    elif SCHEME.match(target):
        rest = target.split(b"://", 1)[1]
        authorities.append(("the request target", re.split(rb"[/?#]", rest, maxsplit=1)[0]))
    elif not (target.startswith(b"/") or (target == b"*" and req.method == b"OPTIONS")):
        raise Refused(f"request target {target[:80]!r}")
    if rules.name is not None:
        for what, value in authorities:
            a = parse_authority(value.decode("latin-1"))
            if a is None:
                raise Refused(f"{what} {value[:100].decode('latin-1')!r} is not host[:port]")
            host, port = a
            if not same_name(host, rules.name):
                raise Refused(f"a request for {host[:253]!r} on a connection to "
                              f"{rules.name!r}")
            if what != "CONNECT" and port is not None and port != rules.port:
                raise Refused(f"a request for port {port} on a connection to port "
                              f"{rules.port}")
        # the Host goes on as the approved name itself (HTTP/1.0 without one gets it: h11
        # requires it of HTTP/1.1), so no spelling of it is left to a server to read its way
        given_port = bool(hosts) and b":" in hosts[0].rsplit(b"]", 1)[-1]
        approved = rules.name.encode() + (b":%d" % rules.port if given_port else b"")
        raw = [(k, approved) if k.lower() == b"host" else (k, v) for k, v in raw]
        if not hosts:
            raw.append((b"Host", approved))
    if rules.subs:
        raw = _with_secrets(req, raw, rules.subs)
    return h11.Request(method=req.method, target=target, headers=raw)  # (sent as HTTP/1.1)


def _with_secrets(req: h11.Request, raw: list[tuple[bytes, bytes]],
                  subs: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Placeholders replaced in credential headers; the answer asked for uncompressed."""
    if req.method == b"CONNECT":
        raise Refused("CONNECT on a connection carrying secrets")
    upgrade = [v.strip().lower() for k, v in raw if k.lower() == b"upgrade"]
    if upgrade and upgrade != [b"websocket"]:
        raise Refused("an Upgrade other than websocket on a connection carrying secrets")
    out: list[tuple[bytes, bytes]] = []
    for k, v in raw:
        lk = k.lower()
        if lk in (b"accept-encoding", b"te", b"sec-websocket-extensions"):
            continue  # (compression would hide an echoed value from the mask)
        if lk in CREDENTIAL_HEADERS:
            for ph, value in subs.items():
                v = v.replace(ph, value)
        out.append((k, v))
    out.append((b"Accept-Encoding", b"identity"))
    return out


class Decoder:
    """A gzip or deflate body decoded in pieces of at most CHUNK (an answer that inflates to
    gigabytes is passed on piece by piece, never held)."""

    def __init__(self) -> None:
        self.z = zlib.decompressobj(zlib.MAX_WBITS | 32)  # (gzip or zlib header)

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data:
            try:
                piece = self.z.decompress(data, CHUNK)
            except zlib.error as e:
                raise Refused(f"a compressed answer that does not decode ({e})") from None
            if piece:
                yield piece
            if self.z.eof:  # (a gzip file may have several members)
                data = self.z.unused_data
                self.z = zlib.decompressobj(zlib.MAX_WBITS | 32)
            else:
                data = self.z.unconsumed_tail

    def end(self) -> Iterator[bytes]:
        while piece := self.z.flush(CHUNK):
            yield piece


class AnswerMask:
    """The answers on a connection carrying secrets, each value masked (Scrubber): status
    line, headers, body, trailers; a gzip/deflate body decoded first, any other coding
    refused."""

    def __init__(self, subs: dict[bytes, bytes]) -> None:
        self.subs = subs
        self.scrub = Scrubber(subs)
        self.decoder: Decoder | None = None

    def head(self, ev: h11.Response | h11.InformationalResponse
             ) -> h11.Response | h11.InformationalResponse:
        self.scrub = Scrubber(self.subs)
        self.decoder = None
        raw = [(self.scrub.mask(bytes(k)), self.scrub.mask(bytes(v)))
               for k, v in ev.headers.raw_items()]
        codings = [c.strip().lower() for k, v in raw if k.lower() == b"content-encoding"
                   for c in v.decode("latin-1").split(",") if c.strip()]
        codings = [c for c in codings if c != "identity"]
        if codings:
            if len(codings) > 1 or codings[0] not in DECODABLE:
                raise Refused(f"a {', '.join(codings)[:60]} answer on a connection carrying "
                              "secrets (the proxy decodes gzip and deflate only)")
            self.decoder = Decoder()
            raw = [(k, v) for k, v in raw
                   if k.lower() not in (b"content-encoding", b"content-length")]
        reason = self.scrub.mask(bytes(ev.reason))
        if isinstance(ev, h11.InformationalResponse):
            return h11.InformationalResponse(status_code=ev.status_code, headers=raw,
                                             reason=reason)
        return h11.Response(status_code=ev.status_code, headers=raw, reason=reason)

    def data(self, data: bytes) -> Iterator[bytes]:
        for piece in (self.decoder.feed(data) if self.decoder is not None else (data,)):
            if clean := self.scrub.feed(piece):
                yield clean

    def end(self) -> Iterator[bytes]:
        for piece in (self.decoder.end() if self.decoder is not None else ()):
            if clean := self.scrub.feed(piece):
                yield clean
        if rest := self.scrub.flush():
            yield rest

    def trailers(self, ev: h11.EndOfMessage) -> h11.EndOfMessage:
        return h11.EndOfMessage(headers=[(k, self.scrub.mask(bytes(v)))
                                         for k, v in ev.headers.raw_items()])


@dataclass
class Outcome:
    sent: int = 0  # bytes from the sandbox
    got: int = 0  # bytes from the server
    requests: int = 0
    denied: str | None = None  # the proxy refused something and cut the connection
    error: str | None = None  # the server or the connection failed
    switched: bool = False  # handed over to raw bytes after a 101 / 2xx to CONNECT


Opener = Callable[[], Awaitable[Stream]]


def _answer(srv: h11.Connection, status: int, text: str) -> list[bytes]:
    """An answer of the proxy's own to the sandbox, if h11 lets one be sent now."""
    body = f"cpuos egress proxy: {text}\n".encode()
    try:
        return [srv.send(h11.Response(status_code=status, headers=[
                    (b"Content-Type", b"text/plain; charset=utf-8"),
                    (b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]))
                or b"", srv.send(h11.Data(data=body)) or b"", srv.send(h11.EndOfMessage()) or b""]
    except h11.LocalProtocolError:
        return []


class _Exchange:
    """One connection's requests and answers (see relay_http)."""

    def __init__(self, client: Stream, open_upstream: Opener, rules: Rules) -> None:
        self.client, self.open_upstream, self.rules = client, open_upstream, rules
        self.o = Outcome()
        self.srv = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.cli = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.mask = AnswerMask(rules.subs) if rules.subs else None
        self.changed = asyncio.Event()
        self.up: Stream | None = None
        self.up_ready = asyncio.Event()
        self.client_eof = False
        self.awaiting = 0  # requests sent on whose answers are not over yet

    def next_cycle(self) -> bool:
        srv, cli = self.srv, self.cli
        if (srv.our_state is h11.DONE and srv.their_state is h11.DONE
                and cli.our_state is h11.DONE and cli.their_state is h11.DONE):
            srv.start_next_cycle()
            cli.start_next_cycle()
            self.changed.set()
            return True
        return False

    def send_up(self, ev: h11.Event) -> None:
        assert self.up is not None
        for piece in self.cli.send_with_data_passthrough(ev) or ():
            self.up.write(piece)

    def send_back(self, ev: h11.Event) -> None:
        for piece in self.srv.send_with_data_passthrough(ev) or ():
            self.client.write(piece)

    async def _read_client(self) -> None:
        if self.up is None:  # (the first request: its head within FIRST_REQUEST_WAIT)
            try:
                async with asyncio.timeout(FIRST_REQUEST_WAIT):
                    data = await self.client.read(CHUNK)
            except TimeoutError:
                raise Refused(f"no whole HTTP request within {FIRST_REQUEST_WAIT:g} s"
                              ) from None
        else:
            data = await self.client.read(CHUNK)
        self.o.sent += len(data)
        self.client_eof = not data
        self.srv.receive_data(data)

    async def requests(self) -> None:
        srv = self.srv
        while True:
            ev = srv.next_event()
            if ev is h11.NEED_DATA:
                await self._read_client()
                continue
            if ev is h11.PAUSED:
                if srv.their_state is h11.SWITCHED_PROTOCOL:
                    return
                if not self.next_cycle():  # (else the next exchange may begin)
                    self.changed.clear()
                    await self.changed.wait()
                continue
            if isinstance(ev, h11.Request):
                req = check_request(ev, self.rules)
                self.o.requests += 1
                self.awaiting += 1
                if self.up is None:
                    await self._connect()
                self.send_up(req)
            elif isinstance(ev, h11.Data):
                self.send_up(ev)
            elif isinstance(ev, h11.EndOfMessage):
                self.send_up(ev)
                self.next_cycle()
            elif isinstance(ev, h11.ConnectionClosed):
                if self.up is not None:
                    self.up.write_eof()
                return
            if self.up is not None:
                await self.up.drain()

    async def _connect(self) -> None:
        try:
            self.up = await self.open_upstream()
        except (OSError, TimeoutError, ssl.SSLError) as e:
            self.o.error = f"connect: {type(e).__name__}: {str(e)[:160]}"
            for piece in _answer(self.srv, 502, f"connecting to {self.rules.name or 'the server'} "
                                 "failed"):
                self.client.write(piece)
            raise _Stop() from None
        self.up_ready.set()

    async def answers(self) -> None:
        await self.up_ready.wait()
        up, cli, srv, mask = self.up, self.cli, self.srv, self.mask
        assert up is not None
        while True:
            ev = cli.next_event()
            if ev is h11.NEED_DATA:
                data = await up.read(CHUNK)
                self.o.got += len(data)
                cli.receive_data(data)
                continue
            if ev is h11.PAUSED:
                if cli.their_state is h11.SWITCHED_PROTOCOL:
                    return
                self.changed.clear()
                await self.changed.wait()
                continue
            if isinstance(ev, h11.InformationalResponse | h11.Response):
                self.send_back(mask.head(ev) if mask is not None else ev)
                if srv.our_state is h11.SWITCHED_PROTOCOL:
                    self.o.switched = True
                    self.changed.set()
                    return
            elif isinstance(ev, h11.Data):
                if mask is None:
                    self.send_back(ev)
                else:
                    for piece in mask.data(bytes(ev.data)):
                        self.send_back(h11.Data(data=piece))
                        await self.client.drain()
            elif isinstance(ev, h11.EndOfMessage):
                if mask is not None:
                    for piece in mask.end():
                        self.send_back(h11.Data(data=piece))
                        await self.client.drain()
                    ev = mask.trailers(ev)
                self.send_back(ev)
                self.awaiting -= 1
                self.next_cycle()
                if (srv.our_state is h11.MUST_CLOSE or cli.their_state is h11.MUST_CLOSE
                        or (self.client_eof and not self.awaiting)):
                    return  # (no further exchange on this connection)
            elif isinstance(ev, h11.ConnectionClosed):
                return
            await self.client.drain()

    def _failed(self, which: str, e: BaseException) -> None:
        """What ended one direction, into the outcome (and an answer to the sandbox)."""
        o = self.o
        if isinstance(e, Refused):
            o.denied = str(e)
            status = 403 if which == "requests" else 502
            for piece in _answer(self.srv, status, f"refused: {e}"):
                self.client.write(piece)
        elif isinstance(e, h11.RemoteProtocolError) and which == "requests":
            if e.error_status_hint == 431:  # (h11: a head still incomplete past MAX_HEAD;
                # the same refusal as a whole head over it, however the bytes arrived)
                o.denied = f"a request head over {MAX_HEAD // 1024} KiB"
                for piece in _answer(self.srv, 403, f"refused: {o.denied}"):
                    self.client.write(piece)
            elif not self.client_eof:  # (a request cut short by the sandbox is no attack)
                o.denied = f"not HTTP/1.x the proxy can follow: {e}"
                for piece in _answer(self.srv, 400, o.denied):
                    self.client.write(piece)
        elif isinstance(e, h11.ProtocolError):
            o.error = (f"the server's answer is not HTTP/1.x the proxy can follow: {e}"
                       if which == "answers" else f"HTTP exchange: {e}")
        elif not isinstance(e, (_Stop, ConnectionError, OSError, ssl.SSLError)):
            raise e

    async def run(self, first: bytes) -> Outcome:
        if first:
            self.o.sent += len(first)
            self.srv.receive_data(first)
        t_req = asyncio.ensure_future(self.requests())
        t_ans = asyncio.ensure_future(self.answers())
        names = {t_req: "requests", t_ans: "answers"}
        pending = {t_req, t_ans}
        try:
            while pending:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    e = None if t.cancelled() else t.exception()
                    if e is not None:
                        self._failed(names[t], e)
                        for p in pending:
                            p.cancel()
                    elif t is t_req and not self.awaiting:
                        t_ans.cancel()  # the sandbox is done, and no answer is due
                    elif t is t_ans and not self.o.switched:
                        t_req.cancel()  # the server is done with this connection
            o = self.o
            if o.denied or o.error:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.client.drain(), 5)
                self.client.abort()
                if self.up is not None:
                    self.up.abort()
                return o
            if o.switched:
                assert self.up is not None
                scrub = Scrubber(self.rules.subs) if self.rules.subs else None
                sent, got = await relay(self.client, self.up,
                                        bytes(self.srv.trailing_data[0]),
                                        bytes(self.cli.trailing_data[0]), scrub=scrub)
                o.sent += sent
                o.got += got
                return o
            self.client.write_eof()
            return o
        finally:
            for t in (t_req, t_ans):
                t.cancel()
            if self.up is not None:
                self.up.close()


async def relay_http(client: Stream, first: bytes, open_upstream: Opener, rules: Rules
                     ) -> Outcome:
    """Requests from ``client`` (``first``: its bytes read already) to the server, answers
    back, until either side is done. The server is connected (``open_upstream``) only once
    the first request has passed its check."""
    return await _Exchange(client, open_upstream, rules).run(first)


class _Stop(Exception):
    """Ends the exchange (an answer was written already)."""
