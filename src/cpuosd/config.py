"""Daemon configuration, from the environment (CPUOS_*)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOME = "/var/lib/cpuos"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7770


def _int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


def _duration_env(name: str, default: float) -> float:
    """A duration (``"10m"``, seconds; ``0``: none) from the environment."""
    v = (os.environ.get(name) or "").strip()
    if not v:
        return default
    if v in ("0", "0s", "never"):
        return 0.0
    from cpuos_agent.protocol import parse_duration

    return parse_duration(v, name)


def _database_url() -> str | None:
    from .store import database_url

    return database_url()


@dataclass
class Config:
    home: Path = field(default_factory=lambda: Path(os.environ.get("CPUOS_HOME", DEFAULT_HOME)))
    host: str = field(default_factory=lambda: os.environ.get("CPUOS_HOST", DEFAULT_HOST))
    port: int = field(default_factory=lambda: _int("CPUOS_PORT", DEFAULT_PORT))
    # the preview proxy's port (cpuosd.proxy.preview); -1: the API's port + 1, 0: any free
    preview_port: int = field(default_factory=lambda: _int("CPUOS_PREVIEW_PORT", -1))
    # gvisor | microvm | auto: auto picks microvm only where the KVM boot probe passes
    # (cpuosd.backends.microvm.selection); microvm refuses to start where it fails.
    backend: str = field(default_factory=lambda: os.environ.get("CPUOS_BACKEND", "auto"))
    # Output retained per exec stream in the daemon's record (head + tail).
    output_cap: int = field(default_factory=lambda: _int("CPUOS_OUTPUT_CAP", 1 << 20))
    default_timeout: float = 300.0
    max_timeout: float = 24 * 3600.0
    # s a booting or restored sandbox's agent has to say hello (an emulated microVM: more)
    agent_connect_timeout: float = field(
        default_factory=lambda: float(os.environ.get("CPUOS_AGENT_CONNECT_TIMEOUT") or 15.0))
    reaper_interval: float = 0.5
    # s without activity before a running sandbox is paused (lifecycle.idle), for sandboxes
    # that name none in a workspace that sets no default_idle_timeout; 0: never
    idle_timeout: float = field(default_factory=lambda: _duration_env("CPUOS_IDLE_TIMEOUT",
                                                                      600.0))
    # idle sandboxes checkpointed at once (the others found idle wait their turn)
    idle_pause_parallel: int = field(
        default_factory=lambda: max(1, _int("CPUOS_IDLE_PAUSE_PARALLEL", 2)))
    default_vcpus: int = 2
    default_memory_mib: int = 2048
    # per-sandbox networking (cpuosd.network): on where nftables is installed, unless 0
    network: bool = field(default_factory=lambda: os.environ.get("CPUOS_NETWORK", "1") != "0")
    # the egress policy of a sandbox that names none: off | on | allowlist (the package
    # registries: cpuosd.network.policy.DEFAULT_ALLOW)
    default_network: str = field(
        default_factory=lambda: os.environ.get("CPUOS_DEFAULT_NETWORK", "allowlist"))
    # tasks a sandbox's commands may have (processes and threads; a fork past it: EAGAIN)
    default_pids: int = field(default_factory=lambda: _int("CPUOS_DEFAULT_PIDS", 512))
    # MiB the writable layer of a sandbox's root filesystem may hold (past it: ENOSPC
    # inside); a host file under the sandbox's directory, not sandbox memory
    default_disk_mib: int = field(default_factory=lambda: _int("CPUOS_DEFAULT_DISK_MIB", 5120))
    # microVM backend: kvm, or tcg (emulated: tests and debugging only; no probe)
    microvm_accel: str = field(default_factory=lambda: os.environ.get("CPUOS_MICROVM_ACCEL",
                                                                      "kvm"))
    # microVM backend: QEMUs kept spawned and waiting per template image
    microvm_standby: int = field(default_factory=lambda: _int("CPUOS_MICROVM_STANDBY", 1))
    # Restored sandboxes kept ready per template (0 turns the warm pool off); with recent
    # demand (creates in the last 10 s) the pool grows up to pool_max, refilled by at most
    # pool_parallel restores at once, and shrinks back once demand stops.
    pool_size: int = field(default_factory=lambda: _int("CPUOS_POOL_SIZE", 1))
    pool_max: int = field(default_factory=lambda: _int("CPUOS_POOL_MAX", 8))
    pool_parallel: int = field(default_factory=lambda: max(1, _int("CPUOS_POOL_PARALLEL", 2)))
    # The templates whose pool is filled at start (comma-separated; e.g. "python,browser":
    # a pooled browser sandbox holds a running chromium); a pool is refilled as it is used.
    pool_templates: list[str] = field(default_factory=lambda: [
        t for t in (x.strip() for x in os.environ.get("CPUOS_POOL_TEMPLATES", "python")
                    .split(",")) if re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", t)])
    # Boot each template once, checkpoint it, and create sandboxes by restoring that.
    template_snapshots: bool = field(
        default_factory=lambda: os.environ.get("CPUOS_TEMPLATE_SNAPSHOTS", "1") != "0")
    # the audit trail (cpuosd.accounting.audit); 0 records nothing (for measuring its cost)
    audit: bool = field(default_factory=lambda: os.environ.get("CPUOS_AUDIT", "1") != "0")
    # the audit trail's runtime monitoring (gVisor: every execve and file opened for writing
    # inside, from gVisor's trace points; cpuosd.accounting.trace), unless 0
    audit_runtime: bool = field(
        default_factory=lambda: os.environ.get("CPUOS_AUDIT_RUNTIME", "1") != "0")
    # s with no command running after which a sandbox's command spawner exits (~7 MiB of
    # host memory each; the next command forks a new one: 40-100 ms more); 0: never
    spawner_idle_exit: float = field(
        default_factory=lambda: float(os.environ.get("CPUOS_SPAWNER_IDLE_EXIT") or 120))
    # Free space a pause needs beyond the sandbox's memory (its image is at most that big).
    snapshot_margin: int = 64 << 20
    # bytes one file read or directory tar from a sandbox may carry at most (a client asks
    # for less with max_bytes=); a file declaring more is refused up front (413 too_large),
    # a stream passing it is cut with too_large
    max_read_bytes: int = field(default_factory=lambda: _int("CPUOS_MAX_READ_BYTES", 64 << 30))

    # the state store: Postgres at CPUOS_DATABASE_URL (postgresql://...), else SQLite in
    # home (cpuosd.store)
    database_url: str | None = field(default_factory=lambda: _database_url())

    # many hosts (issue 24, docs/DEPLOY.md): "all" (one host, the default), "node" (runs
    # sandboxes behind the node token) or "api" (forwards the public API to the nodes)
    role: str = field(default_factory=lambda: os.environ.get("CPUOS_ROLE") or "all")
    # a node's id (a DNS label; default: the host's name) and where API processes reach it
    node_id: str | None = field(default_factory=lambda: os.environ.get("CPUOS_NODE_ID"))
    node_address: str | None = field(
        default_factory=lambda: os.environ.get("CPUOS_NODE_ADDRESS"))
    # the shared secret between API processes and nodes (X-Cpuos-Node-Token)
    node_token: str | None = field(default_factory=lambda: os.environ.get("CPUOS_NODE_TOKEN"))
    # where a node's pauses go so that any node resumes them (cpuosd.snapstore:
    # s3://bucket/prefix, file:///shared/dir); unset: this host's snapshots directory
    snapshot_store: str | None = field(
        default_factory=lambda: os.environ.get("CPUOS_SNAPSHOT_STORE") or None)
    # s an upload to (or a download from) that store may take at most, plus 1 s per 20 MiB
    # of the image; past it the pause keeps its image on this node (the resume fails back)
    snapshot_transfer_timeout: float = field(
        default_factory=lambda: _duration_env("CPUOS_SNAPSHOT_TRANSFER_TIMEOUT", 60))
    # s without a heartbeat after which a node counts as dead; a node beats every third
    node_lease: float = field(default_factory=lambda: _duration_env("CPUOS_NODE_LEASE", 15))
    # how nodes find each other: "store" (the state store's nodes table) or "kubernetes"
    # (coordination.k8s.io Leases in CPUOS_K8S_NAMESPACE; the Pod's ServiceAccount, else
    # $KUBECONFIG: cpuosd.cluster.membership)
    membership: str = field(default_factory=lambda: os.environ.get("CPUOS_MEMBERSHIP") or "store")
    # an API process's name (the Pod's, in deploy/kubernetes), in its leader election
    api_id: str | None = field(default_factory=lambda: os.environ.get("CPUOS_API_ID"))
    k8s_namespace: str = field(
        default_factory=lambda: os.environ.get("CPUOS_K8S_NAMESPACE") or "cpuos")
    # s a node has been dead (by an API process's clock) after which its sandboxes are
    # fenced: marked error/node_lost with a new epoch (those paused on it are left for its
    # return); a fenced node that comes back stops them. 0: never
    node_fence_after: float = field(
        default_factory=lambda: _duration_env("CPUOS_NODE_FENCE_AFTER", 60))

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
        return Path(os.environ.get("CPUOS_TEMPLATES_DIR") or self.home / "templates")

    @property
    def snapshots_dir(self) -> Path:
        return Path(os.environ.get("CPUOS_SNAPSHOTS_DIR") or self.home / "snapshots")

    @property
    def runsc_root(self) -> Path:
        return self.home / "runsc"
