"""Issue 12: per-sandbox egress policy, attacked from inside real sandboxes.

The daemon's uplink leads into a fake internet (support.fakenet: a namespace of this test's,
with no route off the machine); every server and every listener in a denied range lives
there and logs what reaches it, so each test checks the servers' side too. No packet of
these tests leaves the namespaces they made (the network safety rule).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import subprocess
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cpuos import InvalidArgument, Sandbox
from support.fakenet import DENIED_LISTENERS, SMTP, WEB, FakeInternet
from support.daemon import Daemon, e2e_unavailable, new_daemon, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.net]


@pytest.fixture(scope="module")
def inet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInternet]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    f = FakeInternet(tmp_path_factory.mktemp("inet")).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def netd(inet: FakeInternet) -> Iterator[Daemon]:
    # (a pool of one that does not grow with demand: a burst of creates would grow it, and
    # what is left after one is only gone once the pool shrinks back, 10 s after the burst)
    d = new_daemon(CPUOS_POOL_SIZE="1", CPUOS_POOL_MAX="1", **inet.env())
    d.start()
    yield d
    try:
        with d.client() as c:  # every sandbox killed: then a clean stop
            for sb in c.get("/sandboxes").json()["sandboxes"]:
                c.delete(f"/sandboxes/{sb['id']}")
        d.stop()
        # the daemon's network is gone with it: namespaces, interfaces, its nftables table
        assert not d.network_leftovers()
    finally:
        assert not d.teardown(False)


def create(d: Daemon, network: Any) -> Sandbox:
    with d.client() as c:
        r = c.post("/sandboxes", json={"template": "python", "timeout": "10m",
                                       "network": network})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    return Sandbox.connect(sid, **d.sdk_kwargs())


def records(d: Daemon, sid: str) -> list[dict[str, Any]]:
    with d.client() as c:
        out: list[dict[str, Any]] = c.get(f"/sandboxes/{sid}/connections",
                                          params={"limit": 1000}).json()["connections"]
        return out


def curl(s: Sandbox, url: str, *extra: str) -> tuple[bool, str]:
    r = s.exec(["curl", "-sS", "-m", "5", "-o", "/dev/stdout", *extra, url], timeout="1m")
    return r.exit_code == 0, r.stdout + r.stderr


def denied_listeners_untouched(inet: FakeInternet) -> None:
    bad = [e for e in inet.seen() if e["listener"] != "dns" and (
        any(e["listener"].startswith(h) or e["listener"].startswith(f"udp {h}")
            for h in DENIED_LISTENERS) or e["listener"].startswith(SMTP))]
    assert not bad, f"a denied listener saw a connection: {bad}"


UDP = ("import socket\n"
       "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
       "for port in (53, 123):\n"
       "    try: s.sendto(b'hello', ('10.9.9.9', port))\n"
       "    except OSError as e: print('udp', e)\n")
SMTP_TRY = ("import socket, sys\n"
            "ok = []\n"
            "for host in (sys.argv[1], 'mail.test'):\n"
            "    for port in (25, 465, 587, 2525):\n"
            "        try:\n"
            "            c = socket.create_connection((host, port), timeout=5)\n"
            "            c.sendall(b'EHLO x\\r\\n'); got = c.recv(100); c.close()\n"
            "            if got: ok.append((host, port))\n"
            "        except OSError: pass\n"
            "print('SMTP-REACHED' if ok else 'SMTP-BLOCKED', ok)\n")
DENIED_URLS = [
    "http://10.9.9.9/", "http://169.254.169.254/latest/meta-data/", "http://2852039166/",
    "http://0xA9FEA9FE/", "http://0251.0376.0251.0376/", "http://[::ffff:169.254.169.254]/",
    "http://[64:ff9b::a9fe:a9fe]/", "http://[fd00:ec2::254]/", "http://100.64.1.1/",
    "http://evil.test/", "http://meta.test/", "http://169.254.169.254.nip.test/",
]


def test_on_reaches_the_internet_and_never_the_deny_sets(netd: Daemon,
                                                         inet: FakeInternet) -> None:
    s = create(netd, "on")
    try:
        ok, out = curl(s, f"http://{WEB}/")
        assert ok and '"hello": true' in out, out
        ok, out = curl(s, "http://allowed.test/")
        assert ok and "allowed.test" in out, out
        for url in DENIED_URLS:
            ok, out = curl(s, url)
            assert not ok, f"{url} got through: {out}"
        # a redirect from an allowed host to the metadata address is a new connection
        ok, out = curl(s, "http://redirect.test/redirect", "-L")
        assert not ok and "meta-data" not in out
        r = s.exec(["python3", "-c", SMTP_TRY, SMTP], timeout="2m")
        assert "SMTP-BLOCKED" in r.stdout, r.stdout + r.stderr
        s.exec(["python3", "-c", UDP])
        denied_listeners_untouched(inet)
        recs = records(netd, s.id)
        by = {(r.get("dst"), r.get("port"), r["verdict"]) for r in recs if r["proto"] == "tcp"}
        for dst in ("10.9.9.9", "169.254.169.254", "100.64.1.1"):
            assert (dst, 80, "denied") in by, (dst, by)
        assert (WEB, 80, "allowed") in by
        assert any(r["proto"] == "tcp" and r.get("port") == 25 and r["verdict"] == "denied"
                   and "mail" in r.get("rule", "") for r in recs)
        wait_until(lambda: any(r["proto"] == "udp" and r.get("dst") == "10.9.9.9"
                               and r.get("port") == 123 and r["verdict"] == "denied"
                               for r in records(netd, s.id)), "the UDP attempt recorded", 30)
        recs = records(netd, s.id)
        assert any(r["proto"] == "dns" and r.get("name") == "evil.test"
                   and r["verdict"] == "denied" for r in recs)
        allowed = [r for r in recs if r["verdict"] == "allowed" and r["proto"] == "tcp"]
        assert all(r["bytes_in"] > 0 and r["bytes_out"] > 0 for r in allowed), allowed
    finally:
        s.kill()


def test_allowlist_reaches_allowed_names_only(netd: Daemon, inet: FakeInternet) -> None:
    s = create(netd, {"allow": ["allowed.test", "redirect.test", "rebind.test", "*.nip.test"]})
    try:
        ok, out = curl(s, "http://allowed.test/")
        assert ok and '"hello": true' in out, out
        ok, _ = curl(s, "http://other.test/")  # not allowed: no answer from the resolver
        assert not ok
        before = len([e for e in inet.seen() if "other.test" in e.get("data", "")])
        ok, _ = curl(s, "http://other.test/", "--resolve", f"other.test:80:{WEB}")
        assert not ok  # the proxy refuses the name, whatever address the sandbox chose
        assert len([e for e in inet.seen() if "Host: other.test" in e.get("data", "")]) \
            == before == 0
        ok, _ = curl(s, f"http://{WEB}/")  # an address is no name
        assert not ok
        ok, _ = curl(s, "http://169.254.169.254.nip.test/", "--resolve",
                     f"169.254.169.254.nip.test:80:{WEB}")
        assert not ok  # the proxy resolves the name itself: the metadata address
        for _ in range(6):  # rebinding: the answer alternates between WEB and 10.9.9.9
            curl(s, "http://rebind.test/", "--resolve", f"rebind.test:80:{WEB}")
        ok, out = curl(s, "http://redirect.test/redirect", "-L")
        assert not ok and "meta-data" not in out
        # one approved name per connection: a second request for another host on it is cut
        pipelined = ("import socket, sys\n"
                     "c = socket.create_connection(('allowed.test', 80), timeout=5)\n"
                     "a = b'GET /bytes/1 HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n'\n"
                     "b = b'GET /x HTTP/1.1\\r\\nHost: cdn-neighbour.test\\r\\n\\r\\n'\n"
                     "c.sendall(a + b)\n"
                     "try:\n    print(c.recv(65536))\nexcept OSError as e: print(e)\n")
        s.exec(["python3", "-c", pipelined], timeout="1m")
        assert not [e for e in inet.seen() if "cdn-neighbour" in e.get("data", "")]
        tls = ("import socket, ssl, sys\n"
               "ctx = ssl.create_default_context()\n"
               "for name in ('allowed.test', 'other.test'):\n"
               "    c = socket.create_connection((sys.argv[1], 443), timeout=5)\n"
               "    try: ctx.wrap_socket(c, server_hostname=name)\n"
               "    except OSError as e: print(name, type(e).__name__)\n")
        s.exec(["python3", "-c", tls, WEB], timeout="1m")
        denied_listeners_untouched(inet)
        recs = records(netd, s.id)
        tcp = [r for r in recs if r["proto"] == "tcp"]
        assert any(r.get("name") == "allowed.test" and r["verdict"] == "allowed" for r in tcp)
        assert any(r.get("name") == "other.test" and r["verdict"] == "denied"
                   and r["rule"] == "not in the allowlist" for r in tcp)
        assert any(r.get("name") == "rebind.test" and r["verdict"] == "denied"
                   and "10.9.9.9" in r["rule"] for r in tcp)
        assert any(r.get("name") == "allowed.test" and r.get("port") == 443
                   and r["verdict"] == "allowed" for r in tcp)  # by TLS SNI
        assert any(r.get("name") == "other.test" and r.get("port") == 443
                   and r["verdict"] == "denied" for r in tcp)
        sni = [e for e in inet.seen() if e["listener"] == f"{WEB}:443"]
        assert len(sni) == 1 and "allowed.test" in sni[0]["data"]
        # a CONNECT tunnel to an allowed name carries TLS for that name only (no fronting)
        tunnel = ("import socket, ssl, sys\n"
                  "c = socket.create_connection((sys.argv[1], 80), timeout=5)\n"
                  "c.sendall(b'CONNECT allowed.test:443 HTTP/1.1\\r\\n"
                  "Host: allowed.test:443\\r\\n\\r\\n')\n"
                  "print(c.recv(200))\n"
                  "try: ssl.create_default_context().wrap_socket(c, server_hostname='x.test')\n"
                  "except OSError as e: print(type(e).__name__)\n")
        r = s.exec(["python3", "-c", tunnel, WEB], timeout="1m")
        assert "200 Connection established" in r.stdout, r
        assert not [e for e in inet.seen() if "x.test" in e.get("data", "")]
        assert any(r.get("rule") == "allowlist: TLS SNI 'x.test' in a tunnel to 'allowed.test'"
                   and r["verdict"] == "denied" for r in records(netd, s.id))
    finally:
        s.kill()


def test_off_then_update_applies_to_new_connections(netd: Daemon) -> None:
    """Through the SDK: Sandbox.create(network=...), sbx.network.update/.connections."""
    s = Sandbox.create(template="python", network="off", **netd.sdk_kwargs())
    try:
        assert s.network.policy == {"mode": "off", "allow": []}
        assert not curl(s, f"http://{WEB}/")[0]
        assert s.exec("getent hosts allowed.test").exit_code != 0
        assert (s.network.update("on") or {})["mode"] == "on"
        assert curl(s, f"http://{WEB}/")[0]
        s.network.update({"allow": ["allowed.test"]})
        assert curl(s, "http://allowed.test/")[0]
        m = s.metrics()  # the sandbox's link counted both ways
        assert m["net_tx_bytes"] > 0 and m["net_rx_bytes"] > 0, m
        assert not curl(s, f"http://{WEB}/")[0]
        s.network.update("off")
        assert not curl(s, "http://allowed.test/")[0]
        assert s.info().network == {"mode": "off", "allow": []}
        recs = s.network.connections(limit=1000)
        assert any(r["verdict"] == "denied" for r in recs)
        assert any(r["verdict"] == "allowed" and r.get("name") == "allowed.test" for r in recs)
        with pytest.raises(InvalidArgument):
            s.network.update("sideways")
    finally:
        s.kill()


def test_daemon_and_host_are_out_of_reach(netd: Daemon) -> None:
    s = create(netd, "on")
    try:
        gw = s.exec("ip route 2>/dev/null | awk '/default/ {print $3}'; "
                    "awk 'NR>1 && $2==\"00000000\" {print $3}' /proc/net/route").stdout.split()
        targets = [f"http://127.0.0.1:{netd.port}/health", f"http://192.0.2.2:{netd.port}/health"]
        targets += [f"http://{g}:{netd.port}/health" for g in gw if g.count(".") == 3]
        for url in targets:
            ok, out = curl(s, url)
            assert not ok or '"ok"' not in out, f"{url} reached the daemon: {out}"
        # the commands' uid cannot reconfigure the sandbox's network
        r = s.exec(["python3", "-c",
                    "import fcntl, socket, struct\n"
                    "s = socket.socket()\n"
                    "try:\n"
                    "    fcntl.ioctl(s, 0x8916, struct.pack('16sH14s', b'eth0', 2, b''))\n"
                    "    print('CHANGED')\n"
                    "except OSError as e: print('refused', e.errno)\n"])  # SIOCSIFADDR
        assert "refused" in r.stdout, r.stdout + r.stderr
    finally:
        s.kill()


def test_network_survives_pause_resume_and_fork(netd: Daemon) -> None:
    s = create(netd, "on")
    clones: list[Sandbox] = []
    try:
        assert curl(s, f"http://{WEB}/")[0]
        s.pause()
        s = Sandbox.resume(s.id, **netd.sdk_kwargs())
        wait_until(lambda: curl(s, f"http://{WEB}/")[0], "the network back after resume", 60)
        clones = s.fork()
        for c in clones:
            wait_until(lambda c=c: curl(c, f"http://{WEB}/")[0], "a clone's network", 60)  # type: ignore[misc]
            # (a connection is recorded when the proxy has closed both sides: after curl exits)
            wait_until(lambda c=c: any(r["verdict"] == "allowed"  # type: ignore[misc]
                                       for r in records(netd, c.id)),
                       "the clone's connection recorded", 30)
        assert curl(s, f"http://{WEB}/")[0]
    finally:
        for c in clones:
            c.kill()
        s.kill()


def test_create_kill_cycles_leave_nothing(netd: Daemon) -> None:
    tag = netd.net_env["CPUOS_NET_ID"]
    for _ in range(10):
        s = create(netd, "on")
        s.kill()

    def src_elements() -> list[Any]:
        out = subprocess.run(["nft", "-j", "list", "set", "inet", f"cpuos_{tag}", "src"],
                             capture_output=True, text=True).stdout
        elems: list[Any] = json.loads(out)["nftables"][1]["set"].get("elem", [])
        return elems

    # what is left (namespaces are removed in the background after a kill): the spare
    # (CPUOS_NETNS_POOL=1) and the pooled sandbox's, and at most its interface in the table
    wait_until(lambda: len([x for x in netd.network_leftovers() if x.startswith("netns ")])
               <= 2
               and len(src_elements()) <= 1, "namespaces and rules of killed sandboxes "
               "removed", 60)


def test_policy_input_is_checked(netd: Daemon) -> None:
    with netd.client() as c:
        for bad in ("sideways", {"allow": ["bad name!"]}, {"mode": "on", "nope": 1},
                    {"allow": "pypi.org"}):
            r = c.post("/sandboxes", json={"template": "python", "network": bad})
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["error"]["details"]["field"] == "network"




SECRET_PREFIX = "sk-real-value-"
SECRET = SECRET_PREFIX + "7" * 24
# every process's environment and command line, and the files under /run /tmp /etc /home
# /work: the SHA-256 of each window that starts like the value (its prefix, given as argv[1],
# is no secret) and is as long (argv[2]); the value itself is never handed in
SCAN = r"""
import hashlib, os, sys
prefix, n = sys.argv[1].encode(), int(sys.argv[2])
def look(data, where):
    i = data.find(prefix)
    while i >= 0:
        print(hashlib.sha256(data[i:i + n]).hexdigest(), where)
        i = data.find(prefix, i + 1)
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for f in ("environ", "cmdline"):
            try:
                look(open(f"/proc/{pid}/{f}", "rb").read(), f"/proc/{pid}/{f}")
            except OSError:
                pass
