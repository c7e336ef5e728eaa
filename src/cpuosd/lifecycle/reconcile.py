"""After a (possibly unclean) restart: make SQLite and the host agree; reattach to
live sandboxes, and notice when one dies (an agent that dropped its connection and whose
sandbox is no longer running)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..agentconn import AgentChannel, TransportError
from ..backends.base import Backend, SandboxSpec
from ..config import Config
from ..store import LIVE_STATES, SandboxRow, Store
from ..templates.builder import list_templates
from .common import Finish, Kill, Live, SetState, Spawn, _du, _now
from .states import State

log = logging.getLogger("cpuosd.lifecycle")


class Reconcile:
    """The Manager's agreement with the host (``Manager.reconcile``), given what it uses:
    the store and the backend (the rows of ``node_id`` and what really runs), the Manager's
    ``live`` sandboxes (a reattached one is added), its agent copy (``agent_dir``: older
    copies are pruned), and the Manager's operations: ``spec`` (a row's SandboxSpec),
    ``spawn`` (a task the Manager owns), ``kill``, ``set_state`` and ``finish`` (the one
    writer of states), ``watch_memory`` (the host's OOM watch of a reconnected sandbox),
    ``watch_idle`` (a reattached running sandbox is watched for idleness) and
    ``template_image_name`` (which template images are current)."""

    def __init__(self, cfg: Config, store: Store, backend: Backend, node_id: str | None,
                 live: dict[str, Live], agent_dir: Path, *,
                 spec: Callable[[SandboxRow], SandboxSpec], spawn: Spawn, kill: Kill,
                 set_state: SetState, finish: Finish,
                 watch_memory: Callable[[Live], Awaitable[None]],
                 watch_idle: Callable[[SandboxRow], None],
                 template_image_name: Callable[[str, str], str]) -> None:
        self.cfg, self.store, self.backend, self.node_id = cfg, store, backend, node_id
        self.live, self.agent_dir = live, agent_dir
        self._spec, self._spawn, self._kill = spec, spawn, kill
        self._set_state, self._finish = set_state, finish
        self._watch_memory, self._watch_idle = watch_memory, watch_idle
        self._template_image_name = template_image_name

    async def run(self) -> None:
        """Make SQLite and the host agree after a (possibly unclean) restart."""
        actual = await self.backend.running()
        keep: set[str] = set()
        for row in self.store.list_sandboxes(states=LIVE_STATES, node_id=self.node_id):
            alive = actual.get(row.id) == "running"
            snap = self.cfg.snapshots_dir / row.id
            if alive and row.state in (State.RUNNING, State.PAUSING, State.RESUMING):
                # a pause that did not get to checkpoint, or a resume that did: running
                await self.reattach(row)
                keep.add(row.id)
                if row.state != State.RUNNING:
                    # a paused row has no deadline: it gets back the time it had left
                    deadline = row.deadline or _now() + float(
                        row.remaining or row.spec.timeout
                        or self.cfg.sandbox.default_timeout)
                    was = row.state
                    self._set_state(row.id, State.RUNNING, deadline=deadline)
                    log.info("sandbox %s was %s at restart: running", row.id, was)
                    row.state, row.deadline = State.RUNNING, deadline
                self._watch_idle(row)
                continue
            if alive:
                await self.backend.kill(row.id)
            has_snap = (snap / "checkpoint.img").exists()
            tmp = snap.with_name("." + snap.name + ".tmp")
            if row.state == State.PAUSING and not has_snap and (tmp / "checkpoint.img").exists() \
                    and (tmp / "checkpoint.img").stat().st_size > 0:
                # the daemon died after runsc wrote the image but before it was renamed
                os.rename(tmp, snap)
                has_snap = True
            if row.state in (State.PAUSED, State.PAUSING, State.RESUMING) and has_snap:
                if row.state != State.PAUSED:
                    left = row.remaining or max(1.0, (row.deadline or _now()) - _now())
                    self._set_state(row.id, State.PAUSED, paused_at=_now(),
                                    remaining=left, deadline=None,
                                    snapshot_bytes=_du(snap))
                continue
            reason = {State.RUNNING: "lost", State.PAUSED: "snapshot_lost",
                      State.POOLED: "pool_discarded",
                      State.KILLING: row.reason or "killed"}.get(row.state, "interrupted")
            self._finish(row.id, State.KILLED if row.state in (State.KILLING, State.POOLED)
                         else State.ERROR, reason)
        for cid in actual:
            if cid not in keep:
                log.warning("killing runsc sandbox %s that has no live record", cid)
                await self.backend.kill(cid)
        for d in self.cfg.sandboxes_dir.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
        paused = {r.id for r in self.store.list_sandboxes(states=(State.PAUSED,),
                                                          node_id=self.node_id)}
        for d in self.cfg.snapshots_dir.iterdir():
            if d.name != "templates" and d.name not in paused \
                    and d != self.cfg.template_images_dir:  # (CPUOS_TEMPLATE_IMAGES_DIR there)
                shutil.rmtree(d, ignore_errors=True)
        # template images of older builds or older agents are never restored again (in the
        # daemon's own directory; a shared one: TemplateImages.prune)
        current = {self._template_image_name(t["name"], t["digest"])
                   for t in list_templates(self.cfg.templates_dir)}
        tdir = self.cfg.template_images_dir
        for d in tdir.iterdir() if tdir.is_dir() and not self.cfg.shared_template_images else ():
            if d.name in current:
                continue
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
            else:  # (lock files: no daemon holds one here yet)
                d.unlink(missing_ok=True)
        self._prune_agents()

    def _prune_agents(self) -> None:
        """Agent copies other than the current one, once no live sandbox mounts them."""
        if self.store.list_sandboxes(states=LIVE_STATES, node_id=self.node_id):
            return  # a reattached or paused sandbox may still use an older copy
        for d in self.agent_dir.parent.iterdir():
            if d != self.agent_dir:
                shutil.rmtree(d, ignore_errors=True)

    async def reattach(self, row: SandboxRow) -> None:
        lv = Live(row, self._spec(row), AgentChannel(self._spec(row).sock_path,
                                                     row.spec.agent_key,
                                                     self.cfg.sandbox.agent_liveness))
        self.live[row.id] = lv
        await lv.chan.listen()
        lv.chan.on_disconnect.append(lambda sid=row.id: self.on_disconnect(sid))
        self._spawn(self._await_reattach(row.id))
        log.info("reattaching to sandbox %s", row.id)

    async def _await_reattach(self, sid: str) -> None:
        lv = self.live.get(sid)
        if lv is None:
            return
        try:
            await lv.chan.wait_connected(self.cfg.sandbox.agent_connect_timeout)
        except TransportError:
            log.warning("sandbox %s: agent did not reconnect; killing it", sid)
            await self._kill(sid, reason="lost", final_state=State.ERROR)
            return
        await self._watch_memory(lv)

    def on_disconnect(self, sid: str) -> None:
        """An agent channel's ``on_disconnect`` (a boot's or a reattach's)."""
        self._spawn(self._check_alive(sid))

    async def _check_alive(self, sid: str) -> None:
        """The agent dropped its connection: it reconnects unless the sandbox died."""
        await asyncio.sleep(2.0)
        lv = self.live.get(sid)
        if lv is None or lv.chan.connected or lv.row.state != State.RUNNING:
            return
        row = self.store.get_sandbox(sid)
        if row is None or row.state != State.RUNNING:
            return
        state = (await self.backend.running()).get(sid)  # (the backend's status)
        if state != "running":
            await self._kill(sid, reason="exited", final_state=State.ERROR)
