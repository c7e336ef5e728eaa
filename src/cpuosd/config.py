"""The daemon's configuration: one frozen ``Config`` of sections, built from the environment
(``CPUOS_*``) by ``Config.from_env``.

Every variable the daemon reads is declared here, once, beside the field it sets: its name,
its default and a one-line doc (``var``). This module is the only place in ``cpuosd`` that
reads the environment (tests/unit/test_config.py enforces it); everything else is handed
its ``Config`` (or the section it needs) by whoever built it: ``cpuosd.main`` for the
daemon, the entry point of a tool (``cpuosd template``, the microVM artifact build) for
itself; the few helpers tools and tests call without one (``find_runsc``,
``StepBox.default``, ``kernel.cache_dir``) take ``Config.from_env()``. ``cpuosd config``
prints the effective configuration; README.md's table of variables is generated from these
declarations (``scripts/gen_config_docs.py``).

A value that does not parse is a ``ConfigError`` naming the variable, at start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")

DEFAULT_HOME = "/var/lib/cpuos"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7770


class ConfigError(ValueError):
    """A variable's value does not parse; str() is the one-line reason, naming it."""


# ---- how values are read (name, raw text) -> value ------------------------------------------
Parse = Callable[[str, str], Any]


def _int(name: str, v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r}: not an integer") from None


def _float(name: str, v: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r}: not a number") from None


def _str(name: str, v: str) -> str:
    return v


def _path(name: str, v: str) -> Path:
    return Path(v)


def _flag(name: str, v: str) -> bool:
    """On unless ``0``."""
    return v != "0"


def _at_least_1(name: str, v: str) -> int:
    return max(1, _int(name, v))