for top in ("/run", "/tmp", "/etc", "/home", "/work"):
    for d, _, files in os.walk(top):
        for name in files:
            try:
                look(open(os.path.join(d, name), "rb").read(), os.path.join(d, name))
            except OSError:
                pass
print("scanned")
"""


def test_secret_never_enters_the_sandbox(netd: Daemon, inet: FakeInternet) -> None:
    with netd.client() as c:
        r = c.post("/sandboxes", json={
            "template": "python", "timeout": "10m", "network": {"allow": ["other.test"]},
            "secrets": {"API_KEY": {"value": SECRET, "hosts": ["allowed.test"]}}})
        assert r.status_code == 201, r.text
        assert SECRET not in r.text
        sid = r.json()["id"]
        assert SECRET not in c.get(f"/sandboxes/{sid}").text
    s = Sandbox.connect(sid, **netd.sdk_kwargs())
    try:
        placeholder = s.exec("printf %s \"$API_KEY\"").stdout
        assert placeholder.startswith("cpuos-secret-") and SECRET not in placeholder
        # nowhere inside: environment, /proc, files
        found = s.exec(["python3", "-c", SCAN, SECRET_PREFIX, str(len(SECRET))])
        assert found.stdout.strip().endswith("scanned"), found.stderr
        assert hashlib.sha256(SECRET.encode()).hexdigest() not in found.stdout, found.stdout
        hdr = "Authorization: Bearer $API_KEY"

        # the fake internet's CA, for the sandbox's own TLS to a host it is not MITM'd for
        s.files.write("/tmp/inet-ca.pem", inet.ca_path.read_bytes())

        def sent(url: str, *extra: str) -> list[str]:
            """Request url with the header (the answer is not kept: the servers echo
            headers, which would hand the value back in); what the server got."""
            n = len(inet.seen())
            r = s.exec(f"curl -sS -m 10 -o /dev/null -H \"{hdr}\" {' '.join(extra)} {url}")
            assert r.exit_code == 0, r.stderr
            return [e["data"] for e in inet.seen()[n:] if "Authorization" in e.get("data", "")]

        # HTTPS to the secret's host: TLS ends at the proxy (the sandbox trusts its own CA),
        # the header goes on to the server with the real value
        got = sent("https://allowed.test:8443/bytes/10")
        assert got and SECRET in got[0] and "Host: allowed.test" in got[0]
        # plain HTTP, even to the secret's host, gets the placeholder: the sandbox chooses
        # where a plaintext connection goes (an address of its own with Host: allowed.test)
        got = sent("http://allowed.test/bytes/10")
        assert got and SECRET not in got[0] and placeholder in got[0]
        got = sent(f"http://{WEB}/bytes/10", "-H 'Host: allowed.test'")
        assert got and SECRET not in got[0]
        # only credential headers carry it: not the request line, not Origin
        n = len(inet.seen())
        s.exec("curl -sS -m 10 -o /dev/null -H \"Origin: https://$API_KEY\" "
               "https://allowed.test:8443/bytes/10/$API_KEY")
        seen_now = [e["data"] for e in inet.seen()[n:]]
        assert seen_now and all(SECRET not in d for d in seen_now), seen_now
        # an answer that echoes the value back reaches the sandbox as the placeholder
        echo = s.exec(f"curl -sS -m 10 -H \"{hdr}\" https://allowed.test:8443/echo")
        assert echo.exit_code == 0 and "Bearer cpuos-secret-" in echo.stdout
        assert SECRET not in echo.stdout
        for url, extra in (("http://other.test/bytes/10", ""),
                           ("https://other.test:8443/bytes/10", "--cacert /tmp/inet-ca.pem")):
            got = sent(url, extra)  # any other host gets the placeholder
            assert got and SECRET not in got[0] and placeholder in got[0], (url, got)
        recs = records(netd, sid)
        assert SECRET not in json.dumps(recs)
        assert any(r.get("name") == "allowed.test" and r.get("secrets") == 1 for r in recs)
        # a snapshot holds the placeholder only
        s.pause()
        snap = netd.snapshots_dir / sid
        for f in snap.rglob("*"):
            if f.is_file():
                raw = f.read_bytes()
                i = raw.find(SECRET.encode())
                assert i < 0, (f, raw[max(0, i - 600):i + 200])
        s = Sandbox.resume(sid, **netd.sdk_kwargs())
        got = sent("https://allowed.test:8443/bytes/10")
        assert got and SECRET in got[0]
    finally:
        s.kill()
    assert SECRET not in netd.log.read_text()
    secrets_dir = netd.home / "secrets"
    wait_until(lambda: not list(secrets_dir.glob("*.json")), "the secret removed at the end", 30)


def test_workspace_default_policy(netd: Daemon) -> None:
    with netd.client() as c:
        w = c.post("/workspaces", json={"name": "net-default"}).json()
        r = c.put(f"/workspaces/{w['id']}/settings",
                  json={"default_network": {"allow": ["allowed.test"]}})
        assert r.status_code == 200, r.text
        assert c.put(f"/workspaces/{w['id']}/settings",
                     json={"default_network": "sideways"}).status_code == 422
    with httpx.Client(base_url=netd.url, headers={"Authorization": f"Bearer {w['key']}"},
                      timeout=60) as u:
        assert u.put(f"/workspaces/{w['id']}/settings",
                     json={"default_network": "on"}).status_code == 403  # admin only
        r = u.post("/sandboxes", json={"template": "python"})
        assert r.status_code == 201, r.text
        assert r.json()["network"] == {"mode": "allowlist", "allow": ["allowed.test"]}
        sid = r.json()["id"]
        r = u.post("/sandboxes", json={"template": "python", "network": "off"})
        assert r.json()["network"]["mode"] == "off"
        for s in (sid, r.json()["id"]):
            u.delete(f"/sandboxes/{s}")


# -- issue 25, finding 4: the egress path, attacked from inside real sandboxes ------------

V6 = ("import errno, socket\n"
      "for host, port in (('2001:db8::1', 80), ('2606:4700::1', 8080), ('fd00:ec2::254', 80)):\n"
      "    try: socket.create_connection((host, port), timeout=10)\n"
      "    except OSError as e: print(host, errno.errorcode.get(e.errno, e))\n"
      "s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
      "s.sendto(b'hello', ('2606:4700::1', 123))\n")


def test_ipv6_attempts_are_refused_at_once_and_recorded(netd: Daemon, inet: FakeInternet
                                                        ) -> None:
    """A sandbox has an IPv6 address and route on its veth only so that an attempt leaves
    its stack: the firewall refuses it (a reset for TCP) and records it. Before, gVisor's
    netstack failed it inside (ENETUNREACH, no route) and nothing was recorded."""
    s = create(netd, "on")
    try:
        r = s.exec(["python3", "-c", V6])
        assert r.stdout.split() == ["2001:db8::1", "ECONNREFUSED", "2606:4700::1",
                                    "ECONNREFUSED", "fd00:ec2::254", "ECONNREFUSED"], r
        # a name gives no IPv6 address (the resolver drops AAAA answers)
        assert ":" not in s.exec("getent ahosts allowed.test").stdout
        denied_listeners_untouched(inet)

        def recorded() -> bool:
            got = {(r["proto"], r.get("dst"), r.get("port")) for r in records(netd, s.id)
                   if r["verdict"] == "denied" and r.get("rule") == "IPv6 is not routed"}
            return {("tcp", "2001:db8::1", 80), ("tcp", "2606:4700::1", 8080),
                    ("tcp", "fd00:ec2::254", 80), ("udp", "2606:4700::1", 123)} <= got
        wait_until(recorded, "every IPv6 attempt recorded", 30)
    finally:
        s.kill()


# inside a sandbox: each case on a connection of its own to WEB:80 (the proxy takes every
# TCP connection; allowlist names the host from the first request or a CONNECT); prints
# {"case", "got": what came back} per case. argv: the cases to run (all when none)
ATTACKS = r'''
import json, socket, sys
T = b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"
def get(path, host=b"allowed.test", extra=b"", version=b"1.1"):
    return b"GET " + path + b" HTTP/" + version + b"\r\nHost: " + host + b"\r\n" + extra + b"\r\n"
UPGRADE = b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
CASES = {
    # (a) plaintext HTTP inside a CONNECT tunnel is checked like any other
    "tunnel-other-host": (T, get(b"/a1", b"other.test")),
    "tunnel-ok": (T, get(b"/a2", extra=b"Connection: close\r\n")),
    "tunnel-http10-no-host": (T, b"GET /a3 HTTP/1.0\r\n\r\n"),
    "tunnel-not-http": (T, b"SSH-2.0-OpenSSH_9.2\r\n\r\n"),
    # (b) Upgrade answered 200: the next request is still checked; a real 101 switches
    "upgrade-200": (b"", get(b"/a4", extra=UPGRADE) + get(b"/a4x", b"other.test")),
    "upgrade-101": (b"", b"GET /upgrade HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: echo\r\n"
                         b"Connection: Upgrade\r\n\r\nraw bytes after the switch"),
    # smuggling and spelling
    "cl-te": (b"", b"POST /a5 HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 45\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + get(b"/a5x", b"other.test")),
    "absolute-form": (b"", b"GET http://other.test/a6 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
    "userinfo": (b"", get(b"/a7") + get(b"/a7x", b"allowed.test@other.test")),
    "port": (b"", get(b"/a8", b"allowed.test:8080")),
    "case-space-dot": (b"", b"GET /a9 HTTP/1.1\r\nHost:   ALLOWED.TEST.  \r\n"
                            b"Connection: close\r\n\r\n"),
    "two-hosts": (b"", b"GET /a10 HTTP/1.1\r\nHost: allowed.test\r\nHost: other.test\r\n\r\n"),
    "long-header": (b"", get(b"/a11") + get(b"/a11x", extra=b"X: " + b"a" * 100000 + b"\r\n")),
    "http2": (b"", get(b"/a12", version=b"2.0")),
    "inner-connect": (b"", get(b"/a13") + b"CONNECT other.test:443 HTTP/1.1\r\n"
                                          b"Host: other.test:443\r\n\r\n"),
}
for name in sys.argv[1:] or list(CASES):
    pre, payload = CASES[name]
    c = socket.create_connection(("198.51.100.10", 80), timeout=20)
    got = b""
    try:
        if pre:
            c.sendall(pre)
            got += c.recv(200)
        c.sendall(payload)
        while b"RAW BYTES" not in got:
            b = c.recv(65536)
            if not b:
                break
            got += b
    except OSError as e:
        got += (" [%s]" % type(e).__name__).encode()
    c.close()
    print(json.dumps({"case": name, "got": got.decode("latin-1")}), flush=True)
'''
PROXY_403 = "HTTP/1.1 403 \r\n"
PROXY_400 = "HTTP/1.1 400 \r\n"
TUNNEL_OK = "HTTP/1.1 200 Connection established\r\n\r\n"
# case -> (what the sandbox gets back, starting with; paths the server must see; paths it
# must never see; the rule of the connection's record, None: allowed)
EXPECT: dict[str, tuple[str, list[str], list[str], str | None]] = {
    "tunnel-other-host": (TUNNEL_OK + PROXY_403, [], ["/a1"],
                          "a request for 'other.test' on a connection to 'allowed.test'"),
    "tunnel-ok": (TUNNEL_OK + "HTTP/1.1 200 OK", ["/a2"], [], None),
    "tunnel-http10-no-host": (TUNNEL_OK + "HTTP/1.1 200 OK", ["/a3"], [], None),
    "tunnel-not-http": (TUNNEL_OK + PROXY_400, [], [], "not HTTP/1.x the proxy can follow"),
    "upgrade-200": ("HTTP/1.1 200 OK", ["/a4"], ["/a4x"],
                    "a request for 'other.test' on a connection to 'allowed.test'"),
    "upgrade-101": ("HTTP/1.1 101 ", ["/upgrade"], [], None),
    "cl-te": (PROXY_403, [], ["/a5", "/a5x"],
              "a request with both Content-Length and Transfer-Encoding"),
    "absolute-form": (PROXY_403, [], ["/a6"],
                      "a request for 'other.test' on a connection to 'allowed.test'"),
    "userinfo": ("HTTP/1.1 200 OK", ["/a7"], ["/a7x"],
                 "Host 'allowed.test@other.test' is not host[:port]"),
    "port": (PROXY_403, [], ["/a8"], "a request for port 8080 on a connection to port 80"),
    "case-space-dot": ("HTTP/1.1 200 OK", ["/a9"], [], None),
    "two-hosts": (PROXY_400, [], ["/a10"], "Found multiple Host"),
    "long-header": ("HTTP/1.1 200 OK", ["/a11"], ["/a11x"], "a request head over 64 KiB"),
    "http2": (PROXY_403, [], ["/a12"], "HTTP/2.0 is not HTTP/1.x"),
    "inner-connect": ("HTTP/1.1 200 OK", ["/a13"], ["other.test:443"],
                      "a request for 'other.test' on a connection to 'allowed.test'"),
}


def test_allowlist_checks_every_request_on_a_connection(netd: Daemon, inet: FakeInternet
                                                        ) -> None:
    """Host checks everywhere (also inside CONNECT tunnels and after an Upgrade answered
    200), request smuggling and Host spellings; each attack's record says what happened."""
    s = create(netd, {"allow": ["allowed.test"]})
    try:
        n = len(inet.seen())
        s.files.write("/tmp/attacks.py", ATTACKS)
        r = s.exec(["python3", "/tmp/attacks.py"], timeout="5m")
        got = {d["case"]: d["got"] for d in map(json.loads, r.stdout.splitlines())}
        assert set(got) == set(EXPECT), r.stderr
        web = [e["data"] for e in inet.seen()[n:] if e["listener"] == f"{WEB}:80"]
        targets = [d.split("\n", 1)[0].split(" ")[1] for d in web]
        for case, (reply, seen, never, _) in EXPECT.items():
            assert got[case].startswith(reply), (case, got[case][:400])
            for path in seen:
                assert path in targets, (case, path, targets)
            for path in never:
                assert path not in targets, (case, path, targets)
        assert not any("other.test" in d for d in web), web
        # the server sees the approved name only, spelled as the proxy approved it
        assert all("Host: allowed.test\n" in d for d in web), web
        assert "RAW BYTES AFTER THE SWITCH" in got["upgrade-101"]
        recs = [r for r in records(netd, s.id) if r["proto"] == "tcp"]
        assert len(recs) == len(EXPECT) and all(r.get("name") == "allowed.test" for r in recs)
        for case, (_, _, _, rule) in EXPECT.items():
            if rule is not None:  # (d) a connection cut is recorded as denied, with why
                assert any(r["verdict"] == "denied" and rule in r.get("rule", "")
                           for r in recs), (case, rule, recs)
        allowed = [r for r in recs if r["verdict"] == "allowed"]
        assert len(allowed) == sum(1 for e in EXPECT.values() if e[3] is None), recs
    finally:
        s.kill()


