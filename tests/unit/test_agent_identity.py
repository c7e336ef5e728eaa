"""The agent's ``identity`` handling (apply_identity): what it applies, what it refuses.
The system calls are replaced: the test must not rename this host or set its clock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from cpuos_agent import identity as A

MID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {"urandom": b""}
    monkeypatch.setattr(socket, "sethostname", lambda n: seen.__setitem__("hostname", n))
    monkeypatch.setattr(time, "clock_settime",
                        lambda clk, t: seen.__setitem__("clock", (clk, t)))
    monkeypatch.setattr(A, "MACHINE_ID_PATH", str(tmp_path / "machine-id"))
    monkeypatch.setattr(A, "HOSTS_PATH", str(tmp_path / "hosts"))  # never the host's
    real_open = os.open

    def fake_open(path: str, flags: int, *a: Any) -> int:
        if path == "/dev/urandom":  # a file stands in for it; the ioctls then fail
            return real_open(str(tmp_path / "urandom"), os.O_WRONLY | os.O_CREAT, 0o600)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", fake_open)
    seen["urandom_path"] = tmp_path / "urandom"
    return seen


def test_identity_is_applied(calls: dict[str, Any]) -> None:
    seed = bytes(range(64))
    applied = A.apply_identity({"t": "identity", "hostname": "sbx-abc123", "machine_id": MID,
                                "seed": seed.hex(), "time": time.time() + 3600})
    # no rng-reseed: not a tty
    assert applied == ["hostname", "hosts", "machine-id", "rng", "clock"]
    assert calls["hostname"] == "sbx-abc123"
    assert Path(A.HOSTS_PATH).read_text().splitlines() == [
        "127.0.0.1\tlocalhost # cpuos", "::1\tlocalhost ip6-localhost ip6-loopback # cpuos",
        "127.0.1.1\tsbx-abc123 # cpuos"]
    assert Path(A.MACHINE_ID_PATH).read_text() == MID + "\n"
    assert calls["urandom_path"].read_bytes() == seed
    assert abs(calls["clock"][1] - (time.time() + 3600)) < 5
    # the same again: nothing left to change but the randomness
    applied = A.apply_identity({"hostname": os.uname().nodename, "machine_id": MID,
                                "seed": seed.hex(), "time": time.time()})
    assert applied == ["hosts", "rng"]  # (its hostname is this host's name now)
    applied = A.apply_identity({"hostname": os.uname().nodename, "machine_id": MID,
                                "seed": seed.hex(), "time": time.time()})
    assert applied == ["rng"]


def test_hosts_keeps_the_templates_lines(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.1.2.3 db.internal\n127.0.1.1 old # cpuos\n")
    assert A.write_hosts("sbx-new", str(hosts))
    assert hosts.read_text().splitlines() == [
        "127.0.0.1 localhost", "10.1.2.3 db.internal",
        "::1\tlocalhost ip6-localhost ip6-loopback # cpuos", "127.0.1.1\tsbx-new # cpuos"]
    assert not A.write_hosts("sbx-new", str(hosts))


@pytest.mark.parametrize("bad", [
    {"hostname": "../etc"}, {"hostname": "UPPER"}, {"hostname": "a" * 64},
    {"hostname": 7}, {"machine_id": "xyz"}, {"machine_id": MID + "00"},
    {"seed": "00"}, {"seed": "zz" * 32}, {"seed": "00" * 300}, {"time": "now"},
])
def test_malformed_identity_is_ignored(calls: dict[str, Any], bad: dict[str, Any]) -> None:
    assert A.apply_identity({"t": "identity", **bad}) == []
    assert "hostname" not in calls and "clock" not in calls
    assert not Path(A.MACHINE_ID_PATH).exists()


@pytest.mark.parametrize("net", [
    {"address": "10.0.0.2", "gateway": "10.0.1.1", "prefix": 30},  # gateway outside
    {"address": "10.0.0.2", "gateway": "10.0.0.2", "prefix": 30},  # gateway is the address
    {"address": "10.0.0.2", "gateway": "10.0.0.1", "prefix": 4},
    {"address": "fd00::2", "gateway": "fd00::1", "prefix": 64},
    {"address": "10.0.0.2; reboot", "gateway": "10.0.0.1"}, {"address": 7},
])
def test_malformed_network_is_ignored(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                      net: dict[str, Any]) -> None:
    monkeypatch.setattr(fcntl, "ioctl", lambda *a: pytest.fail("an ioctl was made"))
    assert A.apply_identity({"t": "identity", "net": net}) == []


def test_network_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interface goes down (old routes and neighbours go), takes the address and
    netmask, comes up, and gets the default route; the loopback comes up. (The ioctls are
    recorded, not made: this host's interfaces stay as they are.)"""
    made: list[tuple[int, bytes]] = []

    def ioctl(_s: Any, req: int, arg: bytes) -> bytes:
        made.append((req, arg))
        if req == A.SIOCGIFADDR:
            raise OSError(99, "no address")
        return arg[:16] + b"\0" * 24 if req == A.SIOCGIFFLAGS else arg

    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    monkeypatch.setattr(A, "guest_interface", lambda: "eth9")
    monkeypatch.setattr(A, "privileged", contextlib.nullcontext)
    applied = A.apply_identity({"net": {"address": "10.213.0.6", "gateway": "10.213.0.5",
                                        "prefix": 30}})
    assert applied == ["net"]
    sets = [(r, a) for r, a in made if r in (A.SIOCSIFFLAGS, A.SIOCSIFADDR,
                                             A.SIOCSIFNETMASK, A.SIOCADDRT)]
    assert [r for r, _ in sets] == [A.SIOCSIFFLAGS, A.SIOCSIFADDR, A.SIOCSIFNETMASK,
                                    A.SIOCSIFFLAGS, A.SIOCADDRT]
    assert sets[0][1].startswith(b"lo\0")  # the loopback up (it was down)
    assert socket.inet_aton("10.213.0.6") in sets[1][1]
    assert socket.inet_aton("255.255.255.252") in sets[2][1]
    assert socket.inet_aton("10.213.0.5") in sets[4][1]


