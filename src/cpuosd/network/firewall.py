"""The daemon's one nftables table, ``inet cpuos`` (``cpuos_<tag>`` with CPUOS_NET_ID),
written as nftables JSON (``nft -j``).

A sandbox's traffic reaches exactly two sockets on the host: the egress proxy (every TCP
connection, redirected, whatever its destination), only when its mode lets it out, and the
DNS resolver (UDP 53, redirected; it refuses every name for a sandbox whose network is off).
Everything else from a sandbox interface (``cv<tag>n*``) is refused (a TCP reset, else an
ICMP error: nothing is left to time out) and logged to NFLOG group ``LOG_GROUP`` (recorded
by the daemon): forwarding anywhere, any other port or address of the host (its API, its
other services), IPv6, and packets whose source address is not the interface's own
(spoofing). The table is rebuilt at start and removed at shutdown; per-sandbox state lives
in two sets:
``egress`` (interfaces whose mode is ``on`` or ``allowlist``) and ``src`` (interface .
its address).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .. import procs

log = logging.getLogger("cpuosd.network")

FAMILY = "inet"
LOG_GROUP = 7
ND = ("nd-neighbor-solicit", "nd-neighbor-advert")
V6_CHATTER = ("nd-router-solicit", "mld-listener-query", "mld-listener-report",
              "mld-listener-done", "mld2-listener-report")


class FirewallError(RuntimeError):
    pass


def _m(left: dict[str, Any], right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def _payload(proto: str, fieldname: str) -> dict[str, Any]:
    return {"payload": {"protocol": proto, "field": fieldname}}


class Names:
    """The table and interface pattern of one daemon (see netns.net_id)."""

    def __init__(self, tag: str = "", log_group: int | None = None) -> None:
        self.table = f"cpuos_{tag}" if tag else "cpuos"
        self.ifaces = f"cv{tag}n*"
        self.log_group = LOG_GROUP if log_group is None else log_group


def _tbl(n: Names, **kw: Any) -> dict[str, Any]:
    return {"family": FAMILY, "table": n.table, **kw}


def _log(n: Names, prefix: str) -> dict[str, Any]:
    return {"log": {"group": n.log_group, "prefix": prefix}}


def ruleset(n: Names, proxy_port: int, dns_port: int) -> list[dict[str, Any]]:
    """The whole table, as commands for ``nft -j -f -`` (it replaces an old one)."""
    from_sbx = _m(_meta("iifname"), n.ifaces)
    reject = {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}
    chains = {
        # first, before conntrack: no IPv6, no spoofed source
        "guard": ({"type": "filter", "hook": "prerouting", "prio": -300, "policy": "accept"}, [
            # IPv6: the sandbox has an address and a default route (netns.py) only so that an
            # attempt leaves its stack and is seen here; neighbour discovery with the host end
            # passes (else nothing is sent), the netstack's router solicitations and MLD
            # reports are dropped (not worth a record), everything else is refused at once
            # (a reset for TCP) and recorded
            [from_sbx, _m(_payload("icmpv6", "type"), {"set": list(ND)}), {"accept": None}],
            [from_sbx, _m(_meta("l4proto"), "ipv6-icmp"),
             _m(_payload("icmpv6", "type"), {"set": list(V6_CHATTER)}), {"drop": None}],
            [from_sbx, _m(_meta("nfproto"), "ipv6"), _m(_meta("l4proto"), "tcp"),
             _log(n, "cpuos v6 "), {"reject": {"type": "tcp reset"}}],
            [from_sbx, _m(_meta("nfproto"), "ipv6"), _log(n, "cpuos v6 "), reject],
            [from_sbx, _m({"concat": [_meta("iifname"), _payload("ip", "saddr")]}, "@src",
                          "!="), _log(n, "cpuos spoof "), {"drop": None}],
        ]),
        # a sandbox allowed out: TCP to the proxy; every sandbox: DNS to the resolver (both
        # on the host), which answers one whose network is off at once with REFUSED (and
        # records it) rather than leave its lookups to time out
        "steer": ({"type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}, [
            [_m(_meta("iifname"), "@egress"), _m(_meta("l4proto"), "tcp"),
             {"redirect": {"port": proxy_port}}],
            [from_sbx, _m(_payload("udp", "dport"), 53), {"redirect": {"port": dns_port}}],
        ]),
        # what would be routed on (the host may not forward at all): refused and logged
        # here, before the routing decision, unless it was redirected to the proxy/resolver
        "route": ({"type": "filter", "hook": "prerouting", "prio": 0, "policy": "accept"}, [
            [from_sbx, _m({"ct": {"key": "status"}}, "dnat", "in"), {"accept": None}],
            # (of IPv6 only neighbour discovery is left after "guard")
            [from_sbx, _m(_meta("nfproto"), "ipv6"), {"accept": None}],
            # refused rather than dropped (the kernel takes reject at prerouting since 5.11):
            # a sandbox with its network off learns at once that nothing answers, instead of
            # waiting out a TCP connect's timeout (~2 min: a browser's page)
            [from_sbx, _m({"fib": {"result": "type", "flags": ["daddr"]}}, "local", "!="),
             _m(_meta("l4proto"), "tcp"), _log(n, "cpuos fwd "),
             {"reject": {"type": "tcp reset"}}],
            [from_sbx, _m({"fib": {"result": "type", "flags": ["daddr"]}}, "local", "!="),
             _log(n, "cpuos fwd "), reject],
        ]),
        "in": ({"type": "filter", "hook": "input", "prio": 0, "policy": "accept"}, [
            [from_sbx, _m({"ct": {"key": "state"}}, ["established", "related"], "in"),
             {"accept": None}],
            [from_sbx, _m({"ct": {"key": "status"}}, "dnat", "in"),
             _m(_payload("tcp", "dport"), proxy_port), {"accept": None}],
            [from_sbx, _m({"ct": {"key": "status"}}, "dnat", "in"),
             _m(_payload("udp", "dport"), dns_port), {"accept": None}],
            [from_sbx, _m(_meta("nfproto"), "ipv6"), {"accept": None}],  # (as in "route")
            [from_sbx, _log(n, "cpuos in "), reject],
            # the proxy and resolver serve sandboxes only
            [_m(_payload("tcp", "dport"), proxy_port), {"drop": None}],
            [_m(_payload("udp", "dport"), dns_port), {"drop": None}],
        ]),
        "fwd": ({"type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}, [
            [from_sbx, _log(n, "cpuos fwd "), reject],
            [_m(_meta("oifname"), n.ifaces), {"drop": None}],
        ]),
    }
    cmds: list[dict[str, Any]] = [
        {"add": {"table": {"family": FAMILY, "name": n.table}}},
        {"delete": {"table": {"family": FAMILY, "name": n.table}}},
        {"add": {"table": {"family": FAMILY, "name": n.table}}},
        {"add": {"set": _tbl(n, name="egress", type="ifname")}},
        {"add": {"set": _tbl(n, name="src", type=["ifname", "ipv4_addr"])}},
    ]
    for name, (base, rules) in chains.items():
        cmds.append({"add": {"chain": _tbl(n, name=name, **base)}})
        for expr in rules:
            cmds.append({"add": {"rule": _tbl(n, chain=name, expr=expr)}})
    return cmds


def _nft(cmds: list[dict[str, Any]]) -> None:
    rc, _, err = procs.run_sync(["nft", "-j", "-f", "-"],
                                input=json.dumps({"nftables": cmds}).encode(), timeout=30)
    if rc != 0:
        raise FirewallError(f"nft failed (exit {rc}): {err.decode(errors='replace')[-600:]}")


def install(n: Names, proxy_port: int, dns_port: int) -> None:
    _nft(ruleset(n, proxy_port, dns_port))


def remove(n: Names) -> None:
    _nft([{"add": {"table": {"family": FAMILY, "name": n.table}}},
          {"delete": {"table": {"family": FAMILY, "name": n.table}}}])


def _elem(n: Names, verb: str, name: str, elem: Any) -> dict[str, Any]:
    return {verb: {"element": _tbl(n, name=name, elem=[elem])}}


def add_interface(n: Names, host_if: str, address: str, egress: bool) -> None:
    cmds = [_elem(n, "add", "src", {"concat": [host_if, address]})]
    if egress:
        cmds.append(_elem(n, "add", "egress", host_if))
    _nft(cmds)


def set_egress(n: Names, host_if: str, egress: bool) -> None:
    # add, then delete only when asked: "delete" of an absent element fails
    cmds = [_elem(n, "add", "egress", host_if)]
    if not egress:
        cmds.append(_elem(n, "delete", "egress", host_if))
    _nft(cmds)


def remove_interface(n: Names, host_if: str, address: str) -> None:
    try:
        _nft([_elem(n, "add", "src", {"concat": [host_if, address]}),
              _elem(n, "delete", "src", {"concat": [host_if, address]}),
              _elem(n, "add", "egress", host_if), _elem(n, "delete", "egress", host_if)])
    except FirewallError as e:  # the table may be gone already (shutdown)
        log.debug("removing %s from the firewall: %s", host_if, e)


def table_exists(n: Names) -> bool:
    rc, _, _ = procs.run_sync(["nft", "list", "table", FAMILY, n.table], timeout=30)
    return rc == 0