SILENT = r'''
import socket, sys
for pre in (b"", b"CONNECT allowed.test:2222 HTTP/1.1\r\nHost: allowed.test:2222\r\n\r\n"):
    c = socket.create_connection(("allowed.test", 2222 if not pre else 80), timeout=30)
    c.sendall(pre)
    got = b""
    try:
        while True:
            b = c.recv(200)
            if not b:
                break
            got += b
    except OSError as e:
        got += b" " + type(e).__name__.encode()
    print(got)
c = socket.create_connection(("198.51.100.10", 80), timeout=10)
c.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
print(c.recv(200))
import ssl
try: ssl.create_default_context().wrap_socket(c, server_hostname="x.test")
except OSError as e: print(type(e).__name__)
def hello(name):
    ctx = ssl.create_default_context()
    ctx.check_hostname = name is not None
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    try: ctx.wrap_bio(inc, out, server_hostname=name).do_handshake()
    except ssl.SSLWantReadError: pass
    return out.read()[5:]
def record(b):
    return b"\x16\x03\x01" + len(b).to_bytes(2, "big") + b
# a ClientHello for allowed.test.x in two records, the first ending after "allowed.test";
# then one with no server name, in a tunnel
hs = hello("allowed.test.x")
cut = hs.index(b"allowed.test") + len(b"allowed.test")
for pre, first in ((b"", record(hs[:cut]) + record(hs[cut:])),
                   (b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n", record(hello(None)))):
    c = socket.create_connection(("198.51.100.10", 443 if not pre else 80), timeout=10)
    if pre:
        c.sendall(pre); c.recv(200)
    c.sendall(first)
    try: print(c.recv(200))
    except OSError as e: print(type(e).__name__)
'''


