"""Nodes through the state store (membership without Kubernetes; docs/DEPLOY.md).

A node (``cpuosd --role=node``) registers its row in the store's ``nodes`` table at start,
with a new random incarnation (a restarted node has lost its sandboxes' processes, whatever
its id), and heartbeats every ``node_lease / 3`` seconds with its facts: where its internal
API listens, capacity (vCPUs, memory, memory available now), runsc version and platform,
CPU vendor/model/features (gVisor refuses a restore on a CPU lacking saved features), and
the digests of the templates it holds. Under Kubernetes the same facts ride on its Lease
(cpuosd.cluster.membership); the store's table is what a plain multi-host set-up and the
tests on one host use.

An API process (``--role=api``) reads the rows (``NodeView.refresh``): a node is alive while
its ``heartbeat_at`` keeps changing, judged by this process's own monotonic clock since the
value last changed (on first sight: by the value's wall-clock age), so clock skew between
hosts does not matter; cordoned nodes take no new placements.

Every request from an API process to a node carries the node token (``X-Cpuos-Node-Token``,
``CPUOS_NODE_TOKEN``); a node refuses any other (``NodeTokenGuard``), /health aside.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ApiError
from ..store import Store
from ..lifecycle.states import State

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..config import Config
    from ..lifecycle.manager import Manager

log = logging.getLogger("cpuosd.cluster")

TOKEN_HEADER = "x-cpuos-node-token"
OPEN_PATHS = frozenset({"/health"})
SANDBOX_PATH = re.compile(r"^/sandboxes/([A-Za-z0-9_-]{1,64})(?:/|$)")
# An API process sends a request under /sandboxes/<id> straight to the node it last found
# holding that sandbox (its route cache: no trip to the store), marked with this header
# ("cached"); a node that does not hold the sandbox live answers 421 with the header set to
# "elsewhere" before anything runs, and the API process then takes the ordinary way (the
# sandbox's row) with the same request.
ROUTE_HEADER = "x-cpuos-route"
# a node's id: a DNS label (its Lease's name is cpuos-node-<id>, cpuosd.cluster.membership)
NODE_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,50}[a-z0-9])?$")


def node_id_of(cfg: Config) -> str:
    """The node's id: CPUOS_NODE_ID, else the host's name (lower case); a DNS label."""
    nid = (cfg.cluster.node_id or socket.gethostname().split(".")[0]).lower()
    if not NODE_ID_RE.fullmatch(nid):
        raise ValueError(f"node id {nid!r} must be a DNS label (lower case letters, digits, "
                         "'-' and '.'), at most 52 characters: set CPUOS_NODE_ID")
    return nid


def check_token(token: str | None, role: str) -> str:
    if not token or len(token) < 16:
        raise ValueError(f"--role={role} needs CPUOS_NODE_TOKEN (the secret API processes "
                         "and nodes share, 16 characters or more)")
    return token


class NodeTokenGuard:
    """A node's internal API: every request but /health carries the node token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == TOKEN_HEADER.encode()), b"")
        if hmac.compare_digest(given, self.token):
            # (an API process sent it: the console's origin check reads its Host there,
            # cpuosd.console.sessions.same_origin)
            scope.setdefault("state", {})["via_api_tier"] = True
            if scope["type"] == "http" and not self._holds(scope):
                await _reply(send, 421, ApiError(
                    "conflict", "this node does not hold that sandbox live (an API "
                    "process's route cache; it asks the store next)"),
                    [(ROUTE_HEADER.encode(), b"elsewhere")])
                return
            # (a request of E2B's sandbox plane is E2B's, whole: envd's host form is handed
            # here by the preview proxy with the token, on behalf of anyone)
            if scope["type"] == "http" and scope["path"] == "/node/drain" and not any(
                    k == b"e2b-sandbox-id" for k, _ in scope["headers"]):
                if scope["method"] != "POST":
                    await _reply(send, 404, ApiError("not_found", "POST /node/drain"))
                    return
                from ..api.deps import services_of

                try:
                    svc = services_of(scope["app"])
                except ApiError as e:
                    await _reply(send, e.status, e)
                    return
                await _reply(send, 200, await drain(svc.manager, svc.node))
                return
            if scope["type"] == "http" and scope["path"] == "/node/events" \
                    and scope["method"] == "GET" and not any(
                        k == b"e2b-sandbox-id" for k, _ in scope["headers"]):
                # (every workspace's events, for an API process's GET /events: cluster.events)
                from .events import serve_node

                try:
                    await serve_node(scope["app"], scope, receive, send)
                except ApiError as e:
                    await _reply(send, e.status, e)
                return
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 4403,
                        "reason": "node token required"})
            return
        await _reply(send, 403, ApiError(
            "permission_denied", "this is a cpuos node: its API is reached through an API "
            "process (missing or wrong node token)"))

    @staticmethod
    def _holds(scope: Scope) -> bool:
        """False for a request the API process routed by its cache (ROUTE_HEADER) to a
        sandbox this node does not hold live (paused, gone, moved to another node)."""
        if not any(k == ROUTE_HEADER.encode() and v == b"cached" for k, v in scope["headers"]):
            return True
        m = SANDBOX_PATH.match(scope["path"])
        if m is None:
            return False
        from ..api.deps import services_of

        try:
            return m.group(1) in services_of(scope["app"]).manager.live
        except ApiError:
            return False


