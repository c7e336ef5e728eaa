"""Benchmark 11: the preview proxy (issue 13) beside a direct connection from the host to the
same server inside the sandbox: download throughput, the latency each request adds (new
connection per request, and keep-alive through the host form), and the time a request to a
paused sandbox takes to its response (wake on request) beside ``Sandbox.resume`` of the same
sandbox.

The server is ``python3 -m http.server --protocol HTTP/1.1`` in /work of a sandbox; the
client is the same raw-socket HTTP/1.1 client for ours and the floor (no library on the
host side). Ours: the daemon's preview listener (127.0.0.1:<preview port>) with the port's
token in ``X-Cpuos-Token``. Floor: the host connecting to the sandbox's own address (its
end of the veth the daemon made, a /30 whose host end is the gateway), which the daemon's
firewall lets the host open. No traffic leaves the host and the sandbox's namespace; the
sandbox's network mode stays ``off`` (support.daemon's default).

    .venv/bin/python bench/cases/ports.py [--quick | --smoke]
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox
from support.daemon import Daemon, wait_until

from cases._common import (FROM_SNAPSHOT, MB, Context, MiB, Row, case_main, console,
                           kill_quietly, mbps, median, ms, now, pct, table, target_row,
                           throughput_table)

SECTION = KEY = "ports"
TITLE = "11. preview proxy (ports)"
DAEMON = FROM_SNAPSHOT  # template snapshots, no pool; network mode "off" (test daemons)
PORT = 3000
MIN_RATIO = 0.7  # download throughput, through the proxy / direct
MAX_ADDED_REQUEST = 0.001  # s, p50 of a small GET on a new connection, proxy - direct
MAX_ADDED_WAKE = 0.020  # s, p50 of wake on request - Sandbox.resume
SMALL = "small.txt"  # 64 bytes
BIG = "big.bin"

# inside the sandbox: the sandbox's own IPv4 address (the source of a route to anywhere;
# a UDP connect sends nothing)
ADDRESS = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
           "s.connect(('198.51.100.1', 9)); print(s.getsockname()[0])")


# ---- the client (ours and the floor) ----------------------------------------------------

class Conn:
    """One HTTP/1.1 connection: GETs with Content-Length answers, read to the last byte
    (``recv_into`` a reused buffer, bodies counted, not kept unless asked)."""

    def __init__(self, addr: tuple[str, int], host: str, headers: dict[str, str]) -> None:
        self.sock = socket.create_connection(addr, timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host, self.headers = host, headers
        self.buf = bytearray(1 << 20)

    def close(self) -> None:
        self.sock.close()

    def get(self, path: str, keep: bool = False) -> tuple[int, int, bytes]:
        """(status, body bytes, body if ``keep``)."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{extra}\r\n".encode())
        view = memoryview(self.buf)
        head = b""
        while b"\r\n\r\n" not in head:
            n = self.sock.recv_into(view)
            if not n:
                raise RuntimeError(f"GET {path}: closed before the head ended: {head[:300]!r}")
            head += view[:n]
        head, _, rest = head.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next((int(v) for k, _, v in (x.partition(b":") for x in lines[1:])
                       if k.strip().lower() == b"content-length"), None)
        if length is None:
            raise RuntimeError(f"GET {path}: no Content-Length: {head[:300]!r}")
        got, body = len(rest), [bytes(rest)] if keep else []
        while got < length:
            n = self.sock.recv_into(view, min(len(view), length - got))
            if not n:
                raise RuntimeError(f"GET {path}: closed after {got} of {length} bytes")
            if keep:
                body.append(bytes(view[:n]))
            got += n
        return status, got, b"".join(body)


class Target:
    """Where a request goes: the preview proxy (path or host form) or the sandbox direct."""

    def __init__(self, addr: tuple[str, int], host: str, prefix: str,
                 headers: dict[str, str] | None = None) -> None:
        self.addr, self.host, self.prefix = addr, host, prefix
        self.headers = headers or {}

    def connect(self) -> Conn:
        return Conn(self.addr, self.host, self.headers)

    def once(self, name: str, keep: bool = False) -> tuple[int, int, bytes]:
        """One GET on a new connection, closed afterwards."""
        c = self.connect()
        try:
            return c.get(self.prefix + name, keep)
        finally:
            c.close()


def check(res: tuple[int, int, bytes], want: int, what: str) -> None:
    if res[0] != 200 or res[1] != want:
        raise RuntimeError(f"{what}: status {res[0]}, {res[1]} bytes (want 200, {want}): "
                           f"{res[2][:300]!r}")


# ---- the sandbox and its server ---------------------------------------------------------