def _size_mib(name: str, v: str) -> int:
    """A size (``1GiB``, a bare number is MiB) in MiB."""
    from cpuos_agent.protocol import parse_size_mib

    try:
        return parse_size_mib(v, name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _memory_mib(name: str, v: str) -> int:
    """A sandbox's memory, MiB: 128 at least (what a create may ask for)."""
    n = _size_mib(name, v)
    if n < 128:
        raise ConfigError(f"{name}={v!r}: a sandbox needs 128 MiB at least")
    return n


def _seconds(name: str, v: str) -> float:
    from cpuos_agent.protocol import parse_duration

    try:
        return parse_duration(v, name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _duration(name: str, v: str) -> float:
    """A duration (``"10m"``, seconds); ``0``, ``0s`` or ``never``: none (0)."""
    return 0.0 if v in ("0", "0s", "never") else _seconds(name, v)


def _session_ttl(name: str, v: str) -> float:
    return max(60.0, _seconds(name, v))


def _retention(name: str, v: str) -> float | None:
    """A duration; ``0``, ``forever`` or ``none``: keep everything (None)."""
    return None if v in ("0", "forever", "none") else _seconds(name, v)


def _rows(name: str, v: str) -> float | None:
    """Rows an hour; ``0``, ``none`` or ``unlimited``: no budget (None)."""
    if v in ("0", "none", "unlimited"):
        return None
    try:
        n = float(v)
    except ValueError:
        raise ConfigError(f"{name} must be a number of rows an hour, or 0 (unlimited), "
                          f"not {v!r}") from None
    if n < 0:
        raise ConfigError(f"{name} must not be negative")
    return n


def _min_free(name: str, v: str) -> int | None:
    """A size (``1GiB``, a bare number is MiB) in bytes; ``0``: no floor (None)."""
    return None if v == "0" else _size_mib(name, v) << 20


def _templates(name: str, v: str) -> tuple[str, ...]:
    """Comma-separated template names; what is not a template name is left out."""
    return tuple(t for t in (x.strip() for x in v.split(","))
                 if re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", t))


def _net_id(name: str, v: str) -> str:
    if not re.fullmatch(r"[a-z0-9]{0,4}", v):
        raise ConfigError(f"{name}={v!r}: up to 4 of [a-z0-9]")
    return v


def _v4_net(name: str, v: str) -> str:
    try:
        ipaddress.IPv4Network(v)
    except ValueError as e:
        raise ConfigError(f"{name}={v!r}: {e}") from None
    return v


def _cidrs(name: str, v: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in v.split(",") if x.strip())
    for x in out:
        try:
            ipaddress.ip_network(x, strict=False)
        except ValueError as e:
            raise ConfigError(f"{name}: {x!r}: {e}") from None
    return out


def _ports(name: str, v: str) -> frozenset[int]:
    return frozenset(_int(name, x.strip()) for x in v.split(",") if x.strip())


def _one_of(*choices: str) -> Parse:
    def parse(name: str, v: str) -> str:
        if v not in choices:
            raise ConfigError(f"{name}={v!r}: one of {', '.join(choices)}")
        return v
    return parse


def _admin_key(name: str, v: str) -> str:
    """An API key given by the deployment (a Secret): long enough to be one."""
    v = v.strip()
    if len(v) < 32 or len(v) > 256 or not v.isprintable() or " " in v:
        raise ConfigError(f"{name} must be 32 to 256 printable characters without spaces "
                          "(e.g. cpk_ and 64 hex digits)")
    return v


def _database_url(name: str, v: str) -> str:
    """A Postgres URL; anything else is refused (a typo must not quietly give each host a
    database of its own)."""
    if not v.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{name} must be a postgresql:// URL (unset: SQLite in "
                          f"$CPUOS_HOME), not {v.split(':', 1)[0]!r}")
    return v


def _snapshot_store(name: str, v: str) -> str:
    if not v.startswith(("s3://", "file://", "/")):
        raise ConfigError(f"{name} must be s3://bucket/prefix, file:///path or /path, "
                          f"not {v!r}")
    return v


@dataclass(frozen=True)
class Var:
    """A variable's declaration (a field's metadata)."""

    env: str
    doc: str
    parse: Parse
    secret: bool = False  # masked by ``cpuosd config``
    shown: str | None = None  # the default as documented, where it is not the field's
    resolved: str | None = None  # the Config property with the value in effect when unset


def var(env: str, default: Any, doc: str, parse: Parse, *, secret: bool = False,
        shown: str | None = None, resolved: str | None = None) -> Any:
    """A field set by ``env`` (unset or empty: ``default``)."""
    return field(default=default,
                 metadata={"var": Var(env, doc, parse, secret, shown, resolved)})


def section(cls: type[T]) -> T:
    """A field holding a section (its defaults unless ``from_env`` builds it)."""
    return field(default_factory=cls, metadata={"section": True})


# ---- the sections ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiConfig:
    max_connections: int = var("CPUOS_API_MAX_CONNECTIONS", 2048,
                               "API connections at once (at most a quarter of the daemon's "
                               "descriptor reserve)", _int)
    head_timeout: float = var("CPUOS_API_HEAD_TIMEOUT", 10.0,
                              "s an API request head has to arrive whole (from its first "
                              "byte)", _float)
    keepalive: float = var("CPUOS_API_KEEPALIVE", 310.0,
                           "s an idle kept-alive API connection is kept", _float)
    console_session_ttl: float = var("CPUOS_CONSOLE_SESSION_TTL", 12 * 3600.0,
                                     "how long a console sign-in lasts (a duration, at "
                                     "least 1m)", _session_ttl, shown="12h")


@dataclass(frozen=True)
class SandboxConfig:
    """What a sandbox gets when it asks for nothing else."""

    output_cap: int = var("CPUOS_OUTPUT_CAP", 1 << 20,
                          "bytes of output kept per exec stream in the daemon's record "
                          "(head + tail)", _int, shown="1048576 (1 MiB)")
    max_read_bytes: int = var("CPUOS_MAX_READ_BYTES", 64 << 30,
                              "bytes one file read or directory tar from a sandbox may carry "
                              "at most", _int, shown="68719476736 (64 GiB)")
    default_pids: int = var("CPUOS_DEFAULT_PIDS", 512,
                            "tasks a sandbox's commands may have (past it: EAGAIN)", _int)
    default_disk_mib: int = var("CPUOS_DEFAULT_DISK_MIB", 5120,
                                "MiB the writable layer of a sandbox's root filesystem may "
                                "hold (past it: ENOSPC)", _int)
    default_memory_mib: int = var("CPUOS_DEFAULT_MEMORY_MIB", 2048,
                                  "MiB of memory a sandbox gets when its create and its "
                                  "workspace name none (templates are snapshotted at it)",
                                  _memory_mib)
    agent_connect_timeout: float = var("CPUOS_AGENT_CONNECT_TIMEOUT", 15.0,
                                       "s a booting or restored sandbox's agent has to say "
                                       "hello", _float)
    agent_liveness: float = var("CPUOS_AGENT_LIVENESS", 15.0,
                                "s a silent agent with open streams is given before they end "
                                "with unavailable", _float)
    spawner_idle_exit: float = var("CPUOS_SPAWNER_IDLE_EXIT", 120.0,
                                   "s with no command running after which a sandbox's command "
                                   "spawner exits (0: never)", _float)
    kill_timeout: float = var("CPUOS_KILL_TIMEOUT", 20.0,
                              "s a kill waits for a sandbox's teardown (its runsc delete, "
                              "network, files) before it gives up and says error", _float)
    # not configurable
    default_timeout: float = 300.0
    max_timeout: float = 24 * 3600.0
    reaper_interval: float = 0.5
    default_vcpus: int = 2
    # free space a pause needs beyond the sandbox's memory (its image is at most that big)
    snapshot_margin: int = 64 << 20


@dataclass(frozen=True)
class PoolConfig:
    """Restored sandboxes kept ready per template: with recent demand (creates in the last
    10 s) the pool grows up to ``max``, refilled by at most ``parallel`` restores at once,
    and shrinks back once demand stops."""

    size: int = var("CPUOS_POOL_SIZE", 1,
                    "restored sandboxes kept ready per template (0: no warm pool)", _int)
    max: int = var("CPUOS_POOL_MAX", 8, "what a pool grows to while creates come", _int)
    parallel: int = var("CPUOS_POOL_PARALLEL", 2,
                        "restores refilling the pools at once (at least 1)", _at_least_1)
    templates: tuple[str, ...] = var("CPUOS_POOL_TEMPLATES", ("python",),
                                     "the templates whose pool is filled at start "
                                     "(comma-separated)", _templates, shown="python")
    template_snapshots: bool = var("CPUOS_TEMPLATE_SNAPSHOTS", True,
                                   "boot each template once, checkpoint it, create sandboxes "
                                   "by restoring that (0: boot each)", _flag, shown="1")


@dataclass(frozen=True)
class IdleConfig:
    timeout: float = var("CPUOS_IDLE_TIMEOUT", 600.0,
                         "idle time before a running sandbox is paused, where neither it nor "
                         "its workspace names one (0: never)", _duration, shown="10m")
    pause_parallel: int = var("CPUOS_IDLE_PAUSE_PARALLEL", 2,
                              "idle sandboxes checkpointed at once (at least 1)", _at_least_1)
    cpu: float = var("CPUOS_IDLE_CPU", 0.05,
                     "cores a sandbox may use and still be idle", _float)


@dataclass(frozen=True)
class NetworkConfig:
    enabled: bool = var("CPUOS_NETWORK", True,
                        "per-sandbox networking where nftables is installed (0: none)", _flag,
                        shown="1")
    default_policy: str = var("CPUOS_DEFAULT_NETWORK", "allowlist",
                              "the egress policy of a sandbox that names none: off | on | "
                              "allowlist", _str)
    net_id: str = var("CPUOS_NET_ID", "",
                      "this daemon's tag in its netns, interface and nftables names (up to "
                      "4 of [a-z0-9])", _net_id)
    pool: str = var("CPUOS_NET_POOL", "10.213.0.0/16",
                    "the sandboxes' IPv4 address pool (/30 each)", _v4_net)
    netns_pool: int = var("CPUOS_NETNS_POOL", 4,
                          "network namespaces made ahead of time", _int)
    deny_cidrs: tuple[str, ...] = var("CPUOS_DENY_CIDRS", (),
                                      "ranges added to the deny sets (comma-separated)",
                                      _cidrs, shown="")
    deny_ports: frozenset[int] = var("CPUOS_DENY_PORTS", frozenset(),
                                     "ports added to the denied ones (comma-separated)",
                                     _ports, shown="")
    dns_upstream: str | None = var("CPUOS_DNS_UPSTREAM", None,
                                   "the resolver the daemon's DNS asks (host[:port]; default "
                                   "the first of /etc/resolv.conf)", _str)
    dns_port: int = var("CPUOS_DNS_PORT", 0, "the daemon's resolver's port (0: any free)",
                        _int)
    egress_port: int = var("CPUOS_EGRESS_PORT", 0,
                           "the egress proxy's port (0: any free)", _int)
    nflog_group: int | None = var("CPUOS_NFLOG_GROUP", None,
                                  "the NFLOG group of dropped packets (default: from the "
                                  "net id)", _int)
    uplink_netns: str | None = var("CPUOS_UPLINK_NETNS", None,
                                   "the network namespace (name or path) egress leaves "
                                   "from (tests: a fake internet)", _str)
    upstream_ca_file: str | None = var("CPUOS_UPSTREAM_CA_FILE", None,
                                       "CA bundle for the TLS the proxy makes to upstreams "
                                       "for secrets (default: the system's)", _str)


@dataclass(frozen=True)
class PreviewConfig:
    port: int = var("CPUOS_PREVIEW_PORT", -1,
                    "the preview proxy's port (-1: the API's + 1, 0: any free)", _int)
    domain: str = var("CPUOS_PREVIEW_DOMAIN", "localhost",
                      "the domain of preview host names (<port>-<id>.<domain>)", _str)
    max_connections: int = var("CPUOS_PREVIEW_MAX_CONNECTIONS", 2048,
                               "preview client connections at once", _int)
    max_pending: int = var("CPUOS_PREVIEW_MAX_PENDING", 1024,
                           "preview connections waiting for a request head", _int)
    max_pending_per_ip: int = var("CPUOS_PREVIEW_MAX_PENDING_PER_IP", 64,
                                  "of those, from one address (raise it behind a front "
                                  "proxy)", _int)
    max_per_sandbox: int = var("CPUOS_PREVIEW_MAX_PER_SANDBOX", 256,
                               "preview connections into one sandbox", _int)
    public_address: str | None = var("CPUOS_PREVIEW_PUBLIC_ADDRESS", None,
                                     "host:port the preview URLs in answers name (default "
                                     "this listener's; many hosts: the API tier's preview "
                                     "address, set on the nodes)", _str)


@dataclass(frozen=True)
class AuditConfig:
    enabled: bool = var("CPUOS_AUDIT", True, "the audit trail (0: record nothing)", _flag,
                        shown="1")
    runtime: bool = var("CPUOS_AUDIT_RUNTIME", True,
                        "the audit's runtime monitoring: execs and files written inside "
                        "(0: off)", _flag, shown="1")
    retention: float | None = var("CPUOS_AUDIT_RETENTION", 30 * 86400.0,
                                  "how long audit rows are kept (forever: all)", _retention,
                                  shown="30d")
    sandbox_rows: float | None = var("CPUOS_AUDIT_SANDBOX_ROWS", 20_000.0,
                                     "audit rows an hour per sandbox (0: unlimited)", _rows,
                                     shown="20000")
    workspace_rows: float | None = var("CPUOS_AUDIT_WORKSPACE_ROWS", 200_000.0,
                                       "audit rows an hour per workspace (0: unlimited)",
                                       _rows, shown="200000")
    min_free: int | None = var("CPUOS_AUDIT_MIN_FREE", 1 << 30,
                               "free space below which only lifecycle rows are written "
                               "(0: no floor)", _min_free, shown="1GiB")
    key_file: Path | None = var("CPUOS_AUDIT_KEY_FILE", None,
                                "the audit chain's HMAC key (default $CPUOS_HOME/audit.key; "
                                "many hosts: the same key on every node, a Secret's file)",
                                _path, resolved="audit_key_path")


@dataclass(frozen=True)
class PricingConfig:
    """USD per hour."""

    vcpu_hour: float = var("CPUOS_PRICE_VCPU_HOUR", 0.0504,
                           "USD per vCPU-hour running", _float)
    gib_hour: float = var("CPUOS_PRICE_GIB_HOUR", 0.0162,
                          "USD per GiB-hour of memory running", _float)
    snapshot_gib_hour: float = var("CPUOS_PRICE_SNAPSHOT_GIB_HOUR", 0.00014,
                                   "USD per GiB-hour of snapshot while paused", _float)


@dataclass(frozen=True)
class LimitsConfig:
    """The host's capacity and what admission keeps of it."""

    host_vcpus: int | None = var("CPUOS_HOST_VCPUS", None,
                                 "the host's cores as admission counts them (default: all)",
                                 _int)
    host_memory_mib: int | None = var("CPUOS_HOST_MEMORY_MIB", None,
                                      "the host's memory as admission counts it (default: "
                                      "MemTotal)", _int)
    memory_reserve_mib: int = var("CPUOS_MEMORY_RESERVE_MIB", 0,
                                  "MiB of memory kept free of sandboxes (0: 5%, at least "
                                  "512)", _int)
    memory_overcommit: float = var("CPUOS_MEMORY_OVERCOMMIT", 0.0,
                                   "a ceiling on running sandboxes' memory sizes, x the host's "
                                   "(0: none)", _float)
    cpu_overcommit: float = var("CPUOS_CPU_OVERCOMMIT", 0.0,
                                "a ceiling on running sandboxes' vCPUs, x the host's (0: "
                                "none)", _float)
    admit_cpu: float = var("CPUOS_ADMIT_CPU", 0.95,
                           "host CPU load over which creates are refused", _float)
    disk_reserve_mib: int = var("CPUOS_DISK_RESERVE_MIB", 1024,
                                "MiB kept free where sandboxes write", _int)
    conn_fds: int | None = var("CPUOS_CONN_FDS", None,
                               "descriptors connections of sandboxes and visitors may hold "
                               "(default: half the limit)", _int)


@dataclass(frozen=True)
class RunscConfig:
    path: str | None = var("CPUOS_RUNSC", None,
                           "the runsc binary (default: the pinned build, else PATH)", _str)
    platform: str | None = var("CPUOS_RUNSC_PLATFORM", None,
                               "runsc's platform (default: systrap where known, else ptrace)",
                               _str)
    prefix: Path = var("CPUOS_RUNSC_PREFIX", Path("/usr/local/lib/cpuos"),
                       "where scripts/build-runsc.sh installs runsc builds", _path)


@dataclass(frozen=True)
class MicrovmConfig:
    dir: Path | None = var("CPUOS_MICROVM_DIR", None,
                           "the microVM guest artifacts (default $CPUOS_HOME/microvm)", _path,
                           resolved="microvm_dir")
    accel: str = var("CPUOS_MICROVM_ACCEL", "kvm",
                     "the microVM backend's accelerator: kvm, or tcg (emulated: tests)", _str)
    standby: int = var("CPUOS_MICROVM_STANDBY", 1,
                       "QEMUs kept spawned and waiting per template image", _int)


@dataclass(frozen=True)
class BuildConfig:
    """Template builds."""

    memory_mib: int = var("CPUOS_BUILD_MEMORY_MIB", 4096, "MiB a build step may use", _int)
    vcpus: int | None = var("CPUOS_BUILD_VCPUS", None,
                            "cores a build step may use (default: the host's)", _int)
    pids: int = var("CPUOS_BUILD_PIDS", 4096, "tasks a build step may have", _int)
    network: str | None = var("CPUOS_BUILD_NETWORK", None,
                              "build steps' egress: off | on | allowlist | names (default "
                              "allowlist, off where CPUOS_DEFAULT_NETWORK=off)", _str)
    max_upload: int = var("CPUOS_MAX_TEMPLATE_UPLOAD", 8 << 30,
                          "bytes of a template build's context upload", _int,
                          shown="8589934592 (8 GiB)")
    timeout: float = var("CPUOS_TEMPLATE_BUILD_TIMEOUT", 3600.0, "s a build may take",
                         _float)


@dataclass(frozen=True)
class LogsConfig:
    file: str | None = var("CPUOS_LOG_FILE", None,
                           "log here, rotated by size (default: stderr)", _str)
    max_bytes: int = var("CPUOS_LOG_MAX_BYTES", 64 << 20, "the log file's size at rotation",
                         _int, shown="67108864 (64 MiB)")
    backups: int = var("CPUOS_LOG_BACKUPS", 3, "rotated log files kept", _int)
    level: str = var("CPUOS_LOG_LEVEL", "INFO", "the log level", _str)


@dataclass(frozen=True)
class E2BConfig:
    templates: str = var("CPUOS_E2B_TEMPLATES",
                         "base=python;code-interpreter-v1=code-interpreter,python",
                         "E2B template names -> cpuos templates, the first built one wins "
                         "(name=tpl[,tpl...];...)", _str)
    domain: str | None = var("CPUOS_E2B_DOMAIN", None,
                             "the domain in E2B's answers (default localhost:<preview "
                             "port>)", _str)
    key_file: Path | None = var("CPUOS_E2B_KEY_FILE", None,
                                "the key of E2B's access tokens (default $CPUOS_HOME/e2b.key; "
                                "many hosts: the same key on every node, a Secret's file)",
                                _path, resolved="e2b_key_path")


@dataclass(frozen=True)
class ClusterConfig:
    """Many hosts (issue 24, docs/DEPLOY.md): the role, the shared state and snapshot
    stores, how nodes are known and fenced."""

    role: str = var("CPUOS_ROLE", "all",
                    "all: one host; node: runs sandboxes for API processes; api: the public "
                    "API, forwarded to the nodes (no root)", _one_of("all", "node", "api"))
    database_url: str | None = var("CPUOS_DATABASE_URL", None,
                                   "the state store: Postgres (postgresql://...) shared by "
                                   "API processes and nodes (default: SQLite in $CPUOS_HOME)",
                                   _database_url, secret=True)
    database_pool: int = var("CPUOS_DATABASE_POOL", 8,
                             "connections to that Postgres per process (at least 1)",
                             _at_least_1)
    node_id: str | None = var("CPUOS_NODE_ID", None,
                              "a node's id, a DNS label (default: the host's name)", _str)
    node_address: str | None = var("CPUOS_NODE_ADDRESS", None,
                                   "host:port where API processes reach this node (default "
                                   "CPUOS_HOST:CPUOS_PORT)", _str)
    node_token: str | None = var("CPUOS_NODE_TOKEN", None,
                                 "the secret API processes and nodes share (16 characters or "
                                 "more; X-Cpuos-Node-Token)", _str, secret=True)
    secrets_key_file: Path | None = var("CPUOS_SECRETS_KEY_FILE", None,
                                        "with CPUOS_DATABASE_URL: the file of the key that "
                                        "seals sandboxes' secrets in the database (the same "
                                        "on every node, a Secret's file; 64 hex digits a "
                                        "line, the first seals; without it a node refuses "
                                        "secrets)", _path)
    admin_key: str | None = var("CPUOS_ADMIN_KEY", None,
                                "the admin workspace's API key, put into an empty database "
                                "by the first node (32 characters or more; default: a node "
                                "makes one, in $CPUOS_HOME/admin.key)", _admin_key,
                                secret=True)
    node_lease: float = var("CPUOS_NODE_LEASE", 15.0,
                            "s without a heartbeat after which a node counts as dead (it "
                            "beats every third)", _seconds)
    node_fence_after: float = var("CPUOS_NODE_FENCE_AFTER", 60.0,
                                  "s a node has been dead after which its sandboxes are "
                                  "marked lost (error/node_lost; 0: never)", _duration)
    membership: str = var("CPUOS_MEMBERSHIP", "store",
                          "how nodes are known: store (the state store's nodes table) or "
                          "kubernetes (Leases in CPUOS_K8S_NAMESPACE)",
                          _one_of("store", "kubernetes"))
    api_id: str | None = var("CPUOS_API_ID", None,
                             "an API process's name in its leader election (default: the "
                             "host's name)", _str)
    k8s_namespace: str = var("CPUOS_K8S_NAMESPACE", "cpuos",
                             "the Kubernetes namespace of the Leases", _str)
    snapshot_store: str | None = var("CPUOS_SNAPSHOT_STORE", None,
                                     "where a node's pauses go so that any node resumes them: "
                                     "s3://bucket/prefix, file:///shared/dir (default: this "
                                     "host's snapshots directory)", _snapshot_store)
    snapshot_transfer_timeout: float = var("CPUOS_SNAPSHOT_TRANSFER_TIMEOUT", 60.0,
                                           "s an upload to (or download from) that store may "
                                           "take, plus 1 s per 20 MiB (past it the pause "
                                           "keeps its image on the node)", _seconds)
    snapshot_sweep_after: float = var("CPUOS_SNAPSHOT_SWEEP_AFTER", 3600.0,
                                      "s after which what an unfinished upload left in that "
                                      "store, and a fork's image, is swept by an API process "
                                      "(the leader; 0: never)", _duration)
    s3_endpoint: str | None = var("CPUOS_S3_ENDPOINT", None,
                                  "the S3 endpoint (MinIO, Ceph, R2...: path-style "
                                  "addressing; default AWS)", _str)
    s3_region: str | None = var("CPUOS_S3_REGION", None,
                                "the S3 region (default us-east-1)", _str)
    s3_access_key_id: str | None = var("CPUOS_S3_ACCESS_KEY_ID", None,
                                       "S3 credentials (default: boto3's chain, AWS_* ...)",
                                       _str, secret=True)
    s3_secret_access_key: str | None = var("CPUOS_S3_SECRET_ACCESS_KEY", None,
                                           "S3 credentials, the secret half", _str,
                                           secret=True)
    s3_part_mib: int = var("CPUOS_S3_PART_MIB", 64,
                           "MiB of a multipart upload's parts (at least 5)", _int)
    s3_concurrency: int = var("CPUOS_S3_CONCURRENCY", 4,
                              "parts transferred at once (at least 1)", _at_least_1)


@dataclass(frozen=True)
class Config:
    home: Path = var("CPUOS_HOME", Path(DEFAULT_HOME), "the daemon's state directory", _path)
    host: str = var("CPUOS_HOST", DEFAULT_HOST, "the API's address", _str)
    port: int = var("CPUOS_PORT", DEFAULT_PORT, "the API's port", _int)
    backend: str = var("CPUOS_BACKEND", "auto",
                       "gvisor | microvm | auto (microvm only where the KVM boot probe "
                       "passes)", _str)
    templates_path: Path | None = var("CPUOS_TEMPLATES_DIR", None,
                                      "template builds, shareable between daemons (default "
                                      "$CPUOS_HOME/templates)", _path,
                                      resolved="templates_dir")
    snapshots_path: Path | None = var("CPUOS_SNAPSHOTS_DIR", None,
                                      "snapshots (default $CPUOS_HOME/snapshots)", _path,
                                      resolved="snapshots_dir")
    template_images_path: Path | None = var(
        "CPUOS_TEMPLATE_IMAGES_DIR", None,
        "template snapshot images, shareable between the daemons of one host (made under a "
        "file lock, used in place; a daemon deletes there only images no running daemon "
        "uses; a microVM image names files in its maker's CPUOS_MICROVM_DIR: share that "
        "too; default $CPUOS_SNAPSHOTS_DIR/templates, the daemon's own)", _path,
        resolved="template_images_dir")
    api: ApiConfig = section(ApiConfig)
    sandbox: SandboxConfig = section(SandboxConfig)
    pool: PoolConfig = section(PoolConfig)
    idle: IdleConfig = section(IdleConfig)
    network: NetworkConfig = section(NetworkConfig)
    preview: PreviewConfig = section(PreviewConfig)
    audit: AuditConfig = section(AuditConfig)
    pricing: PricingConfig = section(PricingConfig)
    limits: LimitsConfig = section(LimitsConfig)
    runsc: RunscConfig = section(RunscConfig)
    microvm: MicrovmConfig = section(MicrovmConfig)
    builds: BuildConfig = section(BuildConfig)
    logs: LogsConfig = section(LogsConfig)
    e2b: E2BConfig = section(E2BConfig)
    cluster: ClusterConfig = section(ClusterConfig)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The configuration ``environ`` (default: this process's environment) sets; an
        unset or empty variable takes its default. Raises ConfigError."""
        env = os.environ if environ is None else environ
        return _build(cls, env)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @property
    def db_path(self) -> Path:
        return self.home / "cpuos.db"

    @property
    def admin_key_path(self) -> Path:
        return self.home / "admin.key"

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"

    @property
    def templates_dir(self) -> Path:
        """Template builds; shareable between daemons (tests point it at one cache)."""
        return self.templates_path or self.home / "templates"

    @property
    def snapshots_dir(self) -> Path:
        return self.snapshots_path or self.home / "snapshots"

    @property
    def template_images_dir(self) -> Path:
        """Template snapshot images (lifecycle.template_images); shared between daemons when
        CPUOS_TEMPLATE_IMAGES_DIR is set (tests point every daemon at one)."""
        return self.template_images_path or self.snapshots_dir / "templates"

    @property
    def shared_template_images(self) -> bool:
        return self.template_images_path is not None

    @property
    def runsc_root(self) -> Path:
        return self.home / "runsc"

    @property
    def audit_key_path(self) -> Path:
        """The audit chain's HMAC key."""
        return self.audit.key_file or self.home / "audit.key"

    @property
    def e2b_key_path(self) -> Path:
        """The key E2B's access tokens are made with (cpuosd.e2b.state)."""
        return self.e2b.key_file or self.home / "e2b.key"

    @property
    def microvm_dir(self) -> Path:
        """The microVM guest artifacts."""
        return self.microvm.dir or self.home / "microvm"


def _build(cls: type[T], env: Mapping[str, str]) -> T:
    kw: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("section"):
            kw[f.name] = _build(cast("type[Any]", f.default_factory), env)
            continue
        v = f.metadata.get("var")
        if v is None:
            continue
        raw = (env.get(v.env) or "").strip()
        if raw:
            kw[f.name] = v.parse(v.env, raw)
    return cls(**kw)


# ---- what is declared -------------------------------------------------------------------
@dataclass(frozen=True)
class Declared:
    section: str  # "" for the top level
    field: str
    var: Var
    default: Any

    @property
    def default_text(self) -> str:
        return self.var.shown if self.var.shown is not None else show(self.default)


def declarations() -> Iterator[Declared]:
    """Every declared variable, in the order of the sections."""
    def walk(cls: type, sec: str) -> Iterator[Declared]:
        for f in fields(cls):
            if f.metadata.get("section"):
                yield from walk(f.default_factory, f.name)  # type: ignore[arg-type]
            elif "var" in f.metadata:
                yield Declared(sec, f.name, f.metadata["var"], f.default)
    return walk(Config, "")


def show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, frozenset)):
        return ",".join(str(x) for x in sorted(value, key=str)) if isinstance(
            value, frozenset) else ",".join(str(x) for x in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def effective(cfg: Config) -> list[tuple[str, str, str]]:
    """(variable, value, doc) of every declared variable in ``cfg``; secrets masked."""
    out = []
    for d in declarations():
        obj: Any = getattr(cfg, d.section) if d.section else cfg
        value = getattr(obj, d.field)
        if value is None and d.var.resolved:
            value = getattr(cfg, d.var.resolved)
        text = show(value)
        if d.var.secret and text:
            text = "****"
        out.append((d.var.env, text, d.var.doc))
    return out