def test_allowlist_refuses_silent_clients_and_checks_tls_before_connecting(
        netd: Daemon, inet: FakeInternet) -> None:
    """(f) a protocol whose server speaks first (an SSH-like banner on WEB:2222) is refused
    on the first-byte wait, directly and inside a tunnel, and the server never hears of it;
    (g) a tunnel whose TLS names another host is refused before a connection is made; a
    ClientHello split over records is read whole; a tunnel's TLS must name its host."""
    s = create(netd, {"allow": ["allowed.test"]})
    try:
        n = len(inet.seen())
        r = s.exec(["python3", "-c", SILENT], timeout="2m")
        lines = r.stdout.splitlines()
        assert "ConnectionResetError" in lines[0] and "SSH" not in lines[0], r
        assert "200 Connection established" in lines[1] and "SSH" not in lines[1], r
        assert "ConnectionResetError" in lines[1], r
        assert "200 Connection established" in lines[2], r
        seen = [e for e in inet.seen()[n:] if e["listener"] in (f"{WEB}:2222", f"{WEB}:443")]
        assert not seen, seen  # no connection to the banner, none to 443 for x.test
        recs = [r for r in records(netd, s.id) if r["proto"] == "tcp"]
        rules = [r.get("rule", "") for r in recs if r["verdict"] == "denied"]
        assert any(x.startswith("allowlist: nothing sent within 2 s") for x in rules), recs
        assert any(x.startswith("allowlist: nothing sent in the tunnel to 'allowed.test' "
                                "within 2 s") for x in rules), recs
        assert "allowlist: TLS SNI 'x.test' in a tunnel to 'allowed.test'" in rules, recs
        # a name split over two TLS records is read whole (it was read as allowed.test)
        assert any(r.get("name") == "allowed.test.x" and r["verdict"] == "denied"
                   and r.get("rule") == "not in the allowlist" for r in recs), recs
        assert "allowlist: a ClientHello without a server name in a tunnel to " \
               "'allowed.test'" in rules, recs
    finally:
        s.kill()