def start_server(sbx: Sandbox, nbytes: int) -> None:
    r = sbx.exec(f"cd /work && head -c {nbytes} /dev/urandom > {BIG} && "
                 f"printf '%064d' 0 > {SMALL} && "
                 f"(nohup python3 -m http.server --protocol HTTP/1.1 --bind 0.0.0.0 {PORT} "
                 f">/dev/null 2>/tmp/http.log &)", timeout="5m")
    if r.exit_code != 0:
        raise RuntimeError(f"starting the server failed: {r}")


def expose(d: Daemon, sid: str) -> dict[str, Any]:
    with d.client() as c:
        r = c.post(f"/sandboxes/{sid}/ports", json={"port": PORT})
        if r.status_code != 201:
            raise RuntimeError(f"expose {PORT}: {r.status_code} {r.text}")
        out: dict[str, Any] = r.json()
        return out


def sandbox_address(sbx: Sandbox) -> str:
    r = sbx.exec(["python3", "-c", ADDRESS])
    addr = r.stdout.strip()
    if r.exit_code != 0 or not addr.startswith("10."):
        raise RuntimeError(f"the sandbox's address: {r}")
    return addr


def targets(p: dict[str, Any], sid: str, addr: str) -> dict[str, Target]:
    tok = {"X-Cpuos-Token": p["token"]}
    u, h = urlsplit(p["url"]), urlsplit(p["host_url"])
    proxy = (u.hostname or "127.0.0.1", u.port or 80)
    return {"path": Target(proxy, u.netloc, u.path, tok),
            "host": Target(proxy, h.netloc, "/", tok),
            "direct": Target((addr, PORT), f"{addr}:{PORT}", "/")}


# ---- the measurements -------------------------------------------------------------------

def downloads(ctx: Context, t: dict[str, Target], nbytes: int) -> dict[str, Any]:
    """Whole-file GETs of the big file on a new connection each, timed from connect to its
    last byte; ours (path form) and direct alternate, after one untimed each."""
    runs = ctx.pick(5, 3, 1)
    out: dict[str, Any] = {"bytes": nbytes, "runs": runs, "ours_MBps": [], "floor_MBps": []}
    sides = (("ours_MBps", t["path"]), ("floor_MBps", t["direct"]))
    for i in range(runs + 1):
        for k, tg in sides:
            t0 = now()
            res = tg.once(BIG)
            dt = now() - t0
            check(res, nbytes, f"download {k}")
            if i:
                out[k].append(nbytes / dt / MB)
        if i:
            console.print(f"  download {i}/{runs}: proxy {mbps(out['ours_MBps'][-1])}, "
                          f"direct {mbps(out['floor_MBps'][-1])}")
    return out


def latency(ctx: Context, t: dict[str, Target]) -> dict[str, Any]:
    """GETs of a 64-byte file: a new connection each (path form / direct), and one
    keep-alive connection each (host form / direct), timed from connect (new) or send
    (keep-alive) to the last byte; interleaved request by request, after warmups."""
    n, warm = ctx.pick(500, 200, 5), ctx.pick(20, 20, 2)
    out: dict[str, Any] = {"n": n, "warmup": warm}
    new = (("ours_new_s", t["path"]), ("floor_new_s", t["direct"]))
    for k, _ in new:
        out[k] = []
    for i in range(warm + n):
        for k, tg in new:
            t0 = now()
            res = tg.once(SMALL)
            dt = now() - t0
            check(res, 64, k)
            if i >= warm:
                out[k].append(dt)
    conns = {"ours_keepalive_s": t["host"].connect(), "floor_keepalive_s": t["direct"].connect()}
    try:
        for k in conns:
            out[k] = []
        for i in range(warm + n):
            for k, c in conns.items():
                t0 = now()
                res = c.get("/" + SMALL)  # host form and direct: the server's own paths
                dt = now() - t0
                check(res, 64, k)
                if i >= warm:
                    out[k].append(dt)
    finally:
        for c in conns.values():
            c.close()
    for k in ("ours_new_s", "floor_new_s", "ours_keepalive_s", "floor_keepalive_s"):
        console.print(f"  {k}: p50 {ms(median(out[k]))}, p99 {ms(pct(out[k], 99))}")
    return out


