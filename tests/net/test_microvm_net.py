"""Issues 12 and 13 on the microVM backend: a guest's virtio-net on a tap in the sandbox's
network namespace (the daemon's own: same address pool, nftables table, resolver, egress
proxy and records as gVisor's), the guest told its address at every boot, restore and
clone, and the preview proxy reaching a server inside the guest.

The guest is emulated (TCG), like tests/e2e/test_microvm.py; the daemon's uplink leads into
a fake internet of this module's (support.fakenet: no route off the machine), where the
servers, and the listeners in denied ranges, log what reaches them. No packet of these
tests leaves the namespaces they made (the network safety rule).

``pytest -m tcg`` (about 2-3 minutes here, most of it the template's first boot under TCG;
in the default run). Needs root, QEMU, nft, the guest artifacts
(scripts/build-microvm-kernel.sh) and a built python template.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cpuos import Sandbox
from cpuosd.backends.microvm import guest_artifacts, jailer
from cpuosd.config import Config
from support.fakenet import DENIED_LISTENERS, SMTP, WEB, FakeInternet
from support.daemon import Daemon, e2e_unavailable, microvm_env, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.net, pytest.mark.tcg]

CACHE = guest_artifacts.cache_dir()
# the guest's own IPv4 address: the source of its route to anywhere (a UDP connect sends
# nothing)
ADDRESS = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
           "s.connect(('198.51.100.1', 9)); print(s.getsockname()[0])")


@pytest.fixture(scope="module")
def inet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInternet]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    if not os.path.exists("/usr/bin/qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")
    if shutil.which("nft") is None or shutil.which("tc") is None:
        pytest.skip("nft or tc not installed (apt-get install nftables iproute2)")
    art = guest_artifacts.current_artifacts(CACHE)
    if art is None or not art.exist():
        pytest.skip(f"guest artifacts not built in {CACHE} (scripts/build-microvm-kernel.sh)")
    if not guest_artifacts.built_from_this_init(art):
        pytest.skip(f"guest artifacts in {CACHE} are of an older /init "
                    "(scripts/build-microvm-kernel.sh rebuilds them)")
    f = FakeInternet(tmp_path_factory.mktemp("inet")).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def vmd(inet: FakeInternet, tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("mvmnet") / "home"
    home.mkdir()
    d = Daemon(home, {**microvm_env("tcg", CACHE), **inet.env()})
    d.start()
    failed_before = request.session.testsfailed
    failed = True
    try:
        yield d
        failed = request.session.testsfailed > failed_before
        with d.client() as c:  # every sandbox killed: then a clean stop
            for sb in c.get("/sandboxes").json()["sandboxes"]:
                c.delete(f"/sandboxes/{sb['id']}")
        d.stop()
        # nothing of the daemon's network is left: namespaces, interfaces, its table, and
        # no tap of a VM came back into the host's namespace
        assert not d.network_leftovers()
        assert not host_taps()
    finally:
        d.teardown(failed)
        jails = home / "microvm" / "jail" / "qemu-system-x86_64"
        left = sorted(p.name for p in jails.iterdir()) if jails.is_dir() else []
        for jid in left:
            jailer.cleanup(jid, home / "microvm" / "jail")
        assert not left, f"jails left behind: {left}"


def host_taps() -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show", "type", "tun"], capture_output=True,
                         text=True).stdout
    return [x["ifname"] for x in json.loads(out or "[]") if x["ifname"].startswith("tap0")]


def create(d: Daemon, network: Any, **more: Any) -> Sandbox:
    """A sandbox with a policy (the first: the template's boot and snapshot under TCG,
    which on a loaded host takes minutes)."""
    with d.client() as c:
        r = c.post("/sandboxes", json={"template": "python", "timeout": "15m",
                                       "network": network, **more}, timeout=900)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    return Sandbox.connect(sid, **d.sdk_kwargs())


def records(d: Daemon, sid: str) -> list[dict[str, Any]]:
    with d.client() as c:
        out: list[dict[str, Any]] = c.get(f"/sandboxes/{sid}/connections",
                                          params={"limit": 1000}).json()["connections"]
        return out


def curl(s: Sandbox, url: str, *extra: str, limit: int = 20) -> tuple[bool, str]:
    """(succeeded, output); limit: curl's own bound (s) — an attempt the firewall drops
    waits all of it."""
    r = s.exec(["curl", "-sS", "-m", str(limit), *extra, url], timeout="2m")
    return r.exit_code == 0, r.stdout + r.stderr


def guest_address(s: Sandbox) -> str:
    return s.exec(["python3", "-c", ADDRESS], timeout="1m").stdout.strip()


def assigned_address(d: Daemon, sid: str) -> str:
    """The address the daemon's network gave the sandbox (its slot: .2 of a /30)."""
    st = json.loads((Config(home=d.home).sandboxes_dir / sid / "net.json").read_text())
    pool = ipaddress.IPv4Network(d.net_env["CPUOS_NET_POOL"])
    return str(pool.network_address + 4 * int(st["index"]) + 2)


