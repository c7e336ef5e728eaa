"""The backend contract. The API and SDK never know which backend runs a sandbox."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass
class SandboxSpec:
    id: str
    rootfs: Path  # the template's tree, shared and never written
    dir: Path  # per-sandbox host directory owned by the daemon
    agent_dir: Path  # host directory holding the cpuos_agent package (mounted read-only)
    vcpus: int = 2
    memory_mib: int = 2048
    # tasks (processes and threads) the sandbox's commands may have; None: no limit (a
    # sandbox paused before limits existed resumes as it was checkpointed)
    pids: int | None = None
    # MiB of the root filesystem's writable layer (ENOSPC past it); None: the layer is in
    # sandbox memory, unbounded but by it (sandboxes made before disk limits existed)
    disk_mib: int | None = None
    # the egress policy (cpuosd.network.policy.Policy as JSON), and the network namespace
    # the network wrapper made for the sandbox (None: no network at all)
    network: dict[str, Any] | None = None
    netns: str | None = None
    # the sandbox's address and gateway in that namespace (a /prefix): a guest that sets
    # its own interface (Capabilities.guest_net) is told them after every boot and restore
    address: str | None = None
    gateway: str | None = None
    prefix: int = 30
    # the sandbox's egress CA (PEM, secrets): a guest_net backend's guest gets it from the
    # agent (its /run/cpuos is the guest's own)
    ca_pem: str | None = None
    hostname: str = "sandbox"
    env: dict[str, str] = field(default_factory=dict)
    # the Manager's boot of a template, to be checkpointed and cloned (a backend may lay
    # its memory out for sharing)
    template_boot: bool = False
    # hands an agent connection the backend already holds (a standby microVM's) to the
    # daemon's channel, as if it had been accepted on sock_path
    adopt: Callable[[socket.socket], Awaitable[None]] | None = None
    # gVisor: runsc's --pod-init-config (a runtime-monitoring session: cpuosd.accounting.trace)
    trace_config: Path | None = None

    @property
    def sock_dir(self) -> Path:
        return self.dir / "sock"

    @property
    def sock_path(self) -> Path:
        return self.sock_dir / "agent.sock"


@dataclass
class Capabilities:
    name: str
    checkpoint: bool
    network: bool
    # the agent's channel is a socket code inside could knock on: the agent proves itself
    # with a per-sandbox key (cpuos_agent.protocol.KEY_PATH)
    agent_key: bool = False
    # the guest configures its own network interface (a VM's kernel): the agent is given
    # the sandbox's address at every boot and restore (spec.address)
    guest_net: bool = False


class Backend(Protocol):
    capabilities: Capabilities
    # what its snapshot images are of (in their names): one restores only into the same
    image_kind: str

    def runtime(self) -> dict[str, str]:
        """What runs the sandboxes (for /health): e.g. runsc version and platform."""

    async def start(self, spec: SandboxSpec) -> None:
        """Start the sandbox; its agent will connect to ``spec.sock_path``."""

    async def kill(self, sandbox_id: str) -> None:
        """Stop and delete everything the backend made for this sandbox (idempotent)."""

    async def running(self) -> dict[str, str]:
        """All sandboxes this backend knows on the host: id -> state."""

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        """Save memory, processes and writable layer to image_dir; the sandbox stops."""

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        """Start spec.id from an image (its agent reconnects to spec.sock_path)."""

    def memory_usage(self, sandbox_id: str) -> int | None:
        """Host memory the sandbox holds, or None if unknown."""

    def memory_watch(self, sandbox_id: str, threshold: int) -> int | None:
        """An eventfd the host signals each time the sandbox's host memory crosses
        ``threshold`` bytes (the caller owns it), or None where there is no such event
        (cpuosd.lifecycle.memwatch: the gVisor agent's OOM guard sleeps until it)."""

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """CPU time the sandbox has used on the host (one cheap read), or None if unknown."""

    def stats(self, sandbox_id: str) -> dict[str, int | float]:
        """What the host measures of the sandbox now (those it can): cpu_seconds,
        memory_bytes, memory_limit_bytes, pids, pids_limit, net_tx_bytes, net_rx_bytes."""

    async def close(self) -> None:
        """The daemon is stopping: drop what only it holds (sandboxes keep running)."""
