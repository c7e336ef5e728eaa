"""Benchmark 10: per-sandbox networking (cpuosd.network) beside a direct floor: HTTP download
throughput and the latency of a new outbound connection from inside a sandbox in mode ``on``
and ``allowlist`` (every TCP connection relayed by the daemon's egress proxy), against a raw
runsc sandbox on gVisor's netstack whose namespace is joined by a veth straight to the same
fake internet (no proxy); and create from the template snapshot → first exec with the
network on vs a daemon with CPUOS_NETWORK=0.

All traffic stays in namespaces this case makes: the fake internet (support.fakenet, no route
off the machine) is the daemon's uplink (CPUOS_UPLINK_NETNS) and the floor's only neighbour.

    .venv/bin/python bench/cases/network.py [--quick | --smoke]
"""

from __future__ import annotations

import functools
import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # for `support`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `cases`

from cpuos import Sandbox
from support.fakenet import WEB, FakeInternet
from support.daemon import Daemon

from cases._common import (FROM_SNAPSHOT, MB, PROCS, Context, MiB, Row, case_main, console,
                           create_exec_true, info_row, kill_quietly, mbps, median, ms, pct,
                           runsc_exec_argv, table, target_row, throughput_table, timing_table)

SECTION = KEY = "network"
TITLE = "10. network"
DAEMON = None  # its own: the daemon's uplink is this case's fake internet
ALLOWED = "allowed.test"  # a name of the fake internet, at WEB
MIN_RATIO = 0.7  # download throughput, ours / direct
MAX_ADDED_CONNECT = 0.002  # s, p50 of a new connection + first response, allowlist - direct
MAX_ADDED_CREATE = 0.020  # s, p50 of create → first exec, network on - CPUOS_NETWORK=0

# inside a sandbox: curl's own clock, so the exec that runs it is not in the figure
CURL = ["curl", "-sS", "-o", "/dev/null", "-w", "%{size_download} %{time_total}"]

