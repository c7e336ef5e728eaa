"""Node membership and leader election through ``coordination.k8s.io/v1`` Leases
(kubernetes_asyncio; in a Pod: its ServiceAccount, deploy/kubernetes/rbac.yaml).

Nodes (``--role=node``): each keeps a Lease ``cpuos-node-<node id>`` in the deployment's
namespace, labelled ``cpuos.dev/role=node``: ``holderIdentity`` is ``<node id>/<incarnation>``
(a new random incarnation per process start: a node that restarted has lost its sandboxes'
processes, whatever its id), ``renewTime`` is its heartbeat (``NodeLease.run``: every
``lease_seconds / 3``), and the annotation ``cpuos.dev/facts`` carries what placement needs
(``NodeFacts``: address, capacity, runsc version, CPU features, templates and snapshots it
holds), sent only when it changed.

API processes (``--role=api``) read them (``Membership.refresh``): a node is alive while its
``renewTime`` keeps moving — judged by this process's own monotonic clock since the value
last changed, as client-go's leader election does, so clock skew between hosts does not
matter (on first sight, the wall clock's age of the value counts) — and cordoned (no new
placements) while its Lease has the label ``cpuos.dev/cordoned=true`` (``cordon``). A node's
heartbeat patches only ``spec`` and its own annotation, never that label.

Leader election (``LeaderElector``): the API processes elect one holder of the Lease
``cpuos-api-leader`` (kubernetes_asyncio's leader election, which takes over a Lease not
renewed for its duration and updates it with the resourceVersion it read, so two
candidates cannot both win); the leader runs the cluster-wide loops (deadline reaper,
dead-node fencing, snapshot sweeping). A leader that stops releases the Lease (empty
holder) so another takes over at once; one that dies is replaced after the Lease's
duration. The leader's work must still be safe if two ran at once for a moment: every state
change it makes is a compare-and-set in the store (cpuosd.store: ``transition``,
``fence_node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.api_client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

from .nodes import NODE_ID_RE  # (this module, and kubernetes_asyncio, only where Leases are used)

log = logging.getLogger("cpuosd.cluster")

NODE_PREFIX = "cpuos-node-"
LEADER_LEASE = "cpuos-api-leader"
ROLE_LABEL = "cpuos.dev/role"
CORDON_LABEL = "cpuos.dev/cordoned"
FACTS = "cpuos.dev/facts"
MAX_LISTED = 2000  # templates or snapshots named in a node's facts (more: "truncated")
CALL_TIMEOUT = 10.0  # s for one call to the apiserver


def _now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _wall(t: Any) -> float | None:
    """A Lease time (a datetime from the client, or its RFC 3339 text) as epoch seconds."""
    if t is None:
        return None
    if isinstance(t, datetime.datetime):
        return (t if t.tzinfo else t.replace(tzinfo=datetime.UTC)).timestamp()
    with contextlib.suppress(ValueError):
        return datetime.datetime.fromisoformat(str(t).replace("Z", "+00:00")).timestamp()
    return None


@dataclass(frozen=True)
class NodeFacts:
    """What a node tells the API processes about itself (placement's inputs)."""

    node_id: str
    address: str  # where its internal API listens (host:port)
    incarnation: str = field(default_factory=lambda: secrets.token_hex(6))
    capacity: dict[str, float] = field(default_factory=dict)  # vcpus, memory_mib, free_*...
    runsc_version: str = ""
    image_kind: str = ""
    cpu_features: tuple[str, ...] = ()
    templates: tuple[str, ...] = ()  # template digests it has built (and checkpointed)
    snapshots: tuple[str, ...] = ()  # snapshot keys it has a local copy of
    truncated: bool = False  # (more templates or snapshots than MAX_LISTED)
    preview_address: str = ""  # where its preview listener is (host:port; API tier relays)
    # the rest placement reads (cpuosd.cluster.nodes.LEASE_EXTRA: warm pools, template
    # checkpoints, the snapshot store's URL)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_annotation(self) -> str:
        d = asdict(self)
        if len(self.templates) > MAX_LISTED or len(self.snapshots) > MAX_LISTED:
            d["templates"], d["snapshots"] = (list(self.templates[:MAX_LISTED]),
                                              list(self.snapshots[:MAX_LISTED]))
            d["truncated"] = True
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_annotation(cls, text: str) -> NodeFacts:
        d = json.loads(text)
        return cls(node_id=str(d["node_id"]), address=str(d.get("address") or ""),
                   preview_address=str(d.get("preview_address") or ""),
                   incarnation=str(d.get("incarnation") or ""),
                   capacity={str(k): float(v) for k, v in (d.get("capacity") or {}).items()},
                   runsc_version=str(d.get("runsc_version") or ""),
                   image_kind=str(d.get("image_kind") or ""),
                   cpu_features=tuple(map(str, d.get("cpu_features") or ())),
                   templates=tuple(map(str, d.get("templates") or ())),
                   snapshots=tuple(map(str, d.get("snapshots") or ())),
                   truncated=bool(d.get("truncated")),
                   extra=dict(d.get("extra") or {}) if isinstance(d.get("extra"), dict)
                   else {})


@dataclass(frozen=True)
class NodeState:
    """A node as an API process sees it."""

    node_id: str
    facts: NodeFacts | None  # None: its Lease has no readable facts
    holder: str
    alive: bool
    cordoned: bool
    lease_seconds: int
    renewed: float | None  # wall time of its last heartbeat, as the Lease says

    @property
    def placeable(self) -> bool:
        return self.alive and not self.cordoned and self.facts is not None


def lease_name(node_id: str) -> str:
    if not NODE_ID_RE.fullmatch(node_id):
        raise ValueError(f"node id {node_id!r} must be a DNS label (lower case letters, "
                         "digits, '-' and '.'), at most 52 characters")
    return NODE_PREFIX + node_id


class NodeLease:
    """A node's registration and heartbeat."""

    def __init__(self, api: ApiClient, namespace: str, facts: NodeFacts,
                 lease_seconds: int = 15) -> None:
        self.api = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.facts = facts
        self.name = lease_name(facts.node_id)
        self.lease_seconds = max(3, int(lease_seconds))
        self._sent_facts = ""
        self.last_renewed = 0.0  # monotonic time of the last heartbeat the apiserver took

    @property
    def holder(self) -> str:
        return f"{self.facts.node_id}/{self.facts.incarnation}"

    async def register(self) -> None:
        """Create the node's Lease, or take it over from a previous incarnation (the
        cordon label, set by an operator, stays as it is)."""
        now = datetime.datetime.now(datetime.UTC)
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, labels={ROLE_LABEL: "node"},
                                         annotations={FACTS: self.facts.to_annotation()}),
            spec=client.V1LeaseSpec(holder_identity=self.holder, acquire_time=now,
                                    renew_time=now, lease_duration_seconds=self.lease_seconds))
        try:
            await asyncio.wait_for(self.api.create_namespaced_lease(self.namespace, lease),
                                   CALL_TIMEOUT)
        except ApiException as e:
            if e.status != 409:
                raise
            await self._patch({"metadata": {"labels": {ROLE_LABEL: "node"},
                                            "annotations": {FACTS: self.facts.to_annotation()}},
                               "spec": self._spec(acquire=True)})
        self._sent_facts = self.facts.to_annotation()
        self.last_renewed = time.monotonic()

    def _spec(self, acquire: bool = False) -> dict[str, Any]:
        now = _now_rfc3339()
        spec: dict[str, Any] = {"holderIdentity": self.holder,
                                "leaseDurationSeconds": self.lease_seconds, "renewTime": now}
        if acquire:
            spec["acquireTime"] = now
        return spec

    async def _patch(self, body: dict[str, Any]) -> None:
        # (a dict: sent as a strategic merge patch, which for a Lease merges like RFC 7386)
        await asyncio.wait_for(self.api.patch_namespaced_lease(self.name, self.namespace, body),
                               CALL_TIMEOUT)

    async def heartbeat(self, facts: NodeFacts | None = None) -> None:
        """Renew the Lease; with ``facts``, publish them too (only if they changed)."""
        if facts is not None:
            if facts.node_id != self.facts.node_id or facts.incarnation != self.facts.incarnation:
                raise ValueError("a node's facts keep its id and incarnation")
            self.facts = facts
        body: dict[str, Any] = {"spec": self._spec()}
        text = self.facts.to_annotation()
        if text != self._sent_facts:
            body["metadata"] = {"annotations": {FACTS: text}}
        await self._patch(body)
        self._sent_facts = text
        self.last_renewed = time.monotonic()

    async def run(self, facts: Callable[[], NodeFacts] | None = None,
                  on_lost: Callable[[], None] | None = None) -> None:
        """Heartbeat every ``lease_seconds / 3`` until cancelled; ``facts`` (if given) is
        asked each time. A heartbeat that fails is retried at the next beat; once none has
        succeeded for the Lease's duration, API processes count this node dead, and
        ``on_lost`` is called (the node should take no new work until one succeeds)."""
        lost = False
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await self.heartbeat(facts() if facts else None)
                if lost:
                    log.warning("node lease %s renewed again", self.name)
                lost = False
            except (ApiException, OSError, TimeoutError, ValueError) as e:
                log.warning("node lease %s: heartbeat failed: %s", self.name, e)
                if not lost and time.monotonic() - self.last_renewed > self.lease_seconds:
                    lost = True
                    if on_lost is not None:
                        on_lost()

    async def leave(self) -> None:
        """Delete the node's Lease (after a drain: it holds nothing any more)."""
        with contextlib.suppress(ApiException):
            await asyncio.wait_for(self.api.delete_namespaced_lease(self.name, self.namespace),
                                   CALL_TIMEOUT)


