"""What the daemon's state store offers (``Store``), whatever holds it: SQLite on one host
(cpuosd.store.sqlite) or Postgres shared by many (cpuosd.store.postgres).

Every method is synchronous and short (one statement, or one small transaction): the
callers are the event loop's code. A sandbox row carries the node that holds it
(``node_id``, None while it is only a snapshot in the store or before placement) and an
``epoch`` that grows whenever its owner changes; ``transition`` is the compare-and-set
through which state changes are made, so that of two processes racing to move one sandbox
exactly one wins, and a node holding an old epoch (declared dead, then back) changes
nothing.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# what is kept of one sandbox's connection record (the oldest go first)
MAX_CONNECTIONS = 10_000

# States with something on the host (a runsc sandbox, a snapshot, or both in flux).
LIVE_STATES = ("creating", "running", "pausing", "paused", "resuming", "killing", "pooled")
ACTIVE_STATES = ("creating", "running", "pausing", "paused", "resuming", "killing")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "cpk_" + secrets.token_urlsafe(32)


@dataclass
class SandboxRow:
    id: str
    workspace_id: str
    template: str
    backend: str
    state: str
    reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    deadline: float | None
    spec: dict[str, Any]
    metadata: dict[str, str]
    on_timeout: str = "kill"
    paused_at: float | None = None
    remaining: float | None = None
    snapshot_bytes: int | None = None
    # the node whose daemon holds the sandbox (None: nowhere yet, or only in the snapshot
    # store); its epoch grows with every change of owner (compare-and-set: ``transition``)
    node_id: str | None = None
    epoch: int = 0

    @classmethod
    def from_row(cls, r: Mapping[str, Any]) -> SandboxRow:
        d = dict(r)
        d["spec"] = json.loads(d["spec"])
        d["metadata"] = json.loads(d["metadata"])
        return cls(**d)


@dataclass(frozen=True)
class UsageInterval:
    """One interval of the usage meter (cpuosd.accounting.usage): ``end`` None while open."""

    sandbox_id: str
    kind: str  # running | paused
    start: float
    end: float | None
    vcpus: int | None
    memory_mib: int | None
    snapshot_bytes: int | None
    reason: str | None


class Store(Protocol):
    """The daemon's state: workspaces, hashed API keys, sandboxes, execs, connection records
    and usage intervals."""

    dialect: str  # "sqlite" | "postgres"

    def close(self) -> None: ...

    # ---- workspaces and keys
    def create_workspace(self, name: str, limits: dict[str, int] | None = None) -> str: ...
    def workspace(self, wid: str, *, deleted: bool = False) -> dict[str, Any] | None: ...
    def list_workspaces(self, *, deleted: bool = False) -> list[dict[str, Any]]: ...
    def delete_workspace(self, wid: str) -> list[str]: ...
    def set_workspace_settings(self, wid: str, settings: dict[str, Any]) -> None: ...
    def set_workspace_limits(self, wid: str, limits: dict[str, int]) -> None: ...
    def workspace_by_name(self, name: str) -> str | None: ...
    def workspaces_with_setting(self, name: str) -> list[str]: ...
    def add_key(self, workspace_id: str, label: str, key: str | None = None) -> str: ...
    def new_key(self, workspace_id: str, label: str, key: str | None = None
                ) -> tuple[str, dict[str, Any]]: ...
    def workspace_for_key(self, key: str) -> str | None: ...
    def key_lookup(self, key: str) -> tuple[str, str] | None: ...
    def list_keys(self, workspace_id: str) -> list[dict[str, Any]]: ...
    def revoke_key(self, workspace_id: str, key_id: str, *, keep_one: bool) -> str: ...
    def key_record(self, key_id: str) -> dict[str, Any] | None: ...
    def key_live(self, key_id: str) -> bool: ...

    # ---- the web console's sessions (cpuosd.console.sessions), by their token's hash
    def session_create(self, token_hash: str, key_id: str, workspace_id: str,
                       created_at: float, expires_at: float, max_sessions: int) -> None: ...
    def session_get(self, token_hash: str) -> dict[str, Any] | None: ...
    def session_drop(self, token_hash: str) -> bool: ...
    def session_drop_key(self, key_id: str) -> int: ...
    def session_count(self) -> int: ...

    # ---- sandboxes
    def insert_sandbox(self, row: SandboxRow) -> None: ...
    def update_sandbox(self, sid: str, **fields: Any) -> None: ...
    def transition(self, sid: str, from_states: Iterable[str], to_state: str, *,
                   expect_epoch: int | None = None, new_epoch: bool = False,
                   **fields: Any) -> bool: ...
    def fence_node(self, node_id: str, states: Iterable[str], to_state: str,
                   reason: str) -> list[str]: ...
    def get_sandbox(self, sid: str) -> SandboxRow | None: ...
    def list_sandboxes(self, workspace_id: str | None = None, states: tuple[str, ...] = (),
                       *, node_id: str | None = None) -> list[SandboxRow]: ...
    def sandbox_totals(self, workspace_id: str | None, states: tuple[str, ...]
                       ) -> tuple[int, int, int]: ...
    def expired(self, now: float, *, node_id: str | None = None) -> list[tuple[str, str]]: ...

    # ---- nodes (many hosts: membership through the store, cpuosd.cluster.nodes)
    def register_node(self, node_id: str, address: str, incarnation: str,
                      facts: dict[str, Any]) -> None: ...
    def node_heartbeat(self, node_id: str, incarnation: str,
                       facts: dict[str, Any] | None = None) -> bool: ...
    def list_nodes(self) -> list[dict[str, Any]]: ...
    def set_node_cordoned(self, node_id: str, cordoned: bool) -> bool: ...
    def remove_node(self, node_id: str) -> None: ...

    def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        """Hold (or renew) the lease ``name`` for ``ttl`` s: True unless another holder's
        has not expired (one statement: two processes racing, one wins)."""
        ...

    # ---- execs and connection records
    def insert_exec(self, eid: str, sandbox_id: str, argv: list[str]) -> None: ...
    def finish_exec(self, eid: str, **fields: Any) -> None: ...
    def list_execs(self, sandbox_id: str, limit: int = 100) -> list[dict[str, Any]]: ...
    def add_connection(self, sandbox_id: str, rec: dict[str, Any]) -> None: ...
    def add_connections(self, batch: list[tuple[str, dict[str, Any]]]) -> None: ...
    def list_connections(self, sandbox_id: str, limit: int = 100, after: int = 0
                         ) -> list[dict[str, Any]]: ...

    # ---- usage intervals (cpuosd.accounting.usage)
    def usage_open(self, workspace_id: str, sandbox_id: str, kind: str, start: float, *,
                   vcpus: int | None = None, memory_mib: int | None = None,
                   snapshot_bytes: int | None = None, reason: str | None = None) -> None: ...
    def usage_close(self, sandbox_id: str, at: float) -> None: ...
    def usage_dangling(self) -> list[tuple[int, str, str | None, float | None, float | None]]:
        ...
    def usage_close_interval(self, interval_id: int, at: float) -> None: ...
    def usage_intervals(self, workspace_id: str, since: float, until: float,
                        sandbox_id: str | None = None) -> list[UsageInterval]: ...
    def usage_recent(self, workspace_id: str, ended_after: float, now: float
                     ) -> list[UsageInterval]: ...