# inside a sandbox: n new TCP connections, each timed from connect() to the whole of a small
# HTTP response (GET /bytes/64), after ``warm`` untimed ones; the name is resolved once,
# before the loop (argv: name or address to connect to, n, warm, Host header)
CONNECT_LOOP = r"""
import json, socket, sys, time
host, n, warm, vhost = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
addr = socket.getaddrinfo(host, 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
req = ("GET /bytes/64 HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % vhost).encode()
def one():
    t0 = time.perf_counter()
    s = socket.create_connection((addr, 80), timeout=10)
    try:
        s.sendall(req)
        buf = b""
        while True:
            b = s.recv(65536)
            if not b:
                raise SystemExit("closed before the whole response: %r" % buf[:300])
            buf += b
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                if len(body) >= length:
                    break
        dt = time.perf_counter() - t0
    finally:
        s.close()
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit("unexpected response: %r" % head[:300])
    return dt
for _ in range(warm):
    one()
print(json.dumps({"address": addr, "samples": [one() for _ in range(n)]}))
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: rc={r.returncode}: {r.stderr.strip()[-500:]}")
    return r


def netns_list() -> list[str]:
    out = sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Direct:
    """The floor's network: a namespace of this case's holding one end of a veth pair
    (10.254.0.2/30, default route via the other end), whose other end (10.254.0.1/30) is in
    the fake internet's namespace, where the web server is. Nothing else is reachable from
    it; deleting the namespace deletes the pair."""

    GATEWAY, ADDRESS = "10.254.0.1", "10.254.0.2"

    def __init__(self, inet_ns: str) -> None:
        tag = secrets.token_hex(3)
        self.ns, self.inet_ns = f"cpuos-bench-net-{tag}", inet_ns
        self.sbx_if, self.inet_if = f"cbs{tag}", f"cbi{tag}"

    @property
    def path(self) -> str:
        return f"/var/run/netns/{self.ns}"

    def make(self) -> None:
        sh("ip", "netns", "add", self.ns)
        sh("ip", "link", "add", self.sbx_if, "netns", self.ns, "type", "veth", "peer", "name",
           self.inet_if, "netns", self.inet_ns)
        sh("ip", "-n", self.ns, "addr", "add", f"{self.ADDRESS}/30", "dev", self.sbx_if)
        sh("ip", "-n", self.ns, "link", "set", self.sbx_if, "up")
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.ns, "route", "add", "default", "via", self.GATEWAY)
        sh("ip", "-n", self.inet_ns, "addr", "add", f"{self.GATEWAY}/30", "dev", self.inet_if)
        sh("ip", "-n", self.inet_ns, "link", "set", self.inet_if, "up")

    def remove(self) -> None:
        if self.ns in netns_list():
            sh("ip", "netns", "del", self.ns)


def network_left(tag: str, remove: bool) -> list[str]:
    """What a daemon with CPUOS_NET_ID ``tag`` left on the host after its teardown (its
    namespaces, host ends of veths, nftables table), removed if ``remove``. A daemon
    stopped with SIGTERM removes them itself: this should find nothing."""
    left: list[str] = []
    for n in netns_list():
        if n.startswith(f"cpuos-{tag}-n"):
            left.append(f"netns {n}")
            if remove:
                sh("ip", "netns", "del", n, check=False)
    for line in sh("ip", "-o", "link").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"cv{tag}n"):
            left.append(f"link {name}")
            if remove:
                sh("ip", "link", "del", name, check=False)
    if sh("nft", "list", "table", "inet", f"cpuos_{tag}", check=False).returncode == 0:
        left.append(f"nft table inet cpuos_{tag}")
        if remove:
            sh("nft", "delete", "table", "inet", f"cpuos_{tag}", check=False)
    return left


def create_with_network(d: Daemon, network: Any) -> Sandbox:
    """A sandbox with an egress policy (``POST /sandboxes``; the SDK has no argument yet)."""
    with d.client() as c:
        r = c.post("/sandboxes", json={"template": "python", "timeout": "60m",
                                       "network": network})
        if r.status_code != 201:
            raise RuntimeError(f"create with network {network!r}: {r.status_code} {r.text}")
        sid = r.json()["id"]
    return Sandbox.connect(sid, **d.sdk_kwargs())


def sandbox_network(d: Daemon, sid: str) -> Any:
    with d.client() as c:
        r = c.get(f"/sandboxes/{sid}")
        r.raise_for_status()
        return r.json().get("network")


def _speed(out: str, nbytes: int, what: str) -> float:
    size, seconds = out.split()
    if int(size) != nbytes:
        raise RuntimeError(f"{what}: downloaded {size} bytes, not {nbytes}")
    return nbytes / float(seconds) / MB


class Floor:
    """The raw runsc container on the direct network (PID 1 sleeps; commands through
    ``runsc exec`` as the sandbox user)."""

    def __init__(self, ctx: Context, cid: str) -> None:
        self.ctx, self.cid = ctx, cid

    def run(self, *argv: str) -> str:
        rc, out, err = PROCS.run(runsc_exec_argv(self.ctx.raw.root, self.cid, *argv),
                                 timeout=600)
        if rc != 0:
            raise RuntimeError(f"floor {argv[:2]}: rc={rc}: {err.decode(errors='replace')[-800:]}"
                               f"{out.decode(errors='replace')[-800:]}")
        return out.decode()


def ours_run(sbx: Sandbox, *argv: str) -> str:
    r = sbx.exec(list(argv), timeout="10m")
    if r.exit_code != 0:
        raise RuntimeError(f"{argv[:2]} in {sbx.id}: exit {r.exit_code}: "
                           f"{r.stderr[-800:]}{r.stdout[-800:]}")
    return r.stdout


def downloads(ctx: Context, s_on: Sandbox, s_allow: Sandbox, floor: Floor) -> dict[str, Any]:
    """Ours (on, allowlist) and the floor alternate; one small untimed download each first."""
    nbytes, runs = ctx.pick(64 * MiB, 32 * MiB, 1 * MiB), ctx.pick(7, 5, 1)
    sides: dict[str, Callable[..., str]] = {
        "ours_on": functools.partial(ours_run, s_on, *CURL),
        "ours_allow": functools.partial(ours_run, s_allow, *CURL),
        "floor": functools.partial(floor.run, *CURL),
    }
    host = {"ours_on": WEB, "ours_allow": ALLOWED, "floor": WEB}
    out: dict[str, Any] = {"bytes": nbytes, "runs": runs}
    for k, run in sides.items():
        _speed(run(f"http://{host[k]}/bytes/{MiB}"), MiB, k)
        out[f"{k}_MBps"] = []
    for i in range(runs):
        for k, run in sides.items():
            out[f"{k}_MBps"].append(_speed(run(f"http://{host[k]}/bytes/{nbytes}"), nbytes, k))
        console.print(f"  download {i + 1}/{runs}: "
                      + ", ".join(f"{k} {mbps(out[f'{k}_MBps'][-1])}" for k in sides))
    return out


def connects(ctx: Context, s_on: Sandbox, s_allow: Sandbox, floor: Floor) -> dict[str, Any]:
    n, warm = ctx.pick(500, 200, 5), ctx.pick(20, 20, 2)
    out: dict[str, Any] = {"n": n, "warmup": warm}
    sides: list[tuple[str, Callable[..., str], str]] = [
        ("ours_allow", functools.partial(ours_run, s_allow), ALLOWED),
        ("floor", floor.run, WEB),
        ("ours_on", functools.partial(ours_run, s_on), WEB)]
    for k, run, host in sides:
        res = json.loads(run("python3", "-c", CONNECT_LOOP, host, str(n), str(warm), ALLOWED))
        if res["address"] != WEB:
            raise RuntimeError(f"{k}: {host} resolved to {res['address']}, not {WEB}")
        out[f"{k}_s"] = res["samples"]
        console.print(f"  new connection + response, {k}: p50 {ms(median(res['samples']))}, "
                      f"p99 {ms(pct(res['samples'], 99))}")
    return out


def creates(ctx: Context, d_on: Daemon, d_off: Daemon) -> dict[str, Any]:
    """Sandbox.create + exec('true') from the template snapshot on both daemons, alternating,
    after one untimed create on each."""
    n = ctx.pick(20, 10, 1)
    out: dict[str, Any] = {"n": n, "ours_net_s": [], "ours_net_create_s": [],
                           "ours_off_s": [], "ours_off_create_s": []}
    for i in range(n + 1):
        for k, d in (("net", d_on), ("off", d_off)):
            _, t_create, t_exec = create_exec_true(d)
            if i:
                out[f"ours_{k}_s"].append(t_exec)
                out[f"ours_{k}_create_s"].append(t_create)
        if i:
            console.print(f"  create {i}/{n}: network on {ms(out['ours_net_s'][-1])}, "
                          f"CPUOS_NETWORK=0 {ms(out['ours_off_s'][-1])}")
    return out


def measure(ctx: Context) -> dict[str, Any]:
    if shutil.which("nft") is None:
        raise RuntimeError("the network case needs nft (apt-get install nftables)")
    inet = FakeInternet(ctx.tmp)
    ctx.defer("fake internet", inet.stop)
    inet.start()
    direct = Direct(inet.name)
    ctx.defer("direct namespace", direct.remove)
    direct.make()

    env_on = {**FROM_SNAPSHOT, **inet.env(), "CPUOS_DEFAULT_NETWORK": "on"}
    env_off = {**FROM_SNAPSHOT, "CPUOS_NETWORK": "0"}
    d_on = ctx.daemon(env_on)
    tag = d_on.net_env["CPUOS_NET_ID"]
    left: dict[str, list[str]] = {}
    ctx.defer("daemon network", lambda: left.update({tag: network_left(tag, True)}))
    out: dict[str, Any] = {"direct": {"netns": direct.ns, "address": Direct.ADDRESS,
                                      "gateway": Direct.GATEWAY, "web": WEB}}
    sandboxes: list[Sandbox] = []
    try:
        s_on = create_with_network(d_on, "on")
        sandboxes.append(s_on)
        s_allow = create_with_network(d_on, {"allow": [ALLOWED]})
        sandboxes.append(s_allow)
        out["modes"] = [sandbox_network(d_on, s.id) for s in sandboxes]

        raw = ctx.raw
        raw.match(d_on, s_on.id)  # the floor gets our sandboxes' size
        cid = raw.new_id("net")
        sdir = raw.bundle(cid, ["/bin/sleep", "infinity"], hostname=cid, netns=direct.path)
        ctx.defer("floor container", lambda: raw.delete(cid) if raw.root.exists() else None)
        raw.run_detached(cid, sdir, network=True)
        floor = Floor(ctx, cid)

        out["download"] = downloads(ctx, s_on, s_allow, floor)
        out["connect"] = connects(ctx, s_on, s_allow, floor)
        ctx.undo("floor container")
        for s in sandboxes:
            kill_quietly(s)
        sandboxes.clear()

        d_off = ctx.extra_daemon(env_off)
        try:
            out["create"] = creates(ctx, d_on, d_off)
            out["create"]["default_network"] = sandbox_network(
                d_on, create_exec_true(d_on)[0])  # what a plain Sandbox.create got
        finally:
            ctx.drop_daemon(d_off)
    finally:
        for s in sandboxes:
            kill_quietly(s)
        ctx.stop_daemon()
        ctx.undo()
    out["network_left"] = left.get(tag, [])
    if out["network_left"]:
        console.print(f"[red]the daemon left network state behind (removed): "
                      f"{out['network_left']}[/]")
    return out


def report(r: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    dl = r.get("download")
    if dl:
        throughput_table(
            f"10. network: HTTP download of {dl['bytes'] // MiB} MiB from the fake internet's "
            f"web server inside the sandbox, curl's own clock ({dl['runs']} runs; "
            f"MB = 10^6 B)", dl,
            (("ours: mode on (egress proxy)", "ours_on_MBps"),
             (f"ours: allowlist of {ALLOWED} (egress proxy)", "ours_allow_MBps"),
             ("floor: raw runsc netstack, veth straight to the fake internet",
              "floor_MBps")))
        f = median(dl["floor_MBps"])
        for mode, k in (("mode on", "ours_on_MBps"), ("allowlist", "ours_allow_MBps")):
            o = median(dl[k])
            rows.append({"metric": f"network download, {mode}, median", "ours": mbps(o),
                         "floor": mbps(f), "target": f"≥ {MIN_RATIO}× direct",
                         "met": "yes" if o >= MIN_RATIO * f else "no",
                         "note": f"{o / f:.2f}× direct"})
    c = r.get("connect")
    if c:
        t = table(f"10. network: new TCP connection + whole response to GET /bytes/64, timed "
                  f"inside the sandbox (N={c['n']}, after {c['warmup']} warmup)",
                  ["", "p50", "p99", "min"])
        for label, k in ((f"ours: allowlist of {ALLOWED}", "ours_allow_s"),
                         ("ours: mode on", "ours_on_s"),
                         ("floor: raw runsc netstack, direct veth", "floor_s")):
            xs = c[k]
            t.add_row(label, ms(pct(xs, 50)), ms(pct(xs, 99)), ms(min(xs)))
        console.print(t)
        o, f = median(c["ours_allow_s"]), median(c["floor_s"])
        row = target_row("new connection + response, allowlist, p50", o, f,
                         f + MAX_ADDED_CONNECT, f"≤ direct + {ms(MAX_ADDED_CONNECT)}")
        row["note"] = (f"added p50 {ms(o - f)}, p99 "
                       f"{ms(pct(c['ours_allow_s'], 99) - pct(c['floor_s'], 99))}")
        rows.append(row)
        rows.append(info_row("new connection + response, mode on, p50",
                             ms(median(c["ours_on_s"])), ms(f)))
    cr = r.get("create")
    if cr:
        timing_table(
            f"10. network: create from the template snapshot → first exec result (N={cr['n']}, "
            f"after 1 warmup each, alternating; CPUOS_POOL_SIZE=0)",
            [("ours, network on: Sandbox.create + exec('true')", cr["ours_net_s"]),
             ("  of which Sandbox.create", cr["ours_net_create_s"]),
             ("ours, CPUOS_NETWORK=0: Sandbox.create + exec('true')", cr["ours_off_s"]),
             ("  of which Sandbox.create", cr["ours_off_create_s"])])
        o, f = median(cr["ours_net_s"]), median(cr["ours_off_s"])
        row = target_row("create from snapshot → first exec, network on, p50", o, f,
                         f + MAX_ADDED_CREATE, f"≤ network off + {ms(MAX_ADDED_CREATE)}")
        row["note"] = f"added p50 {ms(o - f)} (floor column: a daemon with CPUOS_NETWORK=0)"
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(case_main(__name__))
