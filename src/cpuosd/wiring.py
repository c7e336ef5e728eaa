"""The composition root: what the daemon is made of, built in one place, in order.

``build_services(cfg)`` makes and starts the store, the event bus, the audit log, the usage
meter and spending-cap enforcer, the backend (``CPUOS_BACKEND``, wrapped for the audit's
runtime monitoring and the network), the network, the lifecycle manager, the template
builds and the preview proxy; ``Services.close()`` stops them again. The HTTP app
(``cpuosd.api.app.create_app``) only serves them: its routes reach them through
``cpuosd.api.deps``.

Many hosts (docs/DEPLOY.md): ``--role=node`` is the same daemon with its node id resolved
and checked (``node_config``), its rows marked with it, a shared snapshot store if one is
configured, and its registration and heartbeat (``cpuosd.cluster.nodes.start_node``);
``--role=api`` builds only a store and a forwarder to the nodes (``build_api_services``,
served by ``cpuosd.cluster.api.create_api_app``).

A test hands in what it wants instead (``backend=``, ``network=``, ``store=``,
``measure=``): e.g. a backend that runs the real agent as a local process
(tests/support/local.py), then drives the real app in process. What is handed in stays
the caller's (``close`` leaves the store and the network open), except that the manager
closes its backend when it shuts down, as it always does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from functools import partial
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import homedir
from .accounting.audit import AuditLog
from .accounting.quotas import Measure
from .accounting.trace import Traced
from .accounting.usage import Enforcer, Meter
from .api.audit import start_audit
from .api.templates import TemplateBuilds
from .backends.base import Backend
from .backends.microvm.selection import select_backend
from .config import Config
from .events import EventBus, SandboxEvent, log_event
from .lifecycle.manager import Manager
from .network.backend import Networked
from .network.secrets import SealedBackend, Sealer, SecretKeyError, SecretStore, load_keys
from .network.secrets import unused as unused_secrets
from .network.service import Network, RecordWriter
from .procs import become_subreaper
from .network.preview import Preview
from .snapstore import SnapshotStore, open_snapshot_store
from .store import Store, open_store
from .lifecycle.states import ENDED, State

if TYPE_CHECKING:
    from .cluster.api import Forwarder
    from .cluster.nodes import NodeRuntime
    from .cluster.preview import PreviewRelay

log = logging.getLogger("cpuosd.api")


@dataclass
class Services:
    """The daemon's parts, running. ``backend`` is the manager's (as wrapped)."""

    cfg: Config
    store: Store
    events: EventBus
    audit: AuditLog
    meter: Meter
    enforcer: Enforcer
    backend: Backend
    network: Network | None
    manager: Manager
    builds: TemplateBuilds
    preview: Preview
    node: NodeRuntime | None = None  # --role=node: its registration and heartbeat
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack,
                                              repr=False)

    async def close(self) -> None:
        """Stop what ``build_services`` started, last made first."""
        await self._stack.aclose()


def bootstrap(cfg: Config, store: Store) -> None:
    """First start: a default workspace and an admin key at $CPUOS_HOME/admin.key (0600).
    With CPUOS_ADMIN_KEY (a deployment's Secret) that key instead, and only into a
    database whose admin workspace has no key yet: nodes starting later add none (nor
    write admin.key), and a key revoked since is not brought back.

    One bootstrap at a time among all processes sharing the store (``Store.serialized``:
    nodes starting together on an empty database make one ``default`` workspace); again
    on the same home it adds nothing. Without CPUOS_ADMIN_KEY each node's home gets an
    admin key of its own, of that one workspace."""
    if cfg.cluster.admin_key:
        _bootstrap_given_key(store, cfg.cluster.admin_key)
        return
    with store.serialized("bootstrap"):
        if cfg.admin_key_path.exists() and store.workspace_by_name("default"):
            return
        key = store.add_key(_admin_workspace(store), "admin")
    # (written once the key is in: a failed commit leaves no file naming a key that is not)
    fd = os.open(cfg.admin_key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(cfg.admin_key_path, 0o600)


def _admin_workspace(store: Store) -> str:
    """The admin workspace (``default``), made if there is none (in a serialized block)."""
    return store.workspace_by_name("default") or store.create_workspace("default")


def _bootstrap_given_key(store: Store, key: str) -> None:
    with store.serialized("bootstrap"):
        wid = _admin_workspace(store)
        if store.list_keys(wid):  # (not an empty database: its keys stay as they are)
            if store.key_lookup(key) is None:
                log.warning("CPUOS_ADMIN_KEY is not a live key of the admin workspace "
                            "(revoked, or the database was set up with another key): not "
                            "added")
            return
        store.add_key(wid, "admin", key=key)
    log.info("the admin workspace's key is CPUOS_ADMIN_KEY")


def node_config(cfg: Config) -> Config:
    """``cfg`` for ``--role=node``: its node id resolved (CPUOS_NODE_ID, else the host's
    name; a DNS label) and its node token checked. ValueError says what is wrong."""
    from .cluster.nodes import check_token, node_id_of

    check_token(cfg.cluster.node_token, "node")
    nid = node_id_of(cfg)
    return cfg if nid == cfg.cluster.node_id else cfg.replace(
        cluster=replace(cfg.cluster, node_id=nid))


def snapshot_store(cfg: Config) -> SnapshotStore | None:
    """A node's snapshot store shared with the other nodes (CPUOS_SNAPSHOT_STORE): a pause
    goes there and any node resumes it (cpuosd.lifecycle.snapshots); None: snapshots stay
    on this host (one host, or a node without one)."""
    if cfg.cluster.role != "node" or not cfg.cluster.snapshot_store:
        return None
    return open_snapshot_store(cfg.snapshots_dir, cfg.cluster.snapshot_store, cfg.cluster)


def secret_store(cfg: Config, store: Store) -> SecretStore:
    """Where sandboxes' secret values and CA keys are kept (cpuosd.network.secrets): files
    under $CPUOS_HOME/secrets on one host (SQLite); with Postgres the shared database's
    ``secrets`` table, sealed under CPUOS_SECRETS_KEY_FILE, so that they follow a sandbox
    to any node. Postgres without that key: the node starts but refuses creates with
    secrets (503, naming the variable); a key file that is not one: the start fails."""
    root = cfg.home / "secrets"
    if store.dialect != "postgres":
        return SecretStore(root)
    sealer = None
    path = cfg.cluster.secrets_key_file
    if path is None:
        log.warning("CPUOS_DATABASE_URL without CPUOS_SECRETS_KEY_FILE: this node refuses "
                    "sandboxes with secrets, and puts no secret into requests of those "
                    "resumed here")
    else:
        try:
            sealer = Sealer(load_keys(path))
        except SecretKeyError as e:
            log.error("%s", e)
            raise
    backend = SealedBackend(store, sealer)
    if sealer is not None:
        n = backend.rewrap()
        if n:
            log.info("sealed %d secret(s) again under the current key %s", n, sealer.current)
    return SecretStore(root, backend)


async def start_network(cfg: Config, backend: Backend, store: Store, events: EventBus
                        ) -> Network | None:
    """The daemon's network (per-sandbox namespaces, nftables, resolver, egress proxy) where
    it can run: the gVisor or microVM backend, nft installed, CPUOS_NETWORK not 0."""
    if not cfg.network.enabled:
        log.info("network: off (CPUOS_NETWORK=0): sandboxes have no network")
        return None
    if backend.capabilities.name not in ("gvisor", "microvm"):
        log.warning("network: not yet for the %s backend: its sandboxes have no network",
                    backend.capabilities.name)
        return None
    if shutil.which("nft") is None:
        log.warning("network: nft is not installed (apt-get install nftables): sandboxes "
                    "have no network")
        return None

    records = RecordWriter(store, events)
    net = Network(records.put, cfg.home / "secrets", cfg.network, secret_store(cfg, store))
    net.records = records

    def forget_secrets(ev: SandboxEvent) -> None:
        # a sandbox's secrets and CA go when it ends, unless a fork of it still uses them
        # (many hosts: the shared database's rows, any node's sandboxes counted)
        if ev.kind not in ENDED:
            return
        gone = unused_secrets(store, [ev.sandbox])
        if gone:
            net.secrets.forget(gone)

    events.subscribe(forget_secrets)
    await net.start()
    return net


async def stop_for_cap(mgr: Manager, workspace_id: str, sid: str) -> str:
    """What a sandbox of a workspace at its spending cap gets: paused where the backend
    can checkpoint (it costs only its snapshot's storage), else killed."""
    if mgr.backend.capabilities.checkpoint:
        await mgr.snapshots.pause(workspace_id, sid, reason="spending_cap")
        return State.PAUSED
    await mgr.kill(sid, reason="spending_cap")
    return State.KILLED


def preview_port(cfg: Config) -> int:
    """The preview listener's port: CPUOS_PREVIEW_PORT, default the API's port + 1."""
    return cfg.port + 1 if cfg.preview.port < 0 else cfg.preview.port


async def _timed(what: str, fn: Callable[..., Any], *args: Any) -> None:
    """One step of a stop, said when it takes a second or more (a slow stop says where its
    time went)."""
    t0 = time.monotonic()
    r = fn(*args)
    if inspect.isawaitable(r):
        await r
    if (took := time.monotonic() - t0) >= 1.0:
        log.warning("stop: %s took %.1f s", what, took)


async def _cancel(task: asyncio.Future[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def build_services(cfg: Config, *, backend: Backend | None = None,
                         network: Network | None = None, store: Store | None = None,
                         measure: Measure | None = None) -> Services:
    """Make and start the daemon's parts for ``cfg``. ``backend``: the one
    ``CPUOS_BACKEND`` selects unless given (``BackendUnavailable``, before any state is
    touched, if it cannot run here); ``network``: started as configured unless given;
    ``store``: the home's SQLite (CPUOS_DATABASE_URL: that Postgres) unless given;
    ``measure``: the host's measurement for admission. Whatever fails half-way, what was
    made is stopped again. ``cfg``'s role is ``all`` or ``node`` (``api``:
    ``build_api_services``)."""
    if cfg.cluster.role == "node":
        cfg = node_config(cfg)  # (a bad id or token: refused before anything is touched)
    elif cfg.cluster.role != "all":
        raise ValueError(f"role {cfg.cluster.role!r}: the daemon's services are --role=all "
                         "or --role=node (--role=api: build_api_services)")
    fixed = homedir.secure(cfg.home)  # 0700; files in it: no group/other bits
    if fixed:
        log.warning("took group/other permissions off %s", ", ".join(fixed))
    if backend is None:
        # a detached runsc leaves its sandbox and gofer to us, a jailer its QEMU
        if not become_subreaper():
            log.warning("could not become a child subreaper: pauses may be slow")
        backend = await asyncio.to_thread(select_backend, cfg)
    stack = contextlib.AsyncExitStack()
    try:
        if store is None:
            if cfg.cluster.role == "node" and not cfg.cluster.database_url:
                log.warning("--role=node without CPUOS_DATABASE_URL: this node's state is "
                            "its own SQLite, which no API process on another host can read")
            store = open_store(cfg.db_path, cfg.cluster.database_url,
                               cfg.cluster.database_pool)
            stack.callback(store.close)
        bootstrap(cfg, store)
        events = EventBus()
        events.subscribe(log_event)
        audit = start_audit(cfg, events, store)
        stack.push_async_callback(_timed, "the audit log", asyncio.to_thread, audit.close)
        if cfg.audit.enabled and cfg.audit.runtime and backend.capabilities.name == "gvisor":
            backend = Traced(backend, audit, cfg.sandboxes_dir)
        meter = Meter(store, cfg.pricing)
        events.subscribe(meter.on_event)
        if network is None:
            network = await start_network(cfg, backend, store, events)
            if network is not None:
                stack.push_async_callback(_timed, "the network", network.close)
        if network is not None:
            backend = Networked(backend, network, cfg.sandboxes_dir)
        mgr = Manager(cfg, store, backend, events, measure, snapstore=snapshot_store(cfg))
        stack.push_async_callback(_timed, "the manager", mgr.shutdown)
        builds = TemplateBuilds(cfg)
        stack.push_async_callback(_timed, "template builds", builds.shutdown)
        enforcer = Enforcer(store, meter, events, partial(stop_for_cap, mgr))
        mgr.admission.check_spending = enforcer.check_cap
        await mgr.startup()
        meter.reconcile()
        stack.push_async_callback(_timed, "the spending caps", enforcer.close)
        stack.push_async_callback(_cancel, asyncio.ensure_future(enforcer.run()))
        preview = Preview(mgr, network, preview_port(cfg), cfg.host, cfg.preview)
        await preview.start()
        stack.push_async_callback(_timed, "the preview proxy", preview.close)
        node = None
        if cfg.cluster.role == "node":  # registration and heartbeat (cpuosd.cluster.nodes)
            from .cluster.nodes import start_node

            node = await start_node(cfg, store, backend, mgr, preview_port=preview.port)
            stack.push_async_callback(_timed, "the node's registration", node.close)
    except BaseException:
        await stack.aclose()
        raise
    return Services(cfg=cfg, store=store, events=events, audit=audit, meter=meter,
                    enforcer=enforcer, backend=backend, network=network, manager=mgr,
                    builds=builds, preview=preview, node=node, _stack=stack)


@dataclass
class ApiServices:
    """``--role=api``: what an API process is made of (no sandboxes, no root): the shared
    state store and the forwarder to the nodes (``cpuosd.cluster.api``)."""

    cfg: Config
    store: Store
    forwarder: Forwarder
    preview: PreviewRelay  # the preview URLs of every node (cpuosd.cluster.preview)
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack,
                                              repr=False)

    async def close(self) -> None:
        await self._stack.aclose()


async def build_api_services(cfg: Config, *, store: Store | None = None) -> ApiServices:
    """Make and start an API process's parts for ``cfg`` (``--role=api``): the state store
    (``CPUOS_DATABASE_URL``, unless ``store`` is given: it stays the caller's) and the
    forwarder, which watches the nodes (and, with CPUOS_MEMBERSHIP=kubernetes, stands in the
    API processes' leader election), and the preview relay on the preview port."""
    from .cluster.api import Forwarder
    from .cluster.preview import PreviewRelay

    stack = contextlib.AsyncExitStack()
    try:
        if store is None:
            store = open_store(cfg.db_path, cfg.cluster.database_url,
                               cfg.cluster.database_pool)
            stack.callback(store.close)
        if cfg.cluster.admin_key:  # (whoever starts first on an empty database puts it in)
            await asyncio.to_thread(_bootstrap_given_key, store, cfg.cluster.admin_key)
        fwd = Forwarder(cfg, store)
        stack.push_async_callback(fwd.close)
        await fwd.start()
        preview = PreviewRelay(fwd, preview_port(cfg), cfg.host, cfg.preview)
        await preview.start()
        stack.push_async_callback(preview.close)
        if cfg.cluster.snapshot_store and cfg.cluster.snapshot_sweep_after > 0:
            from .cluster.sweep import Sweeper

            sweeper = Sweeper(store, open_snapshot_store(
                cfg.snapshots_dir, cfg.cluster.snapshot_store, cfg.cluster),
                cfg.cluster.snapshot_sweep_after, lambda: fwd.leading)
            stack.push_async_callback(_cancel, asyncio.ensure_future(sweeper.run()))
    except BaseException:
        await stack.aclose()
        raise
    return ApiServices(cfg=cfg, store=store, forwarder=fwd, preview=preview, _stack=stack)