async def _reply(send: Send, status: int, what: ApiError | dict[str, Any],
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(what.body() if isinstance(what, ApiError) else what).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(extra or ())]})
    await send({"type": "http.response.body", "body": body})


async def drain(mgr: Manager, rt: NodeRuntime | None = None) -> dict[str, Any]:
    """Cordon this node, then pause every running sandbox of it (into the snapshot store
    when the node has one: then any node resumes them), one after another (each pause is
    bounded by itself)."""
    if rt is not None:  # (cordoned first: nothing new lands here meanwhile)
        await rt.cordon()
    elif mgr.node_id is not None:
        await asyncio.to_thread(mgr.store.set_node_cordoned, mgr.node_id, True)
    rows = await asyncio.to_thread(mgr.store.list_sandboxes, None, (State.RUNNING,),
                                   node_id=mgr.node_id)
    paused, failed = [], []
    for row in rows:
        try:
            await mgr.snapshots.pause(row.workspace_id, row.id, reason="drain")
            paused.append(row.id)
        except ApiError as e:
            failed.append({"id": row.id, "error": e.code, "message": e.message})
    log.info("node %s drained: %d paused, %d failed", mgr.node_id, len(paused), len(failed))
    return {"node": mgr.node_id, "paused": paused, "failed": failed}


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo", encoding="ascii", errors="replace"):
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) // 1024  # MiB
    return out


def node_facts(cfg: Config, backend: Backend, address: str, mgr: Manager | None = None
               ) -> dict[str, Any]:
    """What placement needs to know about this node, now (with ``mgr``: what it holds that
    placement prefers: Manager.placement_facts)."""
    from ..snapstore.facts import host_facts
    from ..templates.builder import list_templates

    mem = _meminfo()
    facts: dict[str, Any] = {
        "address": address,
        "capacity": {"vcpus": os.cpu_count() or 1, "memory_mib": mem.get("MemTotal", 0),
                     "memory_available_mib": mem.get("MemAvailable", 0)},
        **host_facts(backend),
    }
    with contextlib.suppress(OSError):
        facts["templates"] = sorted({str(t.get("digest")) for t in
                                     list_templates(cfg.templates_dir) if t.get("digest")})
    if cfg.cluster.database_url and cfg.cluster.secrets_key_file:
        # the id (a hash) of the key sealing secrets: a fork of a sandbox with secrets goes
        # to nodes that hold it
        from ..network.secrets import SecretKeyError, key_id, load_keys

        with contextlib.suppress(SecretKeyError):
            facts["secrets_key"] = key_id(load_keys(cfg.cluster.secrets_key_file)[0])
    if cfg.cluster.snapshot_store:  # (its URL: bucket and prefix, or a path; no secret)
        # nodes naming the same store restore each other's images (a fork across nodes)
        facts["snapshot_store"] = cfg.cluster.snapshot_store
    if mgr is not None:
        try:
            facts.update(mgr.placement_facts())
        except Exception as e:  # (the next beat tries again)
            log.warning("what this node holds could not be read: %s", e)
    return facts


FENCED_STATES = (State.CREATING, State.RUNNING, State.PAUSING, State.RESUMING, State.KILLING,
                 State.POOLED)
FENCED_REASON = "node_lost"