# inside a sandbox with a secret for allowed.test: raw HTTPS requests carrying the
# placeholder, asking for compression; prints each whole answer (base64) by path[@host]
ECHOES = r'''
import base64, json, os, socket, ssl, sys
ctx = ssl.create_default_context()
out = {}
for case in sys.argv[1:]:
    path, _, host = case.partition("@")
    c = ctx.wrap_socket(socket.create_connection(("allowed.test", 8443), timeout=10),
                        server_hostname="allowed.test")
    c.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
               "Accept-Encoding: gzip, deflate, br\r\nConnection: close\r\n\r\n"
               % (path, host or "allowed.test", os.environ["API_KEY"])).encode())
    got = b""
    try:
        while True:
            b = c.recv(65536)
            if not b:
                break
            got += b
    except OSError as e:
        got += b" [" + type(e).__name__.encode() + b"]"
    out[case] = base64.b64encode(got).decode()
print(json.dumps(out))
'''
ECHO_CASES = ("/gzip-echo", "/gzip-echo-chunked", "/deflate-echo", "/deflate-echo-chunked",
              "/br-echo", "/echo", "/echo@other.test")


@pytest.mark.parametrize("mode", ["allowlist", "on"])
def test_secret_answers_compressed_or_fronted(netd: Daemon, inet: FakeInternet,
                                              mode: str) -> None:
    """(c) a server that compresses an echo of the secret (whatever the request asked) is
    decoded before the mask, or refused; and on a connection the proxy ended TLS for, every
    request's Host must be the secret's host (another Host on a shared front end would take
    the secret elsewhere), in any mode."""
    with netd.client() as c:
        r = c.post("/sandboxes", json={
            "template": "python", "timeout": "10m",
            "network": "on" if mode == "on" else {"allow": ["other.test"]},
            "secrets": {"API_KEY": {"value": SECRET, "hosts": ["allowed.test"]}}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    s = Sandbox.connect(sid, **netd.sdk_kwargs())
    try:
        n = len(inet.seen())
        run = s.exec(["python3", "-c", ECHOES, *ECHO_CASES], timeout="2m")
        answers = {k: base64.b64decode(v) for k, v in json.loads(run.stdout).items()}
        placeholder = s.exec("printf %s \"$API_KEY\"").stdout
        for case, raw in answers.items():
            head, _, body = raw.partition(b"\r\n\r\n")
            assert SECRET.encode() not in raw, case
            for decode in (gzip.decompress, zlib.decompress):
                plain = b""
                with contextlib.suppress(OSError, EOFError, zlib.error):
                    plain = decode(body)
                assert SECRET.encode() not in plain, case
            if case in ("/br-echo", "/echo@other.test"):
                continue
            assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Encoding" not in head, case
            assert placeholder.encode() in body, (case, body[:300])
        assert answers["/br-echo"].startswith(b"HTTP/1.1 502 "), answers["/br-echo"][:200]
        assert answers["/echo@other.test"].startswith(b"HTTP/1.1 403 ")
        # the server got the value for its own requests only, and never one for other.test
        got = [e["data"] for e in inet.seen()[n:] if e["listener"] == f"{WEB}:8443"]
        assert len(got) == len(ECHO_CASES) - 1 and all(SECRET in d for d in got), got
        assert all("Host: allowed.test\n" in d for d in got), got
        recs = [r for r in records(netd, sid) if r["proto"] == "tcp"]
        assert SECRET not in json.dumps(recs)
        denied = [r.get("rule", "") for r in recs if r["verdict"] == "denied"]
        assert "connection cut: a br answer on a connection carrying secrets (the proxy " \
               "decodes gzip and deflate only)" in denied, recs
        assert "connection cut: a request for 'other.test' on a connection to " \
               "'allowed.test'" in denied, recs
    finally:
        s.kill()
    assert SECRET not in netd.log.read_text()