def test_ca_is_placed_beside_the_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                       ) -> None:
    """A VM's guest gets its egress CA through the identity: alone, and after the system
    bundle; anything not shaped like one PEM certificate is ignored."""
    system = tmp_path / "system.crt"
    system.write_text("-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(A, "CA_DIR", str(tmp_path))
    monkeypatch.setattr(A, "SYSTEM_BUNDLE", str(system))
    pem = "-----BEGIN CERTIFICATE-----\n" + "QUJD" * 40 + "\n-----END CERTIFICATE-----\n"
    for bad in ("x", pem + "more", pem.replace("QUJD", "<>;!"), 7):
        assert A.apply_identity({"ca": bad}) == []
    assert not (tmp_path / "ca.pem").exists()
    assert A.apply_identity({"ca": pem}) == ["ca"]
    assert (tmp_path / "ca.pem").read_text() == pem
    assert (tmp_path / "ca-bundle.pem").read_text() == system.read_text() + pem
    assert (tmp_path / "ca.pem").stat().st_mode & 0o777 == 0o444


def test_same_network_again_forgets_the_gateways_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    """Already configured (a restore that drew the same address): no change, but the
    gateway's ARP entry goes (its veth is new)."""
    made: list[tuple[int, bytes]] = []

    def ioctl(_s: Any, req: int, arg: bytes) -> bytes:
        made.append((req, arg))
        if req == A.SIOCGIFADDR:
            return arg[:20] + socket.inet_aton("10.213.0.6") + b"\0" * 16
        return arg[:16] + struct.pack("H", A.IFF_UP) + b"\0" * 22 \
            if req == A.SIOCGIFFLAGS else arg

    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    monkeypatch.setattr(A, "guest_interface", lambda: "eth9")
    monkeypatch.setattr(A, "privileged", contextlib.nullcontext)
    monkeypatch.setattr(A, "_default_via", lambda gw: gw == "10.213.0.5")
    assert A.apply_identity({"net": {"address": "10.213.0.6", "gateway": "10.213.0.5",
                                     "prefix": 30}}) == []
    assert [r for r, _ in made if r not in (A.SIOCGIFFLAGS, A.SIOCGIFADDR)] == [A.SIOCDARP]
    arp = next(a for r, a in made if r == A.SIOCDARP)
    assert socket.inet_aton("10.213.0.5") in arp[:16] and arp[52:57] == b"eth9\0"
