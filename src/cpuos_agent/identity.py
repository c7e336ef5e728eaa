"""Who this sandbox is (hostname, machine-id, randomness, clock) and what keeps the agent's
channel its own (its key, not dumpable, no inheritable capabilities).

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import socket
import struct
import time

from . import protocol as P
from .files import _unlink_quiet, create_beside, read_small
from .privs import privileged

MACHINE_ID_PATH = "/run/cpuos/machine-id"  # /etc/machine-id links here (templates)
HOSTS_PATH = "/etc/hosts"
HOSTS_MARK = "# cpuos"  # the lines of /etc/hosts the agent keeps
# the sandbox's egress CA (secrets: the proxy ends TLS for a secret's hosts), alone and
# with the template's bundle: what SSL_CERT_FILE and the like name (cpuosd.network.secrets)
CA_DIR = "/run/cpuos"
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_RE = re.compile(r"-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]{64,8192}"
                   r"-----END CERTIFICATE-----\n?")


RNDADDENTROPY = 0x40085203


RNDRESEEDCRNG = 0x5207


CLOCK_SLACK = 0.05  # s: a guest clock this close to the host's is left alone


def apply_identity(h: P.Header) -> list[str]:
    """What a sandbox gets new after every boot, restore and clone, sent by the host right
    after the hello: its hostname, its machine-id, fresh randomness (every clone of one
    snapshot would otherwise share the kernel RNG's state) and the time (a restored VM's
    clock stands where the snapshot stopped it). Applied as far as this agent may (gVisor:
    the sentry keeps the time and randomness; the host serves machine-id); returns what
    changed."""
    applied = []
    name = h.get("hostname")
    if isinstance(name, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", name):
        if name != os.uname().nodename:
            try:
                with privileged():
                    socket.sethostname(name)
                applied.append("hostname")
            except OSError:
                pass
        try:
            if write_hosts(name):
                applied.append("hosts")
        except OSError:
            pass
    mid = h.get("machine_id")
    if isinstance(mid, str) and re.fullmatch(r"[0-9a-f]{32}", mid):
        # a directory the user may write (microVM): as the user, never blocking on what
        # sits there (files.py)
        try:
            current = read_small(MACHINE_ID_PATH, 64).decode(errors="replace").strip()
        except OSError:
            current = ""
        if current != mid:
            tmp = ""
            try:
                fd, tmp = create_beside(MACHINE_ID_PATH, 0o444)
                with os.fdopen(fd, "w") as f:
                    f.write(mid + "\n")
                os.replace(tmp, MACHINE_ID_PATH)
                applied.append("machine-id")
            except OSError:
                if tmp:
                    _unlink_quiet(tmp)
    seed = h.get("seed")
    if isinstance(seed, str) and re.fullmatch(r"(?:[0-9a-f]{2}){16,256}", seed):
        data = bytes.fromhex(seed)
        try:
            fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                os.write(fd, data)  # mixed in, not credited: anyone may
                applied.append("rng")
                try:  # credited and reseeded now (CAP_SYS_ADMIN)
                    info = struct.pack("ii", len(data) * 8, len(data)) + data
                    with privileged():
                        fcntl.ioctl(fd, RNDADDENTROPY, info)
                        fcntl.ioctl(fd, RNDRESEEDCRNG)
                    applied.append("rng-reseed")
                except OSError:
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
    ca = h.get("ca")
    if isinstance(ca, str) and CA_RE.fullmatch(ca):
        try:
            place_ca(ca)
            applied.append("ca")
        except OSError:
            pass
    net = h.get("net")
    if isinstance(net, dict):
        try:
            if apply_net(net):
                applied.append("net")
        except (OSError, ValueError):
            pass
    now = h.get("time")
    if isinstance(now, (int, float)) and abs(time.time() - now) > CLOCK_SLACK:
        try:
            with privileged():
                time.clock_settime(time.CLOCK_REALTIME, float(now))
            applied.append("clock")
        except (OSError, OverflowError):
            pass
    return applied


def write_hosts(name: str, path: str | None = None) -> bool:
    """/etc/hosts names localhost and this sandbox (``127.0.1.1 <hostname>``, as Debian
    does), or ``localhost`` and ``gethostbyname(gethostname())`` would go to DNS — refused
    with the network off, answered by nobody on the internet. The template's own lines are
    kept; the agent's (marked) are rewritten. True if the file changed."""
    path = path or HOSTS_PATH
    try:
        current = read_small(path, 1 << 16).decode(errors="replace")
    except OSError:
        current = ""
    lines = [ln for ln in current.splitlines() if not ln.rstrip().endswith(HOSTS_MARK)]
    names = {(fields[0], n) for ln in lines if (fields := ln.split("#", 1)[0].split())
             for n in fields[1:]}
    if ("127.0.0.1", "localhost") not in names:
        lines.append(f"127.0.0.1\tlocalhost {HOSTS_MARK}")
    if ("::1", "localhost") not in names:
        lines.append(f"::1\tlocalhost ip6-localhost ip6-loopback {HOSTS_MARK}")
    lines.append(f"127.0.1.1\t{name} {HOSTS_MARK}")
    text = "\n".join(lines) + "\n"
    if text == current:
        return False
    with privileged():
        fd, tmp = create_beside(path, 0o644)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quiet(tmp)
            raise
    return True


