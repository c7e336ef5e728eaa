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

import contextlib
import hashlib
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from ..lifecycle.states import State
from ..lifecycle import states

# what is kept of one sandbox's connection record (the oldest go first)
MAX_CONNECTIONS = 10_000

# States with something on the host (a runsc sandbox, a snapshot, or both in flux).
LIVE_STATES = states.LIVE
ACTIVE_STATES = states.ACTIVE


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "cpk_" + secrets.token_urlsafe(32)


# keys of a stored spec written only once they have a value (added after the first
# version: a row without them means None)
_LATE_KEYS = frozenset({"agent_key", "ports", "e2b", "wake_on_request"})


@dataclass(frozen=True)
class RowSpec:
    """A sandbox's ``spec`` as the store holds it (the JSON column ``sandboxes.spec``):
    what it was made with and what was set on it since. Immutable: a change is a new one
    (``dataclasses.replace``), written with ``Store.update_sandbox(sid, spec=...)``.

    ``to_json`` gives the dict the store writes: the keys in the order the daemon always
    wrote them, a late key only once it is set, and any key this version does not know
    kept as it was (``extra``); ``from_json`` reads any row, also one written before a key
    existed (its default)."""

    rootfs: str = ""
    template_digest: str | None = None
    vcpus: int = 0
    memory_mib: int = 0
    pids: int | None = None
    disk_mib: int | None = None
    hostname: str = "sandbox"
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None  # s the sandbox was created with (a resume's default)
    machine_id: str = ""
    template_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None  # the template's (None: /work)
    network: dict[str, Any] | None = None  # the egress policy (network.policy.Policy JSON)
    idle_timeout: float = 0.0  # s without activity before an auto-pause (0: never)
    # late keys
    agent_key: str | None = None  # the agent's key (lifecycle.manager._agent_key)
    ports: dict[str, dict[str, Any]] | None = None  # exposed ports (proxy.preview)
    e2b: dict[str, Any] | None = None  # E2B facts shared with other nodes (e2b.state)
    wake_on_request: bool | None = None  # False: a preview request does not wake it
    # keys this version does not know, kept as they were
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RowSpec:
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known},
                   extra={k: v for k, v in d.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "extra" or (f.name in _LATE_KEYS and v is None):
                continue
            out[f.name] = v
        out.update(self.extra)
        return out


@dataclass
class SandboxRow:
    id: str
    workspace_id: str
    template: str
    backend: str
    state: State
    reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    deadline: float | None
    spec: RowSpec
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
        d["state"] = State(d["state"])
        d["spec"] = RowSpec.from_json(json.loads(d["spec"]))
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
    def transition(self, sid: str, from_states: Iterable[State], to_state: State, *,
                   expect_epoch: int | None = None, new_epoch: bool = False,
                   **fields: Any) -> bool: ...
    def fence_node(self, node_id: str, states: Iterable[State], to_state: State,
                   reason: str) -> list[str]: ...
    def get_sandbox(self, sid: str) -> SandboxRow | None: ...
    def list_sandboxes(self, workspace_id: str | None = None, states: tuple[State, ...] = (),
                       *, node_id: str | None = None) -> list[SandboxRow]: ...
    def sandbox_totals(self, workspace_id: str | None, states: tuple[State, ...]
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

    def serialized(self, scope: str) -> contextlib.AbstractContextManager[None]:
        """A block that runs alone among every process sharing the store (per ``scope``,
        e.g. ``admission:<workspace>``), as one transaction: the calls of this store made
        by this thread inside it are that transaction's, committed at the block's end
        (rolled back if it raises). Postgres: a transaction-scoped advisory lock on the
        scope (waited for at most ``SERIAL_LOCK_TIMEOUT_MS``, then ``ApiError``
        ``unavailable`` naming the scope); SQLite (one host): a write transaction. Not
        nested; keep it short and without awaits (an event loop waits on it)."""
        ...

    def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        """Hold (or renew) the lease ``name`` for ``ttl`` s: True unless another holder's
        has not expired (one statement: two processes racing, one wins)."""
        ...

    # ---- sealed secrets (many hosts: cpuosd.network.secrets.SealedBackend; the values and
    # CA keys of sandboxes, AES-GCM under the cluster's secrets key, never plaintext)
    def put_secret(self, name: str, key_id: str, data: str) -> None: ...
    def get_secret(self, name: str) -> tuple[str, str] | None: ...
    def delete_secrets(self, names: list[str]) -> None: ...
    def secret_names(self, *, not_key: str | None = None) -> list[str]: ...

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