def fence_dead(store: Store, view: NodeView | KubeNodeView, after: float
               ) -> dict[str, list[str]]:
    """Fence the nodes dead for longer than ``after`` s (by ``view``'s clock): their
    sandboxes in FENCED_STATES become error/node_lost with a new epoch, in one
    compare-and-set per node (safe if several API processes do it at once); their usage
    intervals end, and (Postgres) their sealed secrets unless a live sandbox shares them.
    Those paused on such a node stay (its disk holds them)."""
    out: dict[str, list[str]] = {}
    if after <= 0:
        return out
    for n in view.nodes:
        if n.alive or view.dead_for(n.node_id) < after:
            continue
        ids = store.fence_node(n.node_id, FENCED_STATES, State.ERROR, FENCED_REASON)
        if ids:
            now = time.time()
            for sid in ids:
                store.usage_close(sid, now)
            log.error("node %s dead for %.0f s: %d sandbox(es) marked lost: %s", n.node_id,
                      view.dead_for(n.node_id), len(ids), ", ".join(ids[:20]))
            out[n.node_id] = ids
            if store.dialect == "postgres":  # (their sealed secrets, unless still used)
                from ..network.secrets import unused

                try:
                    store.delete_secrets(unused(store, ids))
                except Exception as e:  # (the fencing stands; the rows stay sealed)
                    log.warning("the secrets of fenced sandboxes were not removed: %s", e)
    return out


async def stop_fenced(mgr: Manager) -> list[str]:
    """On a node: sandboxes it still runs whose rows were fenced while it was away (an
    API process saw it dead): stopped, as their rows say they are lost."""
    stopped: list[str] = []
    if not mgr.live:
        return stopped
    mine = {r.id for r in await asyncio.to_thread(
        mgr.store.list_sandboxes, None, FENCED_STATES, node_id=mgr.node_id)}
    for sid in [s for s in mgr.live if s not in mine]:  # (one query while none is fenced)
        row = await asyncio.to_thread(mgr.store.get_sandbox, sid)
        if row is not None and row.state == State.ERROR and row.reason == FENCED_REASON:
            log.error("sandbox %s was fenced while this node was away: stopping it", sid)
            with contextlib.suppress(Exception):
                await mgr._teardown(sid)
            stopped.append(sid)
    return stopped