# linux/sockios.h, linux/if.h, linux/route.h
SIOCADDRT, SIOCGIFFLAGS, SIOCSIFFLAGS = 0x890B, 0x8913, 0x8914
SIOCGIFADDR, SIOCSIFADDR, SIOCSIFNETMASK = 0x8915, 0x8916, 0x891C
SIOCDARP = 0x8953
IFF_UP = 0x1
RTF_UP, RTF_GATEWAY = 0x1, 0x2


def _sockaddr(ip: str) -> bytes:
    return struct.pack("=HH4s8x", socket.AF_INET, 0, socket.inet_aton(ip))


def _ifreq(name: str, data: bytes = b"") -> bytes:
    return struct.pack("16s24s", name.encode(), data)


def _flags(s: socket.socket, name: str, up: bool | None = None) -> int:
    got = fcntl.ioctl(s, SIOCGIFFLAGS, _ifreq(name))
    flags: int = struct.unpack_from("H", got, 16)[0]
    if up is not None and bool(flags & IFF_UP) != up:
        flags = flags | IFF_UP if up else flags & ~IFF_UP
        fcntl.ioctl(s, SIOCSIFFLAGS, _ifreq(name, struct.pack("H", flags)))
    return flags


def _address(s: socket.socket, name: str) -> str | None:
    try:
        got = fcntl.ioctl(s, SIOCGIFADDR, _ifreq(name))
    except OSError:
        return None  # none yet (EADDRNOTAVAIL)
    return socket.inet_ntoa(got[20:24])


def _default_via(gateway: str) -> bool:
    """A default route through gateway in the main table (/proc/net/route)."""
    want = f"{struct.unpack('=I', socket.inet_aton(gateway))[0]:08X}"  # as the kernel prints
    try:
        with open("/proc/net/route") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return False
    return any(len(r) > 2 and r[1] == "00000000" and r[2] == want for r in rows)


def guest_interface() -> str | None:
    """The guest's one network interface (a microVM's virtio-net), or None."""
    try:
        names = sorted(n for n in os.listdir("/sys/class/net") if n != "lo")
    except OSError:
        return None
    return "eth0" if "eth0" in names else (names[0] if names else None)