def wakes(ctx: Context, d: Daemon, sbx: Sandbox, t: dict[str, Target]
          ) -> tuple[Sandbox, dict[str, Any]]:
    """Cycles of: pause, the first request through the proxy (new connection, path form:
    it resumes the sandbox) timed to its whole response; pause again, ``Sandbox.resume``
    timed, then one request through the proxy (timed too, from before the resume). One
    untimed warmup cycle."""
    n = ctx.pick(10, 5, 1)
    kw = d.sdk_kwargs()
    keys = ("ours_wake_s", "floor_resume_s", "floor_resume_request_s")
    out: dict[str, Any] = {"n": n, **{k: [] for k in keys}}
    for i in range(n + 1):
        sbx.pause()
        t0 = now()
        res = t["path"].once(SMALL, keep=True)
        t1 = now()
        check(res, 64, "wake on request")
        sid = sbx.pause()
        t2 = now()
        resumed = Sandbox.resume(sid, **kw)
        t3 = now()
        res = t["path"].once(SMALL, keep=True)
        t4 = now()
        sbx.close()
        sbx = resumed
        check(res, 64, "request after resume")
        if i:
            for k, v in zip(keys, (t1 - t0, t3 - t2, t4 - t2), strict=True):
                out[k].append(v)
            console.print(f"  wake {i}/{n}: request to paused {ms(t1 - t0)}; "
                          f"Sandbox.resume {ms(t3 - t2)}, + request {ms(t4 - t2)}")
    return sbx, out


def measure(ctx: Context) -> dict[str, Any]:
    d = ctx.daemon(DAEMON)
    nbytes = ctx.pick(100 * MiB, 32 * MiB, 1 * MiB)
    sbx = Sandbox.create(template="python", timeout="30m", **d.sdk_kwargs())
    try:
        start_server(sbx, nbytes)
        p = expose(d, sbx.id)
        addr = sandbox_address(sbx)
        t = targets(p, sbx.id, addr)

        def up() -> bool:
            try:
                return t["direct"].once(SMALL)[0] == 200
            except OSError:
                return False
        wait_until(up, "the server inside the sandbox", 60)
        out: dict[str, Any] = {"address": addr, "preview": p["url"].split("/sandboxes/")[0]}
        out["download"] = downloads(ctx, t, nbytes)
        out["latency"] = latency(ctx, t)
        sbx, out["wake"] = wakes(ctx, d, sbx, t)
    finally:
        kill_quietly(sbx)
    return out


def report(r: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    dl = r.get("download")
    if dl:
        throughput_table(
            f"11. ports: HTTP download of {dl['bytes'] // MiB} MiB from python3 -m http.server "
            f"inside the sandbox to the host, connect → last byte ({dl['runs']} runs; "
            f"MB = 10^6 B)", dl,
            (("ours: through the preview proxy (path form, token header)", "ours_MBps"),
             ("floor: host → the sandbox's address directly", "floor_MBps")))
        o, f = median(dl["ours_MBps"]), median(dl["floor_MBps"])
        rows.append({"metric": "preview download, median", "ours": mbps(o), "floor": mbps(f),
                     "target": f"≥ {MIN_RATIO}× direct",
                     "met": "yes" if o >= MIN_RATIO * f else "no",
                     "note": f"{o / f:.2f}× direct"})
    lat = r.get("latency")
    if lat:
        t = table(f"11. ports: GET of 64 bytes from the host, to the last byte (N={lat['n']}, "
                  f"after {lat['warmup']} warmup, interleaved)", ["", "p50", "p99", "min"])
        for label, k in (("ours: new connection, path form", "ours_new_s"),
                         ("floor: new connection, direct", "floor_new_s"),
                         ("ours: keep-alive, host form", "ours_keepalive_s"),
                         ("floor: keep-alive, direct", "floor_keepalive_s")):
            xs = lat[k]
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 99)), ms(min(xs)))
        console.print(t)
        for what, ko, kf in (("new connection", "ours_new_s", "floor_new_s"),
                             ("keep-alive", "ours_keepalive_s", "floor_keepalive_s")):
            o, f = median(lat[ko]), median(lat[kf])
            row = target_row(f"preview GET, {what}, p50", o, f, f + MAX_ADDED_REQUEST,
                             f"≤ direct + {ms(MAX_ADDED_REQUEST)}")
            row["note"] = (f"added p50 {ms(o - f)}, p99 "
                           f"{ms(pct(lat[ko], 99) - pct(lat[kf], 99))}")
            rows.append(row)
    w = r.get("wake")
    if w:
        t = table(f"11. ports: a request to a paused sandbox → its response (N={w['n']}, "
                  f"after 1 warmup cycle; the same sandbox, alternating)",
                  ["", "p50", "p95", "min"])
        for label, k in (("ours: first request through the proxy (wakes it)", "ours_wake_s"),
                         ("floor: Sandbox.resume(id)", "floor_resume_s"),
                         ("  (info) Sandbox.resume(id) + a request through the proxy",
                          "floor_resume_request_s")):
            xs = w[k]
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 95)), ms(min(xs)))
        console.print(t)
        o, f = median(w["ours_wake_s"]), median(w["floor_resume_s"])
        row = target_row("wake on request → response, p50", o, f, f + MAX_ADDED_WAKE,
                         f"≤ resume + {ms(MAX_ADDED_WAKE)}")
        row["note"] = f"added p50 {ms(o - f)} over Sandbox.resume"
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