def vmm_pid(d: Daemon, sid: str) -> int:
    """The pid of the QEMU running sid (its jail: the sandbox's id, or a standby's that
    names it)."""
    jails = d.home / "microvm" / "jail" / "qemu-system-x86_64"
    for j in jails.iterdir():
        named = (j / "sandbox").read_text().strip() if (j / "sandbox").exists() else j.name
        if named == sid:
            return int((j / "vmm.pid").read_text())
    raise AssertionError(f"no jail runs {sid}")


def check_link(d: Daemon, sid: str) -> None:
    """QEMU is in a namespace of its own (neither the host's nor the sandbox's); the tap it
    opened is in the sandbox's namespace, owned by QEMU's uid; the namespace's veth end
    holds no address (the guest does)."""
    pid = vmm_pid(d, sid)
    st = json.loads((Config(home=d.home).sandboxes_dir / sid / "net.json").read_text())
    ns = f"cpuos-{d.net_env['CPUOS_NET_ID']}-n{st['index']}"
    mine = os.readlink(f"/proc/{pid}/ns/net")
    assert mine != os.readlink("/proc/self/ns/net")
    assert os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat(f"/var/run/netns/{ns}").st_ino
    links = json.loads(subprocess.run(["ip", "-n", ns, "-d", "-j", "addr"], capture_output=True,
                                      text=True, check=True).stdout)
    by = {x["ifname"]: x for x in links}
    uid = int(open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0])
    assert by["tap0"]["linkinfo"]["info_data"]["user"] == uid
    assert by["tap0"]["linkinfo"]["info_data"]["pi"] is False
    assert not [a for a in by["eth0"].get("addr_info", []) if a["family"] == "inet"]


def denied_listeners_untouched(inet: FakeInternet) -> None:
    bad = [e for e in inet.seen() if e["listener"] != "dns" and (
        any(e["listener"].startswith(h) or e["listener"].startswith(f"udp {h}")
            for h in DENIED_LISTENERS) or e["listener"].startswith(SMTP))]
    assert not bad, f"a denied listener saw a connection: {bad}"


def serve(d: Daemon, s: Sandbox, port: int) -> str:
    """``python3 -m http.server`` inside on port, exposed: its preview URL (path form)
    once it answers through the proxy, with the token in a header."""
    s.files.write("/work/hello.txt", f"hello from {s.id}\n".encode())
    s.exec(f"cd /work && nohup python3 -m http.server {port} >/tmp/http.log 2>&1 &")
    with d.client() as c:
        r = c.post(f"/sandboxes/{s.id}/ports", json={"port": port})
        assert r.status_code == 201, r.text
        p = r.json()
    url = p["url"].split("?")[0] + "hello.txt"
    tok = {"X-Cpuos-Token": p["token"]}

    def up() -> bool:
        try:
            return httpx.get(url, headers=tok, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, "the server inside the guest, through the preview proxy", 120)
    return json.dumps({"url": url, "token": p["token"]})


def fetch(served: str) -> httpx.Response:
    p = json.loads(served)
    return httpx.get(p["url"], headers={"X-Cpuos-Token": p["token"]}, timeout=120)


