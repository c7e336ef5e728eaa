"""The sandbox lifecycle's one writer: create, kill and every state change
(lifecycle.states), each written to SQLite before it is acted on and published as an event.

This module holds the lifecycle itself (create, boot, kill, the state writer) and what
its collaborators share; each concern is a collaborator in a module of its own, held as an
attribute and given its dependencies (the store, config values, the Manager's operations as
callables; lifecycle.common) rather than the Manager: ``snapshots`` (pause, resume, fork),
``autopause`` (lifecycle.wake: auto-pause on idle, wake on a call), ``session``
(lifecycle.exec_files: exec, files), ``images`` and ``pool`` (lifecycle.template_images:
template snapshots, the warm pool), ``reconcile`` (a restart; an agent that hung up),
``deadlines``. The API calls them there (``mgr.snapshots.pause``, ``mgr.session.exec_start``);
what spans two of them (``forget_template``, ``placement_facts``) stays here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import shutil
import time
from dataclasses import replace
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import cpuos_agent
from cpuos_agent import messages as M
from cpuos_agent import protocol as P
from cpuos_agent.protocol import Kind

from .. import procs
from ..browser import Targets
from ..agentconn import AgentChannel, TransportError, raise_for_agent_error
from ..backends.base import Backend, SandboxSpec
from ..config import Config
from ..errors import ApiError, not_found
from ..events import EventBus, SandboxEvent
from ..paths import check_id
from ..store import LIVE_STATES, RowSpec, SandboxRow, Store
from ..accounting.quotas import Admission, HostMeter, Measure
from ..network.policy import Policy
from ..templates.builder import template_info
from ..snapstore import SnapshotStore
from . import memwatch, states
from .common import (KILL_LOCK_WAIT, KILL_RETRY_INTERVAL, RECONNECT_GRACE, Live,
                     _now)
from .commands import ExecStdin
from .deadlines import Deadlines
from .idle import IdleWatch
from .wake import AutoPause, idle_timeout_of
from .template_images import TemplateImages, WarmPool, start_command
from .reconcile import Reconcile
from .exec_files import Session
from .snapshots import Snapshots
from .states import State

log = logging.getLogger("cpuosd.lifecycle")

MAX_SNAPSHOTS_LISTED = 500  # paused sandboxes a heartbeat names (placement's preference)

__all__ = ["Live", "Manager"]


class Manager:
    def __init__(self, cfg: Config, store: Store, backend: Backend,
                 events: EventBus | None = None, measure: Measure | None = None,
                 snapstore: SnapshotStore | None = None) -> None:
        self.cfg = cfg
        # s a kill waits for a teardown (as shutdown does for what is under way)
        self.kill_timeout = cfg.sandbox.kill_timeout
        self.store = store
        # the node this daemon is (--role=node): its rows carry it, and what it reconciles,
        # reaps or prunes is only its own; None on one host (--role=all): every row
        self.node_id = cfg.cluster.node_id if cfg.cluster.role == "node" else None
        # a node's snapshot store shared with the other nodes (CPUOS_SNAPSHOT_STORE,
        # wiring.snapshot_store): a pause uploads there and the row is left on no node, so
        # any node resumes it (cpuosd.lifecycle.snapshots); None: snapshots stay on this
        # host (one host)
        self.snapstore = snapstore if self.node_id is not None else None
        self.backend = backend
        self.events = events or EventBus()
        # admission by what the host really uses (accounting.quotas): ``measure`` stands in
        # for the host's measurement in tests
        # (disk: where writable layers grow; a pause checks its snapshot's room itself)
        self.host_meter = HostMeter([cfg.sandboxes_dir], ours=lambda: list(self.live),
                                    limits=cfg.limits)
        self.admission = Admission(store, measure or self.host_meter.measure,
                                   limits=cfg.limits)
        self.live: dict[str, Live] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # what a pause leaves of a sandbox on the host (its stopped runsc container, its
        # directory), removed after the pause has answered; a boot of the id waits for it
        self._teardowns: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # creates in progress (cancelled by a DELETE of their sandbox)
        self._inflight: dict[str, asyncio.Task[Any] | None] = {}
        # pause, resume and fork (lifecycle.snapshots): a collaborator
        self.snapshots = Snapshots(
            cfg, store, backend, self.events, self.admission, self.node_id, self.snapstore,
            self._tasks, lock=self._lock, get=self.get, running=self.running,
            set_state=self._set_state, finish=self._finish, mark_running=self._mark_running,
            boot=self._boot, new_row=self._new_row, teardown=self._teardown,
            teardown_later=self._teardown_later, save_agent_key=self._save_agent_key,
            kill=self.kill)
        # idleness (lifecycle.idle): the watch, and what holds a sandbox in use besides its
        # agent streams (preview connections); the auto-pause and the wake (lifecycle.wake)
        self.idle = IdleWatch(backend.cpu_seconds, self._in_use, cfg.idle.cpu)
        self.connections: collections.Counter[str] = collections.Counter()
        self.autopause = AutoPause(
            self.idle, self.live, store, self.events, cfg.idle.pause_parallel,
            in_use=self._in_use, tick=self._tick, spawn=self._spawn, lock=self._lock,
            get=self.get, pause_locked=self.snapshots.pause_locked,
            resume_locked=self.snapshots.resume_row)
        # the stdin streams of foreground execs (lifecycle.commands), and the page each
        # sandbox's browser helpers drove last (cpuosd.browser)
        self.exec_stdin = ExecStdin()
        self.browser_targets = Targets()
        # exec and files on a live sandbox (lifecycle.exec_files): a collaborator
        self.session = Session(store, self.events, self.exec_stdin,
                               cfg.sandbox.max_read_bytes, self._spawn)
        # wall-clock deadlines (lifecycle.deadlines): a collaborator
        self.deadlines = Deadlines(store, cfg.sandbox.reaper_interval, self.node_id,
                                   self._spawn, self.snapshots.pause, self.kill)
        self.events.subscribe(self.autopause.on_event)
        self.agent_dir = self._install_agent()
        # template snapshots and the warm pool (lifecycle.template_images): collaborators
        self.images = TemplateImages(cfg, backend, self.agent_dir, lock=self._lock,
                                     boot=self._boot, teardown=self._teardown,
                                     quiesce=self.snapshots.quiesce,
                                     save_agent_key=self._save_agent_key)
        self.pool = WarmPool(cfg, store, self.admission, image=self.images.ensure,
                             new_row=self._new_row, boot=self._boot, finish=self._finish,
                             kill=self.kill, spawn=self._spawn)
        # after a restart, SQLite and the host agree (lifecycle.reconcile): a collaborator
        self.reconcile = Reconcile(
            cfg, store, backend, self.node_id, self.live, self.agent_dir, spec=self._spec,
            spawn=self._spawn, kill=self.kill, set_state=self._set_state,
            finish=self._finish, watch_memory=self._watch_memory,
            watch_idle=lambda row: self.idle.arm(row.id, idle_timeout_of(row)),
            template_image_name=self.images.name)
        cfg.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        # agent sockets live below: no other host user may reach (and impersonate) an agent
        cfg.sandboxes_dir.chmod(0o700)

    def _install_agent(self) -> Path:
        """Copy the agent package to $CPUOS_HOME/agent/<hash>/ (mounted read-only in sandboxes)."""
        src = Path(cpuos_agent.__file__).parent
        files = sorted(p for p in src.glob("*.py"))
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        dest = self.cfg.home / "agent" / h.hexdigest()[:16]
        if not (dest / "cpuos_agent" / "agent.py").exists():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "cpuos_agent").mkdir(parents=True)
            for f in files:
                shutil.copy2(f, tmp / "cpuos_agent" / f.name)
                os.chmod(tmp / "cpuos_agent" / f.name, 0o644)
            # mounted into sandboxes, where the agent and the kernel read it as the
            # sandbox's user: readable whatever the daemon's umask (cpuosd.homedir)
            os.chmod(tmp / "cpuos_agent", 0o755)
            os.chmod(tmp, 0o755)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        return dest

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    def _in_use(self, sid: str) -> bool:
        """Is anything open to sid: a preview connection (``using``), an agent stream?"""
        lv = self.live.get(sid)
        return bool(self.connections.get(sid)) or (lv is not None and bool(lv.chan.streams))

    def _tick(self) -> None:
        """What the daemon's one tick (lifecycle.wake) does besides the auto-pause: a
        sample of the sandboxes' CPU for admission (two cgroup reads), the warm pool's
        size."""
        self.host_meter.sample_cpu()
        self.pool.tick()

    @contextlib.contextmanager
    def using(self, sid: str) -> Iterator[None]:
        """sid is in use while this is open (a preview connection, a browser call): it is
        not idle."""
        self.connections[sid] += 1
        try:
            yield
        finally:
            self.connections[sid] -= 1
            if self.connections[sid] <= 0:
                del self.connections[sid]
            self.idle.touch(sid)

    @property
    def default_network(self) -> dict[str, Any]:
        return Policy.parse(self.cfg.network.default_policy).to_json()

    async def _apply_network(self, lv: Live) -> None:
        """The sandbox's policy to its backend (a backend without networking ignores it)."""
        setter = getattr(self.backend, "set_network", None)
        if setter is not None and lv.spec.network is not None:
            had = lv.spec.ca_pem
            await setter(lv.row.id, lv.spec.network)
            if self.backend.capabilities.guest_net and lv.spec.ca_pem != had:
                # a VM's guest takes its CA from the agent (e.g. a pooled one given secrets)
                h = await lv.chan.call({"t": Kind.IDENTITY, "ca": lv.spec.ca_pem}, timeout=30)
                raise_for_agent_error(h)

    async def set_network(self, workspace_id: str, sid: str, network: dict[str, Any]
                          ) -> SandboxRow:
        """A new egress policy: new connections of a running sandbox follow it at once; a
        paused one resumes with it."""
        async with self._lock(sid):
            row = self.get(workspace_id, sid)
            states.check("network", sid, row.state, row.reason)
            old = row.spec.network or {}
            if old.get("secrets"):  # a request changes mode and allowlist, not secrets
                network = {**network, "secrets": old["secrets"], "ca": old.get("ca")}
            lv = self.live.get(sid)
            if lv is not None:  # applied first: the record never says more than is so
                lv.spec.network = network
                try:
                    await self._apply_network(lv)
                except BaseException:
                    lv.spec.network = old or None
                    raise
                lv.row.spec = replace(lv.row.spec, network=network)
            row.spec = replace(row.spec, network=network)
            self.store.update_sandbox(sid, spec=row.spec)
            self.events.emit(SandboxEvent("network", sid, row.workspace_id, row.state,
                                          fields={"network": network}))
        return self.get(workspace_id, sid)

    async def forget_template(self, template: str) -> int:
        """A template is being removed: end its pooled sandboxes and delete its snapshot
        images (sandboxes users hold are the caller's concern). Returns how many images."""
        async with self._lock("template:" + template):
            await self.pool.forget(template)
            return await self.images.forget(template)

    def placement_facts(self) -> dict[str, Any]:
        """What a node holds that placement prefers it for (cpuosd.cluster.nodes.place),
        read by its heartbeat (a thread: only copies of the loop's dicts are walked): the
        templates with a warm pool sandbox ready (``pools``), those whose template
        checkpoint is made here for their current build (``template_images``), and the
        paused sandboxes whose image is on this node's disk (``snapshots``)."""
        pools = sorted(t for t, ready in list(self.pool.ready.items()) if ready)
        snaps = sorted(r.id for r in self.store.list_sandboxes(None, (State.PAUSED,),
                                                               node_id=self.node_id)
                       if r.node_id is not None)[:MAX_SNAPSHOTS_LISTED]
        return {"pools": pools, "template_images": self.images.made(), "snapshots": snaps}

    def _spec(self, row: SandboxRow) -> SandboxSpec:
        s = row.spec
        return SandboxSpec(id=row.id, rootfs=Path(s.rootfs), dir=self.cfg.sandboxes_dir / row.id,
                           agent_dir=self.agent_dir, vcpus=s.vcpus, memory_mib=s.memory_mib,
                           pids=s.pids, disk_mib=s.disk_mib,
                           network=s.network,
                           hostname=s.hostname, env=s.env)

    async def startup(self) -> None:
        self.cfg.snapshots_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.snapshots_dir.chmod(0o700)
        await self.reconcile.run()
        if self.cfg.shared_template_images:  # (a daemon's own: Reconcile prunes it)
            await self.images.prune()
        self._spawn(self.deadlines.run())
        self._spawn(self.autopause.run())
        self._spawn(procs.reap_loop())  # the runsc/QEMU processes we adopted
        for template in self.cfg.pool.templates if self.cfg.pool.size > 0 else []:
            if template_info(self.cfg.templates_dir, template):
                self.pool.want(template)

    async def shutdown(self) -> None:
        async def wait(what: str, tasks: list[asyncio.Task[Any]]) -> None:
            """Each step's wait is bounded; one that takes a second or more is said (with
            what it still waits for), so that a slow stop says where its time went."""
            if not tasks:
                return
            t0 = time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=self.kill_timeout)
            took = time.monotonic() - t0
            if took >= 1.0:
                log.warning("shutdown: %d %s took %.1f s%s", len(tasks), what, took,
                            f"; {len(pending)} not done: " + ", ".join(
                                t.get_name() for t in pending) if pending else "")

        # no refill of the warm pool starts from here on (a create taking a pooled sandbox,
        # a refill ending, the tick would start one that no step below would end)
        self.pool.close()
        # auto-pauses under way finish (bounded): a sandbox is not lost to them
        await wait("auto-pauses", list(self.autopause.pausing.values()))
        # what pauses left behind them (stopped containers)
        await wait("teardowns after pauses", list(self._teardowns.values()))
        background = list(self._tasks)
        for t in background:
            t.cancel()
        # a template snapshot or pool fill under way tears its sandbox down
        await wait("background tasks", background)
        # creates still in progress are cancelled and clean up after themselves (their rows
        # end in error): a stopping daemon leaves nothing half-made
        creating = [t for t in self._inflight.values() if t is not None and not t.done()]
        for t in creating:
            t.cancel()
        await wait("creates under way", creating)
        t0 = time.monotonic()
        pooled = 0
        # pooled sandboxes belong to no one: end them, those in the pool's lists and any other
        # pooled row of this node's still live (a refill whose teardown did not end within
        # its bound: its row is still pooled, its sandbox may run)
        for pool in self.pool.ready.values():
            pool.clear()
        for row in self.store.list_sandboxes(None, (State.POOLED,), node_id=self.node_id):
            if row.id in self.live:
                pooled += 1
                await self.kill(row.id, reason="pool_discarded")
        if time.monotonic() - t0 >= 1.0:
            log.warning("shutdown: killing %d pooled sandboxes took %.1f s", pooled,
                        time.monotonic() - t0)
        for lv in list(self.live.values()):
            await lv.chan.close()  # sandboxes keep running; a restarted daemon reattaches
        self.images.close()
        await self.backend.close()

    def _new_row(self, workspace_id: str, template: str, info: dict[str, Any], timeout: float,
                 metadata: dict[str, str], env: dict[str, str], vcpus: int, memory_mib: int,
                 state: State = State.CREATING, on_timeout: str = "kill",
                 network: dict[str, Any] | None = None, pids: int | None = None,
                 disk_mib: int | None = None, idle_timeout: float = 0.0) -> SandboxRow:
        sid = "sbx-" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                               for _ in range(12))
        now = _now()
        row = SandboxRow(
            id=sid, workspace_id=workspace_id, template=template,
            backend=self.backend.capabilities.name, state=state, reason=None,
            created_at=now, started_at=None, ended_at=None, deadline=now + timeout,
            spec=RowSpec(rootfs=info["rootfs"], template_digest=info["digest"], vcpus=vcpus,
                         memory_mib=memory_mib, pids=pids or self.cfg.sandbox.default_pids,
                         disk_mib=disk_mib or self.cfg.sandbox.default_disk_mib,
                         hostname="sandbox", env=env,
                         timeout=timeout, machine_id=secrets.token_hex(16),
                         template_env=info.get("env") or {}, workdir=info.get("workdir"),
                         network=network or self.default_network, idle_timeout=idle_timeout),
            metadata=metadata, on_timeout=on_timeout, node_id=self.node_id,
        )
        self.store.insert_sandbox(row)
        return row

    async def _boot(self, row: SandboxRow, image: Path | None, *,
                    template_boot: bool = False, resume: bool = False) -> Live:
        """Start (image None) or restore a sandbox for row; returns it with its agent
        connected and told who it is (``resume``: its own pause image, on a backend whose
        sandboxes take the time and randomness from the host (gVisor): nothing in its
        identity changed, none is sent). On failure everything made for it is removed and
        the error raised."""
        await self._settle_teardown(row.id)  # (a pause's, of the same id: its directory)
        spec = self._spec(row)
        key = self._agent_key(row, image)
        chan = AgentChannel(spec.sock_path, key, self.cfg.sandbox.agent_liveness)
        spec.template_boot, spec.adopt = template_boot, chan.adopt
        lv = Live(row, spec, chan)
        self.live[row.id] = lv
        try:
            spec.sock_dir.mkdir(parents=True, exist_ok=True)
            # the sandbox's /run/cpuos (gVisor), bound into the microVM jail for QEMU (an
            # unprivileged uid) to reach agent.sock: 0755 whatever the daemon's umask
            spec.sock_dir.chmod(0o755)
            # Per sandbox, also after a restore: templates link /etc/machine-id here.
            if not row.spec.machine_id:
                row.spec = replace(row.spec, machine_id=secrets.token_hex(16))
            mid = row.spec.machine_id
            (spec.sock_dir / "machine-id").write_text(mid + "\n")
            (spec.sock_dir / "machine-id").chmod(0o444)
            key_file = spec.sock_dir / P.KEY_PATH.rsplit("/", 1)[1]
            if key is not None and image is None:
                # read once by the agent at start; removed at its hello, before any command
                fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o444)
                os.fchmod(fd, 0o444)  # (whatever the daemon's umask)
                with os.fdopen(fd, "w") as f:
                    f.write(key)
            await chan.listen()
            t0 = time.monotonic()
            if image is None:
                await self.backend.start(spec)
            else:
                await self.backend.restore(spec, image)
            t1 = time.monotonic()
            await chan.wait_connected(self.cfg.sandbox.agent_connect_timeout)
            key_file.unlink(missing_ok=True)
            t2 = time.monotonic()
            if not resume or self.backend.capabilities.guest_net:
                await self._identity(lv)
            self._spawn(self._watch_memory(lv))  # off the critical path (the agent looks
            # for itself until the host's watch is there)
            log.info("%s of %s: backend %.0f ms, agent hello %.0f ms, identity %.0f ms",
                     "boot" if image is None else "restore", row.id, (t1 - t0) * 1e3,
                     (t2 - t1) * 1e3, (time.monotonic() - t2) * 1e3)
        except BaseException:
            await self._teardown(row.id)
            raise
        chan.on_disconnect.append(lambda: self.reconcile.on_disconnect(row.id))
        return lv

    def _agent_key(self, row: SandboxRow, image: Path | None) -> str | None:
        """The key the sandbox's agent holds: a new one for a cold boot, the image's for a
        restore (written beside it at checkpoint); kept in the row for reattaching."""
        if not self.backend.capabilities.agent_key:
            return None
        key: str | None = None
        if image is not None:
            with contextlib.suppress(OSError):
                key = (image / "agent.key").read_text().strip()
        key = key or row.spec.agent_key or secrets.token_hex(32)
        row.spec = replace(row.spec, agent_key=key)
        return key

    @staticmethod
    def _save_agent_key(lv: Live, image_dir: Path) -> None:
        key = lv.row.spec.agent_key
        if key:
            fd = os.open(image_dir / "agent.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key)

    async def _identity(self, lv: Live) -> None:
        """New for every boot, restore and clone: hostname (the sandbox id), machine-id,
        randomness for the guest's RNG, the time, for a VM its network address
        (cpuos_agent.agent.apply_identity), and the memory limit the agent's OOM killer
        holds the sandbox to (gVisor: cpuos_agent.memguard)."""
        msg = M.Identity(t=Kind.IDENTITY, hostname=lv.row.id,
                         machine_id=lv.row.spec.machine_id,
                         seed=secrets.token_hex(64), time=time.time(),
                         memory_limit=int(lv.row.spec.memory_mib) << 20,
                         spawner_idle_exit=self.cfg.sandbox.spawner_idle_exit)
        if self.backend.capabilities.guest_net and lv.spec.address and lv.spec.gateway:
            # a VM's interface: every restore and clone has an address of its own
            msg["net"] = {"address": lv.spec.address, "gateway": lv.spec.gateway,
                          "prefix": lv.spec.prefix}
        if self.backend.capabilities.guest_net and lv.spec.ca_pem:
            msg["ca"] = lv.spec.ca_pem
        h = await lv.chan.call(msg, timeout=30)
        raise_for_agent_error(h)
        log.debug("identity of %s: %s", lv.row.id, h.get("applied"))

    def _mark_running(self, row: SandboxRow, timeout: float) -> None:
        started = _now()
        row.deadline = started + timeout
        row.started_at = row.started_at or started
        self._set_state(row.id, State.RUNNING, started_at=row.started_at,
                        deadline=row.deadline, workspace_id=row.workspace_id,
                        spec=row.spec, metadata=row.metadata, on_timeout=row.on_timeout,
                        reason=None)
        row.state, row.reason = State.RUNNING, None

    async def create(self, workspace_id: str, template: str, timeout: float,
                     metadata: dict[str, str], env: dict[str, str], vcpus: int,
                     memory_mib: int, on_timeout: str = "kill",
                     network: dict[str, Any] | None = None, pids: int | None = None,
                     disk_mib: int | None = None, idle_timeout: float = 0.0) -> SandboxRow:
        """``idle_timeout``: seconds without activity before it is paused (0: never;
        lifecycle.idle)."""
        network = network or self.default_network
        pids = pids or self.cfg.sandbox.default_pids
        disk_mib = disk_mib or self.cfg.sandbox.default_disk_mib
        info = template_info(self.cfg.templates_dir, template)
        if info is None:
            raise ApiError("not_found", f"template {template!r} is not built; run "
                           f"`cpuos template build {template}` on the daemon's host",
                           {"template": template})
        # the template's image and the pool are of the default size (a checkpoint carries
        # its rlimits and its disk's size): another size boots
        default_size = (vcpus, memory_mib, pids, disk_mib) == (
            self.cfg.sandbox.default_vcpus, self.cfg.sandbox.default_memory_mib,
            self.cfg.sandbox.default_pids,
            self.cfg.sandbox.default_disk_mib)
        pooled = default_size and self.pool.on(template)
        ready = pooled and bool(self.pool.ready.get(template))
        wait = pooled and not ready and self.pool.can_wait(template)
        new_row = functools.partial(
            self._new_row, workspace_id, template, info, timeout, metadata, env, vcpus,
            memory_mib, on_timeout=on_timeout, network=network, pids=pids,
            disk_mib=disk_mib, idle_timeout=idle_timeout)
        row: SandboxRow | None = None
        # admission and the write that makes the sandbox the workspace's in one step of the
        # store (the workspace's lock where nodes share it): no await in between
        with self.admission.admitting(workspace_id, vcpus, memory_mib, pids=pids,
                                      disk_mib=disk_mib, reserve_host=not (ready or wait),
                                      pending=self.pool.claims.get(workspace_id, 0)):
            lv: Live | None = self.pool.take(template) if pooled else None
            if lv is not None and lv.spec.network == network:
                return self._hand_out(lv, workspace_id, metadata, on_timeout, env, timeout,
                                      network, idle_timeout)
            if lv is None and not wait:
                row = new_row()
        if lv is None and wait:
            # a refill under way is done sooner than a restore of our own would be
            lv = await self.pool.wait(template, workspace_id)
            if lv is None:  # it failed or took too long: our own, admitted as any
                with self.admission.admitting(workspace_id, vcpus, memory_mib, pids=pids,
                                              disk_mib=disk_mib):
                    row = new_row()
        if lv is not None:  # (awaited: admitted again as it is handed over)
            if lv.spec.network != network:  # pooled with the default policy
                lv.row.spec = replace(lv.row.spec, network=network)
                self.store.update_sandbox(lv.row.id, spec=lv.row.spec)  # (its secrets)
                lv.spec.network = network
                try:
                    await self._apply_network(lv)
                except BaseException:
                    await self.kill(lv.row.id, reason="network setup failed")
                    raise
            try:
                with self.admission.admitting(workspace_id, vcpus, memory_mib,
                                              reserve_host=False,
                                              pending=self.pool.claims.get(workspace_id, 0)):
                    return self._hand_out(lv, workspace_id, metadata, on_timeout, env,
                                          timeout, network, idle_timeout)
            except BaseException:  # (refused now: over a maximum another node reached)
                await self.kill(lv.row.id, reason="pool_discarded")
                raise
        assert row is not None
        # the row first: a create waiting for its template's snapshot is listed (creating)
        # and can be deleted
        async with self._lock(row.id):
            self._inflight[row.id] = asyncio.current_task()
            try:
                image = await self.images.ensure(template, info) if default_size else None
                await self._boot_or_fallback(row, image, info)
            except BaseException as e:
                await self._teardown(row.id)
                why = "cancelled (deleted while creating)" if isinstance(
                    e, asyncio.CancelledError) else str(e)
                self._finish(row.id, State.ERROR, f"create failed: {why}"[:500])
                raise
            finally:
                self._inflight.pop(row.id, None)
            self._mark_running(row, timeout)
        return row

    def _hand_out(self, lv: Live, workspace_id: str, metadata: dict[str, str],
                  on_timeout: str, env: dict[str, str], timeout: float,
                  network: dict[str, Any], idle_timeout: float) -> SandboxRow:
        """A pooled sandbox becomes the workspace's, running (its network set already)."""
        row = lv.row
        row.workspace_id, row.metadata, row.on_timeout = workspace_id, metadata, on_timeout
        row.spec = replace(row.spec, env=env, timeout=timeout, network=network,
                           idle_timeout=idle_timeout)
        lv.spec.env = env
        self._mark_running(row, timeout)
        return row

    async def _boot_or_fallback(self, row: SandboxRow, image: Path | None,
                                info: dict[str, Any]) -> Live:
        """Restore from image, retried once, then a cold boot (with the template's start
        command), before an error reaches the user."""
        if image is not None:
            for attempt in (1, 2):
                try:
                    return await self._boot(row, image)
                except (ApiError, TransportError) as e:
                    log.warning("restore of %s from %s failed (attempt %d): %s", row.id,
                                image.name, attempt, e.message)
            log.warning("sandbox %s: restores failed; booting it instead", row.id)
            row.spec = replace(row.spec, agent_key=None)  # a cold boot's agent: a key of its own
        lv = await self._boot(row, None)
        await start_command(lv, info)
        return lv

    def get(self, workspace_id: str, sid: str) -> SandboxRow:
        check_id(sid)
        row = self.store.get_sandbox(sid)
        if row is None or row.workspace_id != workspace_id or row.state == State.POOLED:
            raise not_found("sandbox", sid)
        return row

    def running(self, workspace_id: str, sid: str, op: str = "exec") -> Live:
        """The live sandbox, if its state accepts op (lifecycle.states.OPS), else 409."""
        row = self.get(workspace_id, sid)
        states.check(op, sid, row.state, row.reason)
        lv = self.live.get(sid)
        if lv is None:  # (running in the table but not attached here: being reattached)
            raise ApiError("conflict", f"sandbox {sid} is {row.state} but not attached yet",
                           {"state": row.state, "reason": row.reason, "operation": op})
        return lv

    async def ready(self, workspace_id: str, sid: str, op: str = "exec") -> Live:
        """A running sandbox whose agent is connected, for a call that needs the machine:
        one paused for idleness is resumed first (lifecycle.idle: once, whoever else waits
        for it); waits a little for one that is reconnecting (a restarted daemon: a
        microVM's QEMU redials once a second). The call counts as activity."""
        row = self.get(workspace_id, sid)
        if self.autopause.wakes(row):
            await self.autopause.wake(workspace_id, sid)
        lv = self.running(workspace_id, sid, op)
        self.idle.touch(sid)
        if not lv.chan.connected:
            with contextlib.suppress(TransportError):
                await lv.chan.wait_connected(RECONNECT_GRACE)
        return lv

    def set_idle_timeout(self, workspace_id: str, sid: str, idle_timeout: float
                         ) -> SandboxRow:
        """A new idle timeout (0: never), counted from now for a running sandbox."""
        row = self.get(workspace_id, sid)
        states.check("set_timeout", sid, row.state, row.reason)
        row.spec = replace(row.spec, idle_timeout=idle_timeout)
        self.store.update_sandbox(sid, spec=row.spec)
        lv = self.live.get(sid)
        if lv is not None:
            lv.row.spec = replace(lv.row.spec, idle_timeout=idle_timeout)
            if lv.row.state == State.RUNNING:
                self.idle.arm(sid, idle_timeout)
        return self.get(workspace_id, sid)

    def set_timeout(self, workspace_id: str, sid: str, timeout: float) -> SandboxRow:
        row = self.get(workspace_id, sid)
        states.check("set_timeout", sid, row.state, row.reason)
        if row.state == State.PAUSED:
            self.store.update_sandbox(sid, remaining=timeout)
            return self.get(workspace_id, sid)
        lv = self.running(workspace_id, sid, "set_timeout")
        deadline = _now() + timeout
        self.store.update_sandbox(sid, deadline=deadline)
        lv.row.deadline = deadline
        return self.get(workspace_id, sid)

    async def kill(self, sid: str, reason: str = "killed",
                   final_state: State = State.KILLED) -> None:
        """Returns within about KILL_LOCK_WAIT + the kill timeout (CPUOS_KILL_TIMEOUT) in
        every state: a create in progress is cancelled; an operation that holds the sandbox
        longer is not waited for; a teardown that overruns leaves the row in error with that
        reason."""
        # a create, an auto-pause or a wake under way is cancelled (each cleans up after
        # itself and lets go of the lock)
        for task in (self._inflight.get(sid), self.autopause.pausing.get(sid),
                     self.autopause.waking.get(sid)):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        lock = self._lock(sid)
        try:
            await asyncio.wait_for(lock.acquire(), KILL_LOCK_WAIT)
            locked = True
        except TimeoutError:
            locked = False
            log.warning("kill of %s: another operation holds it; killing anyway", sid)
        try:
            row = self.store.get_sandbox(sid)
            if row is None or row.state not in LIVE_STATES:
                return
            self._set_state(sid, State.KILLING, reason=reason)
            try:
                await asyncio.wait_for(self._teardown(sid), self.kill_timeout)
            except TimeoutError:
                log.error("kill of %s: teardown did not finish in %.0fs", sid, self.kill_timeout)
                self._finish(sid, State.ERROR, f"kill timed out after {self.kill_timeout:.0f}s")
                self._spawn(self._retry_teardown(sid))
                return
            shutil.rmtree(self.cfg.snapshots_dir / sid, ignore_errors=True)
            if self.snapstore is not None and row.state == State.PAUSED and row.node_id is None:
                try:  # (paused into the shared store: its image goes too)
                    await asyncio.wait_for(self.snapstore.delete(sid), self.kill_timeout)
                except Exception as e:
                    log.warning("kill of %s: its snapshot in the store stays: %s", sid, e)
            self._finish(sid, final_state, reason)
            if self.cfg.cluster.role == "node":  # its rows in the shared audit chain before
                await self.events.settle()  # it answers (another node may serve the reads)
        finally:
            if locked:
                lock.release()

    async def _retry_teardown(self, sid: str, attempts: int = 12) -> None:
        """A teardown that overran is tried again in the background (a restarted daemon's
        reconcile also ends any runsc sandbox without a live record)."""
        for _ in range(attempts):
            await asyncio.sleep(KILL_RETRY_INTERVAL)
            try:
                await asyncio.wait_for(self._teardown(sid), self.kill_timeout)
                log.info("kill of %s: teardown finished on a retry", sid)
                return
            except Exception as e:
                log.warning("kill of %s: retry failed: %s", sid, e)

    async def _teardown(self, sid: str) -> None:
        await self._settle_teardown(sid)
        lv = self.live.pop(sid, None)
        if lv is not None:
            if lv.mem is not None:
                lv.mem.close()
            await lv.chan.close()
        await self.backend.kill(sid)
        shutil.rmtree(self.cfg.sandboxes_dir / sid, ignore_errors=True)

    async def _watch_memory(self, lv: Live) -> None:
        """The host's watch on the sandbox's memory (cpuosd.lifecycle.memwatch), if it is
        still live by then."""
        if self.live.get(lv.row.id) is not lv or lv.mem is not None:
            return
        lv.mem = memwatch.start(lv.chan, lv.row.id, int(lv.row.spec.memory_mib),
                                self.backend)

    def _teardown_later(self, sid: str) -> None:
        """``_teardown`` for a sandbox that stopped at its checkpoint (a pause): it is no
        longer live from now on; deleting its stopped container and its directory goes on
        in the background, off the pause's critical path. ``_boot`` and ``_teardown`` of
        the same id wait for it."""
        lv = self.live.pop(sid, None)
        if lv is not None and lv.mem is not None:
            lv.mem.close()
            lv.mem = None

        async def rest() -> None:
            try:
                if lv is not None:
                    await lv.chan.close()
                await asyncio.wait_for(self.backend.kill(sid), self.kill_timeout)
                shutil.rmtree(self.cfg.sandboxes_dir / sid, ignore_errors=True)
            except Exception as e:  # a restarted daemon's reconcile ends what is left
                log.warning("teardown of %s after its checkpoint failed: %s", sid, e)
            finally:
                if self._teardowns.get(sid) is task:
                    del self._teardowns[sid]

        task = asyncio.get_running_loop().create_task(rest())
        self._teardowns[sid] = task

    async def _settle_teardown(self, sid: str) -> None:
        """Wait for a background teardown of sid (its errors are its own)."""
        t = self._teardowns.get(sid)
        if t is not None:
            await asyncio.wait([t])

    def _set_state(self, sid: str, to: State, **fields: Any) -> None:
        """The one way a sandbox changes state: checked against the table
        (lifecycle.states), written to SQLite before anything acts on it, published as an
        event."""
        row = self.store.get_sandbox(sid)
        frm = row.state if row is not None else None
        if frm is not None and frm != to:
            states.check_transition(frm, to)
        # compare-and-set from the state read (one daemon: it always holds; where several
        # processes share the store, the one that loses a race changes nothing)
        if frm is not None and not self.store.transition(sid, (frm,), to, **fields):
            now = self.store.get_sandbox(sid)
            raise ApiError("conflict", f"sandbox {sid} changed state meanwhile (now "
                           f"{now.state if now else 'gone'}); {frm} -> {to} not made",
                           {"state": now.state if now else None})
        if frm is None:
            self.store.update_sandbox(sid, state=to, **fields)
        lv = self.live.get(sid)
        if lv is not None:
            lv.row.state = to
        if row is not None and frm != to:
            self.events.emit(SandboxEvent(
                to, sid, str(fields.get("workspace_id") or row.workspace_id), frm,
                fields={k: v for k, v in fields.items()
                        if k in ("reason", "deadline", "remaining", "snapshot_bytes")}))

    def _finish(self, sid: str, state: State, reason: str) -> None:
        self._set_state(sid, state, reason=reason, ended_at=_now())
        self._locks.pop(sid, None)