class NodeAgent:
    """A node's registration and heartbeat in the store."""

    def __init__(self, store: Store, node_id: str, address: str,
                 facts: Callable[[], dict[str, Any]], lease: float = 15.0,
                 after_beat: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.store, self.node_id, self.address = store, node_id, address
        self.facts = facts
        self.after_beat = after_beat
        self.lease = max(1.0, lease)
        self.incarnation = secrets.token_hex(6)
        self.last_beat = 0.0  # monotonic

    async def register(self) -> None:
        await asyncio.to_thread(lambda: self.store.register_node(
            self.node_id, self.address, self.incarnation, self.facts()))
        self.last_beat = time.monotonic()
        log.info("node %s registered (%s, incarnation %s)", self.node_id, self.address,
                 self.incarnation)

    async def run(self) -> None:
        """Heartbeat until cancelled (a failed one is retried at the next beat)."""
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                ok = await asyncio.wait_for(asyncio.to_thread(
                    lambda: self.store.node_heartbeat(self.node_id, self.incarnation,
                                                      self.facts())), self.lease)
                if not ok:  # another process of this node took the row over
                    log.error("node %s: its row has another incarnation: registering again",
                              self.node_id)
                    await self.register()
                self.last_beat = time.monotonic()
                if self.after_beat is not None:
                    await self.after_beat()
            except Exception as e:  # (a database that is away: the next beat retries)
                log.warning("node %s: heartbeat failed: %s", self.node_id, e)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    incarnation: str
    facts: dict[str, Any]
    alive: bool
    cordoned: bool

    @property
    def placeable(self) -> bool:
        return self.alive and not self.cordoned and bool(self.address)


class NodeView:
    """The nodes as an API process sees them (from the store)."""

    def __init__(self, store: Store, lease: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.lease, self.clock = store, lease, clock
        self._seen: dict[str, tuple[float, str, float]] = {}  # id -> (beat, inc, our clock)
        self.nodes: list[NodeInfo] = []

    def refresh(self) -> list[NodeInfo]:
        rows = self.store.list_nodes()
        now_mono, now_wall = self.clock(), time.time()
        out = []
        for r in rows:
            beat, inc = float(r["heartbeat_at"]), str(r["incarnation"])
            prev = self._seen.get(r["id"])
            if prev is None or prev[0] != beat or prev[1] != inc:
                age = max(0.0, now_wall - beat) if prev is None else 0.0
                prev = self._seen[r["id"]] = (beat, inc, now_mono - age)
            out.append(NodeInfo(r["id"], str(r["address"]), inc, r["facts"],
                                now_mono - prev[2] <= self.lease, bool(r["cordoned"])))
        for gone in set(self._seen) - {r["id"] for r in rows}:
            del self._seen[gone]
        self.nodes = out
        return out

    def dead_for(self, node_id: str) -> float:
        """s since the node's lease ran out (by this process's clock); 0 while alive."""
        seen = self._seen.get(node_id)
        if seen is None:
            return 0.0
        return max(0.0, self.clock() - seen[2] - self.lease)

    def get(self, node_id: str | None) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)


def _has(n: NodeInfo, fact: str, item: str | None) -> bool:
    return bool(item) and item in (n.facts.get(fact) or ())


def place(nodes: list[NodeInfo], memory_mib: int = 0, template_digest: str | None = None,
          *, template: str | None = None, snapshot: str | None = None) -> NodeInfo | None:
    """The node for a new sandbox (or a resume): live, not cordoned, with the memory free
    (its last heartbeat's MemAvailable, as admission on one host goes by real use). Among
    those, preferring one that holds a local copy of the ``snapshot`` (a resume: no
    download), then one with a warm pool sandbox of the ``template`` ready (a create: no
    restore at all), then one with that template's checkpoint made (a restore, no cold
    boot), then one with the template's build (``template_digest``); ties by the most memory
    available (then the node id, for a stable answer). What a node holds is in its
    heartbeat's facts (``node_facts``: snapshots, pools, template_images, templates)."""
    def mem(n: NodeInfo) -> float:
        return float(n.facts.get("capacity", {}).get("memory_available_mib", 0))

    fits = [n for n in nodes if n.placeable and mem(n) >= memory_mib]
    if not fits:
        return None
    return min(fits, key=lambda n: (
        not _has(n, "snapshots", snapshot), not _has(n, "pools", template),
        not _has(n, "template_images", template), not _has(n, "templates", template_digest),
        -mem(n), n.node_id))


def place_children(nodes: list[NodeInfo], parent: NodeInfo, n: int, memory_mib: int = 0,
                   template_digest: str | None = None, *, secrets: bool = False
                   ) -> list[NodeInfo] | None:
    """The node of each of a fork's ``n`` children (None: not all fit). Candidates: the
    parent's node and every node that can restore its image (placeable, the same shared
    snapshot store, the parent's template build, a host the parent's node's snapshots
    restore on: ``snapstore.facts.incompatibilities``; a parent with ``secrets``: the
    secrets key of the parent's node, by its id). The children take turns over them,
    the parent's node first (no transfer), then the others by memory available, each
    child's memory counted against the node it is given: a fork fans out."""
    from ..snapstore.facts import incompatibilities

    def can(x: NodeInfo) -> bool:
        if not x.placeable:
            return False
        if x.node_id == parent.node_id:
            return True
        return (bool(x.facts.get("snapshot_store"))
                and x.facts.get("snapshot_store") == parent.facts.get("snapshot_store")
                and (not template_digest or template_digest in (x.facts.get("templates")
                                                                or ()))
                and not incompatibilities(parent.facts, x.facts)
                and (not secrets or (bool(x.facts.get("secrets_key"))
                                     and x.facts.get("secrets_key")
                                     == parent.facts.get("secrets_key"))))

    free = {x.node_id: float(x.facts.get("capacity", {}).get("memory_available_mib", 0))
            for x in nodes}
    others = sorted((x for x in nodes if x.node_id != parent.node_id and can(x)),
                    key=lambda x: (-free[x.node_id], x.node_id))
    order = ([parent] if can(parent) else []) + others
    out: list[NodeInfo] = []
    while len(out) < n:
        took = False
        for x in order:
            if len(out) < n and free[x.node_id] >= memory_mib:
                out.append(x)
                free[x.node_id] -= memory_mib
                took = True
        if not took:
            return None
    return out


class NodeRuntime:
    """What a node runs to be known: its row in the store (always: `cpuos node ls` reads
    it), and with CPUOS_MEMBERSHIP=kubernetes its Lease (cpuosd.cluster.membership), which
    is then what API processes judge it by."""

    def __init__(self, agent: NodeAgent, lease: Any = None, api: Any = None) -> None:
        self.agent, self.lease, self.api = agent, lease, api
        self.tasks: list[asyncio.Task[Any]] = []

    async def cordon(self) -> None:
        await asyncio.to_thread(self.agent.store.set_node_cordoned, self.agent.node_id, True)
        if self.lease is not None:
            from .membership import Membership

            await Membership(self.api, self.lease.namespace).cordon(self.agent.node_id)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.api is not None:
            await self.api.close()


# node_facts that ride in a Lease's NodeFacts.extra (placement's preferences, the store)
LEASE_EXTRA = ("pools", "template_images", "snapshot_store")


def lease_facts(facts: dict[str, Any], node_id: str, incarnation: str) -> Any:
    """A node's facts (node_facts) as a Lease annotation carries them."""
    from .membership import NodeFacts

    return NodeFacts(node_id=node_id, address=str(facts.get("address") or ""),
                     preview_address=str(facts.get("preview_address") or ""),
                     incarnation=incarnation,
                     capacity={k: float(v) for k, v in (facts.get("capacity") or {}).items()},
                     runsc_version=str((facts.get("runtime") or {}).get("runsc_version") or ""),
                     image_kind=str(facts.get("image_kind") or ""),
                     cpu_features=tuple(facts.get("cpu_features") or ()),
                     templates=tuple(facts.get("templates") or ()),
                     snapshots=tuple(facts.get("snapshots") or ()),
                     extra={k: facts[k] for k in LEASE_EXTRA if k in facts})


def facts_of_lease(f: Any) -> dict[str, Any]:
    """The other way round: what placement reads (``place``) from a Lease's NodeFacts."""
    if f is None:
        return {}
    return {**{k: v for k, v in f.extra.items() if k in LEASE_EXTRA},
            "address": f.address, "preview_address": f.preview_address,
            "capacity": dict(f.capacity), "image_kind": f.image_kind,
            "runtime": {"runsc_version": f.runsc_version},
            "cpu_features": list(f.cpu_features), "templates": list(f.templates),
            "snapshots": list(f.snapshots)}


async def start_node(cfg: Config, store: Store, backend: Backend, mgr: Manager,
                     preview_port: int | None = None) -> NodeRuntime:
    """``preview_port``: where the node's preview listener is; API processes relay preview
    URLs to the host of its address at that port (``preview_address`` in its facts)."""
    cc = cfg.cluster
    address = cc.node_address or f"{cfg.host}:{cfg.port}"
    preview = (f"{address.rpartition(':')[0]}:{preview_port}" if preview_port is not None
               else "")

    def facts() -> dict[str, Any]:
        return {**node_facts(cfg, backend, address, mgr), "preview_address": preview}

    agent = NodeAgent(store, str(cc.node_id), address, facts, cc.node_lease,
                      after_beat=functools.partial(stop_fenced, mgr))
    await agent.register()
    rt = NodeRuntime(agent)
    rt.tasks.append(asyncio.ensure_future(agent.run()))
    if cc.membership == "kubernetes":
        from .membership import NodeLease, connect

        rt.api = await connect()
        lease = NodeLease(rt.api, cc.k8s_namespace,
                          lease_facts(facts(), agent.node_id, agent.incarnation),
                          lease_seconds=int(max(3, cc.node_lease)))
        await lease.register()
        rt.lease = lease
        rt.tasks.append(asyncio.ensure_future(lease.run(
            lambda: lease_facts(facts(), agent.node_id, agent.incarnation))))
    elif cc.membership != "store":
        raise ValueError(f"CPUOS_MEMBERSHIP must be store or kubernetes, not "
                         f"{cc.membership!r}")
    return rt


class KubeNodeView:
    """NodeView's interface over the nodes' Leases (CPUOS_MEMBERSHIP=kubernetes): alive by
    the Lease's renewals as this process sees them (cpuosd.cluster.membership.Membership),
    cordoned by the Lease's label."""

    def __init__(self, membership: Any, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.membership, self.clock = membership, clock
        self.nodes: list[NodeInfo] = []
        self._dead_since: dict[str, float] = {}

    async def refresh_async(self) -> list[NodeInfo]:
        states = await self.membership.refresh()
        now = self.clock()
        out = []
        for s in states:
            facts = facts_of_lease(s.facts)
            out.append(NodeInfo(s.node_id, str(facts.get("address") or ""),
                                s.holder.rpartition("/")[2], facts, s.alive, s.cordoned))
            if s.alive:
                self._dead_since.pop(s.node_id, None)
            else:
                self._dead_since.setdefault(s.node_id, now)
        self.nodes = out
        return out

    def get(self, node_id: str | None) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def dead_for(self, node_id: str) -> float:
        since = self._dead_since.get(node_id)
        return 0.0 if since is None else self.clock() - since