class Membership:
    """The nodes, as an API process sees them through their Leases."""

    def __init__(self, api: ApiClient, namespace: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.clock = clock
        # lease name -> (renewTime as written, holder, our clock when that value was first seen)
        self._seen: dict[str, tuple[str, str, float]] = {}

    async def refresh(self) -> list[NodeState]:
        leases = await asyncio.wait_for(self.api.list_namespaced_lease(
            self.namespace, label_selector=f"{ROLE_LABEL}=node"), CALL_TIMEOUT)
        now_mono, now_wall = self.clock(), time.time()
        out, names = [], set()
        for lease in leases.items:
            name = lease.metadata.name
            if not name.startswith(NODE_PREFIX):
                continue
            names.add(name)
            spec = lease.spec
            renew_raw = str(spec.renew_time) if spec and spec.renew_time else ""
            holder = (spec.holder_identity if spec else None) or ""
            duration = int((spec.lease_duration_seconds if spec else None) or 15)
            renewed = _wall(spec.renew_time) if spec else None
            prev = self._seen.get(name)
            if prev is None or prev[0] != renew_raw or prev[1] != holder:
                # a new value: it was renewed now (on first sight: as long ago as it says)
                age = max(0.0, now_wall - renewed) if (prev is None and renewed) else 0.0
                if not renew_raw:
                    age = float("inf")
                self._seen[name] = prev = (renew_raw, holder, now_mono - age)
            alive = bool(holder) and now_mono - prev[2] <= duration
            labels = lease.metadata.labels or {}
            facts = None
            with contextlib.suppress(ValueError, KeyError, TypeError):
                facts = NodeFacts.from_annotation((lease.metadata.annotations or {})[FACTS])
            out.append(NodeState(name[len(NODE_PREFIX):], facts, holder, alive,
                                 labels.get(CORDON_LABEL) == "true", duration, renewed))
        for gone in set(self._seen) - names:
            del self._seen[gone]
        return sorted(out, key=lambda n: n.node_id)

    async def cordon(self, node_id: str, on: bool = True) -> None:
        """No new placements on the node (``on``), or again (``on=False``)."""
        body = {"metadata": {"labels": {CORDON_LABEL: "true" if on else None}}}
        await asyncio.wait_for(self.api.patch_namespaced_lease(lease_name(node_id),
                                                               self.namespace, body),
                               CALL_TIMEOUT)


class LeaderElector:
    """One leader among the API processes (kubernetes_asyncio's Lease-based election)."""

    def __init__(self, api: ApiClient, namespace: str, identity: str,
                 name: str = LEADER_LEASE, lease_seconds: float = 15,
                 renew_deadline: float = 10, retry_period: float = 2) -> None:
        self.api = api
        self.namespace, self.name, self.identity = namespace, name, identity
        # (whole seconds: the Lease's leaseDurationSeconds is an integer; a float makes the
        # apiserver refuse the Lease, and the election would never be won)
        self.lease_seconds, self.renew_deadline = round(lease_seconds), renew_deadline
        self.retry_period = retry_period
        self.is_leader = False
        self.leading_since: float | None = None
        self._lead: asyncio.Task[Any] | None = None

    async def run(self, lead: Callable[[], Awaitable[None]]) -> None:
        """Stand for election until cancelled: while this process leads, ``lead()`` runs
        (cancelled when the lead is lost, then it stands again). Cancelled: the Lease is
        released if held, so that another takes over without waiting for it to expire."""
        try:
            while True:
                lock = LeaseLock(self.name, self.namespace, self.identity, self.api)

                async def started() -> None:
                    self.is_leader, self.leading_since = True, time.monotonic()
                    self._lead = asyncio.current_task()
                    log.info("%s leads (%s)", self.identity, self.name)
                    await lead()

                async def stopped() -> None:
                    self.is_leader, self.leading_since = False, None
                    log.warning("%s lost the lead (%s)", self.identity, self.name)

                config = electionconfig.Config(lock, self.lease_seconds, self.renew_deadline,
                                               self.retry_period, started, stopped)
                await leaderelection.LeaderElection(config).run()
        finally:
            # (the election runs lead() as a task of its own, which it cancels only when
            # the lead is lost: here it is cancelled too)
            if self._lead is not None and not self._lead.done():
                self._lead.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(self._lead), CALL_TIMEOUT)
            if self.is_leader:
                self.is_leader = False
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.release())

    async def release(self) -> None:
        """Give the Lease up if this process holds it (an update with the resourceVersion
        read: a Lease someone else took meanwhile is left alone)."""
        api = client.CoordinationV1Api(self.api)
        lease = await asyncio.wait_for(api.read_namespaced_lease(self.name, self.namespace),
                                       CALL_TIMEOUT)
        if lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        lease.spec = client.V1LeaseSpec(lease_duration_seconds=1)  # (no holder)
        await asyncio.wait_for(api.replace_namespaced_lease(self.name, self.namespace, lease),
                               CALL_TIMEOUT)
        log.info("%s released %s", self.identity, self.name)

    async def holder(self) -> str | None:
        api = client.CoordinationV1Api(self.api)
        try:
            lease = await asyncio.wait_for(api.read_namespaced_lease(self.name,
                                                                     self.namespace),
                                           CALL_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return (lease.spec.holder_identity if lease.spec else None) or None


async def connect(kubeconfig: str | None = None) -> ApiClient:
    """An API client: the Pod's ServiceAccount inside Kubernetes, else ``kubeconfig`` (or
    $KUBECONFIG, ~/.kube/config)."""
    from kubernetes_asyncio import config

    if kubeconfig is None:
        # in a Pod (the client reads KUBERNETES_SERVICE_HOST/PORT and the ServiceAccount's
        # files itself: not cpuos's configuration); elsewhere it says so
        cfg = client.Configuration()
        try:
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=cfg)
        except config.ConfigException:
            pass
        else:
            return ApiClient(configuration=cfg)
    made: ApiClient = await config.new_client_from_config(config_file=kubeconfig)
    return made