def apply_net(net: P.Header) -> bool:
    """A microVM's interface takes the address the host gave this sandbox (each clone and
    every restore has a namespace and an address of its own: the snapshot's is stale); the
    loopback comes up. Down and up flushes the old routes and neighbours (the gateway has
    a new MAC). Returns whether anything changed. Needs CAP_NET_ADMIN (the microVM's /init
    keeps it for the agent); the host's firewall, not this, decides what gets out."""
    import ipaddress  # (a microVM's only: not resident in every agent)

    iface = ipaddress.IPv4Interface(f"{net.get('address')}/{int(net.get('prefix', 30))}")
    gateway = ipaddress.IPv4Address(str(net.get("gateway")))
    if gateway not in iface.network or gateway == iface.ip or iface.network.prefixlen < 8:
        raise ValueError("gateway outside the interface's network")
    name = guest_interface()
    if name is None:
        return False
    changed = False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, privileged():
        if not _flags(s, "lo") & IFF_UP:
            _flags(s, "lo", up=True)
            changed = True
        addr, gw = str(iface.ip), str(gateway)
        if _address(s, name) == addr and _flags(s, name) & IFF_UP and _default_via(gw):
            # the same address again (the pool came round): the gateway is a new veth, with
            # a new MAC; the guest's entry for it would hold the old one for ~30 s
            arp = struct.pack("16s16si16s16s", _sockaddr(gw), b"", 0, b"", name.encode())
            with contextlib.suppress(OSError):  # (ENXIO: no entry)
                fcntl.ioctl(s, SIOCDARP, arp)
            return changed
        with contextlib.suppress(OSError):  # no IPv6 (the host drops it anyway)
            with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as f:
                f.write("1")
        _flags(s, name, up=False)
        fcntl.ioctl(s, SIOCSIFADDR, _ifreq(name, _sockaddr(addr)))
        fcntl.ioctl(s, SIOCSIFNETMASK, _ifreq(name, _sockaddr(str(iface.netmask))))
        _flags(s, name, up=True)
        rt = struct.pack("@L16s16s16sHhLPhPLLH6x", 0, _sockaddr("0.0.0.0"), _sockaddr(gw),
                         _sockaddr("0.0.0.0"), RTF_UP | RTF_GATEWAY, 0, 0, 0, 0, 0, 0, 0, 0)
        try:
            fcntl.ioctl(s, SIOCADDRT, rt)
        except FileExistsError:
            pass
    return True


def _write_beside(path: str, data: bytes) -> None:
    tmp = ""
    try:
        fd, tmp = create_beside(path, 0o444)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp:
            _unlink_quiet(tmp)
        raise


def place_ca(pem: str) -> None:
    """A VM's guest: the host cannot place files in it, so the sandbox's CA comes with the
    identity (gVisor's /run/cpuos is the host's directory, written there)."""
    try:
        system = read_small(SYSTEM_BUNDLE, 4 << 20).decode(errors="replace").rstrip()
    except OSError:
        system = ""
    pem = pem if pem.endswith("\n") else pem + "\n"
    _write_beside(f"{CA_DIR}/ca.pem", pem.encode())
    _write_beside(f"{CA_DIR}/ca-bundle.pem", (system + "\n" + pem).encode())


def read_key(path: str = P.KEY_PATH) -> str:
    """The key the host left for this agent ("" if none: a microVM's agent, whose channel
    is a device only it can open)."""
    try:
        key = read_small(path, 128).decode(errors="replace").strip()
    except OSError:
        return ""
    return key if re.fullmatch(P.KEY_RE, key) else ""


def not_dumpable() -> None:
    """No process of the commands' uid may read this one's memory, fds or environment
    (/proc/1/mem, /proc/1/fd, ptrace): the agent key lives there."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def drop_inheritable_caps() -> None:
    """The microVM's /init hands the agent CAP_SYS_ADMIN and CAP_SYS_TIME (hostname,
    RNG reseed, clock) as ambient capabilities; keep them for the agent alone: clear the
    ambient and inheritable sets, so nothing it runs gets them back."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if libc.capget(hdr, data) != 0:
        return
    data[2] = data[5] = 0  # inheritable (both 32-bit halves)
    libc.capset(hdr, data)
