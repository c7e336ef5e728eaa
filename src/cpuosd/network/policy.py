"""Egress policy: the modes, the allowlist's name matching, and the sets every mode denies.

Modes: ``off`` (nothing leaves), ``allowlist`` (DNS through the daemon's resolver, TCP
through its egress proxy to allowed names only), ``on`` (any destination outside the deny
sets). In every mode the deny sets hold: private, loopback, link-local (the metadata
address), CGNAT, benchmark, multicast and reserved ranges, IPv4 and IPv6 (IPv4-mapped and
NAT64 addresses are checked by the IPv4 address they carry), and the SMTP ports. An operator
may add ranges (``CPUOS_DENY_CIDRS``) and ports (``CPUOS_DENY_PORTS``), never remove any.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from ..config import NetworkConfig
from ..errors import invalid

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

DENY_V4 = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
           "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
           "240.0.0.0/4", "255.255.255.255/32",
           "168.63.129.16/32")  # (Azure's wireserver and DNS: a metadata service too)
DENY_V6 = ("::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16",
           "fc00::/7", "fe80::/10", "ff00::/8", "100::/64", "2001:db8::/32")
DENY_PORTS = frozenset({25, 465, 587, 2525})
MODES = ("off", "allowlist", "on")
NAME_RE = re.compile(r"^(\*\.)?([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*"
                     r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
MAX_ALLOW = 256

# what `allowlist` allows when a sandbox names nothing: the package registries templates
# install from (pip, npm, apt, go, cargo) and GitHub
DEFAULT_ALLOW = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "deb.debian.org",
                 "security.debian.org", "proxy.golang.org", "sum.golang.org", "crates.io",
                 "index.crates.io", "static.crates.io", "github.com", "*.github.com",
                 "codeload.github.com", "objects.githubusercontent.com",
                 "raw.githubusercontent.com")


def _networks(items: tuple[str, ...] | list[str]) -> list[Network]:
    return [ipaddress.ip_network(x, strict=False) for x in items]


class Deny:
    """The deny sets, the operator's additions (``cfg.deny_cidrs``, ``cfg.deny_ports``) and
    the sandboxes' own address pool (one sandbox never reaches another)."""

    def __init__(self, cfg: NetworkConfig | None = None) -> None:
        cfg = cfg or NetworkConfig()
        self.networks = [*_networks(DENY_V4), *_networks(DENY_V6), *_networks(cfg.deny_cidrs),
                         *_networks([cfg.pool])]
        self.ports = DENY_PORTS | cfg.deny_ports

    def address(self, addr: str | IPAddress) -> str | None:
        return denied_address(addr, self.networks)

    def port(self, port: int) -> str | None:
        return f"deny port {port} (mail)" if port in self.ports else None


def denied_address(addr: str | IPAddress, networks: list[Network]) -> str | None:
    """The deny rule of ``networks`` an address falls under (e.g. ``deny 169.254.0.0/16``),
    or None."""
    try:
        ip = ipaddress.ip_address(addr) if isinstance(addr, str) else addr
    except ValueError:
        return "deny unparsable address"
    candidates: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)
        if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64: the IPv4 address inside
            candidates.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None:
            candidates.append(ip.sixtofour)
    for c in candidates:
        for net in networks:
            if c.version == net.version and c in net:
                return f"deny {net}"
    return None


@dataclass
class Policy:
    mode: str = "allowlist"
    allow: list[str] = field(default_factory=list)
    # secrets kept outside the sandbox (network.secrets): name -> {placeholder, hosts};
    # set by the daemon, never by a request's "network"
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    ca: str | None = None  # the sandbox's own CA (for the hosts of its secrets)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "allow": list(self.allow)}
        if self.secrets:
            out["secrets"], out["ca"] = self.secrets, self.ca
        return out

    @classmethod
    def stored(cls, d: dict[str, Any] | None) -> Policy:
        """A policy the daemon wrote (secrets and CA included)."""
        if not d:  # (a sandbox from before networking existed: no way out)
            return cls(mode="off")
        p = cls.parse({k: v for k, v in d.items() if k in ("mode", "allow")})
        secrets = d.get("secrets")
        if isinstance(secrets, dict):
            p.secrets = secrets
            p.ca = d.get("ca") if isinstance(d.get("ca"), str) else None
        return p

    def substitutions(self, name: str | None) -> list[str]:
        """The placeholders of the secrets meant for host ``name``."""
        if not name:
            return []
        probe = Policy(mode="allowlist")
        out = []
        for s in self.secrets.values():
            probe.allow = list(s.get("hosts") or [])
            if probe.allows_name(name):
                out.append(str(s.get("placeholder")))
        return out

    def allows_name(self, name: str | None) -> bool:
        if self.mode != "off" and name and self.substitutions(name):
            return True  # a secret's hosts are allowed (it is meant for them)
        return self._allows_name(name)

    @classmethod
    def parse(cls, value: Any, default: Policy | None = None) -> Policy:
        """``"off"`` | ``"on"`` | ``"allowlist"`` | ``{"allow": [...]}`` |
        ``{"mode": ..., "allow": [...]}``; None takes ``default``."""
        if value is None:
            return default or cls(mode="allowlist", allow=list(DEFAULT_ALLOW))
        if isinstance(value, str):
            if value not in MODES:
                raise invalid(f"network must be one of {', '.join(MODES)} or "
                              "{\"allow\": [names]}", field="network")
            return cls(mode=value, allow=list(DEFAULT_ALLOW) if value == "allowlist" else [])
        if not isinstance(value, dict):
            raise invalid("network must be a mode or {\"allow\": [names]}", field="network")
        unknown = set(value) - {"mode", "allow"}
        if unknown:
            raise invalid(f"network: unknown key(s) {sorted(unknown)}", field="network")
        mode = value.get("mode", "allowlist")
        if mode not in MODES:
            raise invalid(f"network.mode must be one of {', '.join(MODES)}", field="network")
        allow = value.get("allow", [])
        if not isinstance(allow, list) or len(allow) > MAX_ALLOW:
            raise invalid(f"network.allow must be a list of at most {MAX_ALLOW} names",
                          field="network")
        names = []
        for n in allow:
            if not isinstance(n, str) or len(n) > 253 or not NAME_RE.fullmatch(n.lower()):
                raise invalid(f"network.allow: {str(n)[:80]!r} is not a host name or "
                              "*.suffix", field="network")
            names.append(n.lower().rstrip("."))
        return cls(mode=mode, allow=names)

    def _allows_name(self, name: str | None) -> bool:
        if self.mode == "on":
            return True
        if self.mode != "allowlist" or not name:
            return False
        name = name.lower().rstrip(".")
        for pat in self.allow:
            if pat.startswith("*."):
                if name.endswith(pat[1:]) and name != pat[2:]:
                    return True
            elif name == pat:
                return True
        return False
