"""A microVM's network link: its tap device joined to the sandbox's network namespace.

Every QEMU is jailed in an empty network namespace of its own (``jailer --new-netns``)
holding one persistent tap (``TAP``, made by the jailer, owned by the VM's uid: QEMU opens
it by name, with no capability). When the VM becomes a sandbox's (a boot, a restore, a
standby VM handed out) and the sandbox has a namespace from the daemon's network
(``cpuosd.network``, through its backend wrapper: the same pool, addresses, nftables
table, resolver, egress proxy and records as gVisor's), the tap is moved into that
namespace (QEMU's open file keeps working), and there it is tied to the namespace's end
of the veth pair, ``eth0``, with two tc ``mirred`` redirects (ingress of one -> egress of
the other, both ways): frames pass between the guest and the host end unchanged, the
namespace's own stack never sees them. ``eth0`` loses the sandbox's address, which the
guest takes (the agent sets it at every boot and restore, ``cpuos_agent.identity``).

No bridge on the host: what leaves the guest arrives on the sandbox's host interface
(``cv<tag>n<i>``), exactly as a gVisor sandbox's traffic does, and meets the same rules
(spoofed sources, IPv6, routing, the steer to the proxy and resolver). The tap goes with
the namespace it is in: QEMU's when the VM ends before it was moved, the sandbox's (which
the network removes) otherwise.
"""

from __future__ import annotations

import os

from ... import procs

TAP = "tap0"
SANDBOX_IF = "eth0"  # the namespace's end of the veth pair (cpuosd.network.netns)
NETNS_DIRS = ("/var/run/netns", "/run/netns")


class TapError(RuntimeError):
    pass


def _run(argv: list[str], batch: str | None = None) -> None:
    rc, _, err = procs.run_sync([*argv, *(["-batch", "-"] if batch else [])],
                                input=batch.encode() if batch else None, timeout=30)
    if rc != 0:
        raise TapError(f"{' '.join(argv)}: {err.decode(errors='replace').strip()[-400:]}")


def netns_name(path: str) -> str:
    """The name of a namespace the daemon's network made (``ip netns``) from its path."""
    d, name = os.path.split(path)
    if d not in NETNS_DIRS or not name or name.startswith("."):
        raise TapError(f"{path!r} is not a named network namespace")
    return name


def attach(netns_path: str, vmm_pid: int, tap: str = TAP) -> None:
    """Move the tap of the VMM ``vmm_pid`` (in the VMM's own namespace) into the
    namespace at netns_path and tie it to eth0 there. Blocking: run it in a thread."""
    name = netns_name(netns_path)
    _run(["nsenter", f"--net=/proc/{vmm_pid}/ns/net", "--", "ip", "link", "set", "dev", tap,
          "netns", name])
    _run(["ip", "-n", name], batch=f"addr flush dev {SANDBOX_IF}\n"
                                   f"link set dev {tap} up\n")
    redirect = "protocol all u32 match u8 0 0 action mirred egress redirect dev"
    _run(["tc", "-n", name], batch=f"qdisc add dev {SANDBOX_IF} ingress\n"
                                   f"filter add dev {SANDBOX_IF} parent ffff: {redirect} {tap}\n"
                                   f"qdisc add dev {tap} ingress\n"
                                   f"filter add dev {tap} parent ffff: {redirect} {SANDBOX_IF}\n")