def test_allowlist_reaches_the_allowed_name_only(vmd: Daemon, inet: FakeInternet) -> None:
    s = create(vmd, {"allow": ["allowed.test"]})  # (the template's first boot, under TCG)
    try:
        assert guest_address(s) == assigned_address(vmd, s.id)
        ok, out = curl(s, "http://allowed.test/")
        assert ok and '"hello": true' in out, out
        assert not curl(s, "http://other.test/")[0]
        assert not curl(s, f"http://{WEB}/")[0]  # an address is no name
        for url in ("http://169.254.169.254/latest/meta-data/", "http://10.9.9.9/",
                    "http://meta.test/", "http://evil.test/"):
            ok, out = curl(s, url)
            assert not ok, f"{url} got through: {out}"
        # root in a VM's guest can send anything: the host's firewall decides, not the
        # guest's routes (UDP to 10.x goes nowhere and is recorded)
        s.exec(["python3", "-c", "import socket\n"
                "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                "s.sendto(b'hello', ('10.9.9.9', 123))\n"])
        denied_listeners_untouched(inet)
        recs = records(vmd, s.id)
        tcp = [r for r in recs if r["proto"] == "tcp"]
        assert any(r.get("name") == "allowed.test" and r["verdict"] == "allowed"
                   and r["bytes_in"] > 0 for r in tcp), tcp
        assert any(r.get("name") == "other.test" and r["verdict"] == "denied" for r in recs)
        for dst in ("169.254.169.254", "10.9.9.9"):
            assert any(r.get("dst") == dst and r.get("port") == 80 and r["verdict"] == "denied"
                       for r in tcp), (dst, tcp)
        wait_until(lambda: any(r["proto"] == "udp" and r.get("dst") == "10.9.9.9"
                               and r["verdict"] == "denied" for r in records(vmd, s.id)),
                   "the UDP attempt recorded", 30)
        # the policy changes while the VM runs
        s.network.update("on")
        assert curl(s, f"http://{WEB}/")[0]
    finally:
        s.kill()


def test_off_has_no_route_and_still_serves_its_ports(vmd: Daemon, inet: FakeInternet) -> None:
    s = create(vmd, "off")  # a clone: a standby QEMU handed out, its tap moved
    try:
        assert guest_address(s) == assigned_address(vmd, s.id)
        check_link(vmd, s.id)
        n = len(inet.seen())
        ok, out = curl(s, f"http://{WEB}/", limit=3)
        assert not ok, out
        assert not curl(s, "http://allowed.test/", limit=3)[0]
        assert not [e for e in inet.seen()[n:] if e["listener"] != "dns"]
        wait_until(lambda: any(r.get("dst") == WEB and r["verdict"] == "denied"
                               and "routing" in r.get("rule", "")
                               for r in records(vmd, s.id)), "the attempt recorded", 30)
        served = serve(vmd, s, 8000)
        assert fetch(served).text == f"hello from {s.id}\n"
        # a paused VM is woken by a request to its port: a new namespace and address,
        # which the guest is told; the server inside answers there
        s.pause()
        assert s.info().state == "paused"
        r = fetch(served)
        assert (r.status_code, r.text) == (200, f"hello from {s.id}\n")
        assert s.info().state == "running"
        assert guest_address(s) == assigned_address(vmd, s.id)
    finally:
        s.kill()


SECRET = "sk-real-value-" + "7" * 24


def test_a_secret_reaches_its_host_only(vmd: Daemon, inet: FakeInternet) -> None:
    """The guest trusts the sandbox's CA (sent by the agent: the host cannot place files in
    a VM), so HTTPS to the secret's host ends at the egress proxy, which puts the value in;
    the guest sees the placeholder only."""
    s = create(vmd, {"allow": ["other.test"]},
               secrets={"API_KEY": {"value": SECRET, "hosts": ["allowed.test"]}})
    try:
        placeholder = s.exec("printf %s \"$API_KEY\"").stdout
        assert placeholder.startswith("cpuos-secret-") and SECRET not in placeholder
        assert s.exec('test -s "$SSL_CERT_FILE" && test -s "$NODE_EXTRA_CA_CERTS"').exit_code == 0
        hdr = "Authorization: Bearer $API_KEY"

        def sent(url: str) -> list[str]:
            n = len(inet.seen())
            r = s.exec(f"curl -sS -m 20 -o /dev/null -H \"{hdr}\" {url}", timeout="2m")
            assert r.exit_code == 0, r.stderr
            return [e["data"] for e in inet.seen()[n:] if "Authorization" in e.get("data", "")]

        got = sent("https://allowed.test:8443/bytes/10")
        assert got and SECRET in got[0] and "Host: allowed.test" in got[0]
        got = sent("http://other.test/bytes/10")  # any other host: the placeholder
        assert got and SECRET not in got[0] and placeholder in got[0]
        assert SECRET not in s.exec("cat /run/cpuos/ca-bundle.pem; env").stdout
    finally:
        s.kill()


def test_pause_resume_and_fork_keep_the_network(vmd: Daemon) -> None:
    s = create(vmd, "on")
    clones: list[Sandbox] = []
    try:
        assert curl(s, f"http://{WEB}/")[0]
        before = guest_address(s)
        s.pause()
        s = Sandbox.resume(s.id, **vmd.sdk_kwargs())
        after = guest_address(s)
        assert after == assigned_address(vmd, s.id) and after != before
        assert curl(s, f"http://{WEB}/")[0]
        clones = s.fork(1)
        (c,) = clones
        mine = guest_address(c)
        assert mine == assigned_address(vmd, c.id) and mine != after
        ok, out = curl(c, f"http://{WEB}/")
        assert ok, out
        assert any(r["verdict"] == "allowed" for r in records(vmd, c.id))
        assert curl(s, f"http://{WEB}/")[0]
    finally:
        for c in clones:
            c.kill()
        s.kill()
    # what is left once namespaces removed in the background are gone: the spare
    # (CPUOS_NETNS_POOL=1), nothing in the table's source set, no tap in the host's namespace
    tag = vmd.net_env["CPUOS_NET_ID"]

    def src_elements() -> list[Any]:
        out = subprocess.run(["nft", "-j", "list", "set", "inet", f"cpuos_{tag}", "src"],
                             capture_output=True, text=True).stdout
        elems: list[Any] = json.loads(out)["nftables"][1]["set"].get("elem", [])
        return elems

    wait_until(lambda: len([x for x in vmd.network_leftovers() if x.startswith("netns ")])
               <= 1 and not src_elements() and not host_taps(),
               "namespaces, rules and taps of killed microVMs removed", 60)
