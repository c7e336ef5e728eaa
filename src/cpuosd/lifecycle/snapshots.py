"""Pause, resume and fork: quiesce the agent, checkpoint, restore (``Snapshots``,
``Manager.snapshots``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar


from cpuos_agent.protocol import Kind

from ..accounting.quotas import Admission
from ..agentconn import DEVICE_SETTLE, TransportError
from ..backends.base import Backend
from ..config import Config
from ..errors import ApiError, invalid
from ..events import EventBus, SandboxEvent
from ..snapstore import SnapshotMissing, SnapshotStore
from ..snapstore.facts import (host_facts, incompatibilities, read_meta, snapshot_meta,
                               write_meta)
from ..store import SandboxRow, Store
from ..templates.builder import template_info
from . import states
from .common import Boot, Finish, Kill, Live, NewRow, SetState, _du, _now
from .states import State

T = TypeVar("T")

log = logging.getLogger("cpuosd.lifecycle")


class Snapshots:
    """Pause, resume and fork (``Manager.snapshots``), given what they use: the
    configuration, the store, the backend (which checkpoints and restores), the event bus,
    admission (a resume or a fork's children are admitted as creates are), the node this
    is (``node_id``) and the snapshot store it shares with other nodes (``snapstore``, None
    on one host), the Manager's ``tasks`` (a transfer given up on is kept there until it is
    done), and the Manager's operations: ``lock`` (a sandbox's), ``get`` and ``running``
    (a workspace's row, its live sandbox for an operation, else 404/409), ``set_state``,
    ``finish`` and ``mark_running`` (the one writer of states), ``boot`` (a restore),
    ``new_row`` (a fork's child), ``teardown`` and ``teardown_later`` (a checkpointed
    sandbox's remains), ``save_agent_key`` (beside an image) and ``kill``."""

    def __init__(self, cfg: Config, store: Store, backend: Backend, events: EventBus,
                 admission: Admission, node_id: str | None, snapstore: SnapshotStore | None,
                 tasks: set[asyncio.Task[Any]], *, lock: Callable[[str], asyncio.Lock],
                 get: Callable[[str, str], SandboxRow],
                 running: Callable[[str, str, str], Live], set_state: SetState,
                 finish: Finish, mark_running: Callable[[SandboxRow, float], None],
                 boot: Boot, new_row: NewRow, teardown: Callable[[str], Awaitable[None]],
                 teardown_later: Callable[[str], None],
                 save_agent_key: Callable[[Live, Path], None], kill: Kill) -> None:
        self.cfg, self.store, self.backend, self.events = cfg, store, backend, events
        self.admission, self.node_id, self.snapstore = admission, node_id, snapstore
        self._tasks, self._lock, self._get, self._running = tasks, lock, get, running
        self._set_state, self._finish, self._mark_running = set_state, finish, mark_running
        self._boot, self._new_row, self._teardown = boot, new_row, teardown
        self._teardown_later, self._save_agent_key = teardown_later, save_agent_key
        self._kill = kill

    def _snap(self, sid: str) -> Path:
        return self.cfg.snapshots_dir / sid

    async def quiesce(self, lv: Live) -> None:
        """Have the agent drop its connection (a checkpoint cannot carry it); the socket
        is removed first, so it can only come back once we listen again."""
        if lv.chan.streams:
            raise ApiError("conflict", "commands or file transfers are still running in the "
                           "sandbox; wait for them to finish")
        lv.chan.stop_listening()
        try:
            await lv.chan.call({"t": Kind.QUIESCE}, timeout=10)
            if (lv.chan.hello or {}).get("transport") == "device":
                # a device agent (microVM) cannot hang up: we do, and give it the moment
                # it needs to see that (else a restored copy would wait for it)
                lv.chan.disconnect()
                await asyncio.sleep(DEVICE_SETTLE)
            else:
                try:  # a socket agent closes its end
                    await lv.chan.wait_disconnected(1.0)
                except TransportError:
                    lv.chan.disconnect()
        except asyncio.CancelledError:
            raise  # (a DELETE, or the daemon stopping: whoever cancelled tears it down)
        except BaseException as e:
            await lv.chan.listen()  # the agent keeps retrying: it comes back
            await lv.chan.wait_connected(self.cfg.sandbox.agent_connect_timeout)
            if isinstance(e, ApiError) and e.code == "already_exists":
                raise ApiError("conflict", e.message) from None
            raise

    def _check_space(self, sid: str, where: Path) -> None:
        # its memory and what its writable layer holds (a file on the host, not memory)
        need = (int(self.backend.memory_usage(sid) or 0)
                + int(self.backend.stats(sid).get("disk_used_bytes") or 0)
                + self.cfg.sandbox.snapshot_margin)
        where.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(where).free
        if free < need:
            raise ApiError("no_space", f"not enough space for a snapshot in {where}: "
                           f"{free >> 20} MiB free, up to {need >> 20} MiB needed",
                           {"free_bytes": free, "needed_bytes": need})

    async def _checkpoint(self, lv: Live, image: Path) -> None:
        """Quiesce and checkpoint lv into image (the sandbox stops). A failed checkpoint
        loses the sandbox (runsc stops it either way): it is marked error."""
        sid = lv.row.id
        if not self.backend.capabilities.checkpoint:
            raise ApiError("conflict", f"the {self.backend.capabilities.name} backend cannot "
                           "snapshot sandboxes yet (pause and fork need it)")
        t0 = time.monotonic()
        self._check_space(sid, image.parent)
        self._set_state(sid, State.PAUSING)
        try:
            await self.quiesce(lv)
        except BaseException:
            self._set_state(sid, State.RUNNING)
            raise
        tmp = image.with_name("." + image.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        t1 = time.monotonic()
        try:
            await self.backend.checkpoint(sid, tmp)
            self._save_agent_key(lv, tmp)
            # what a node restoring it elsewhere must match (cpuosd.snapstore.facts)
            write_meta(tmp, snapshot_meta(self.backend, sid, lv.row.template, lv.row.spec))
            os.rename(tmp, image)
        except asyncio.CancelledError:
            # a DELETE cancelled an auto-pause (or the daemon is stopping): nothing of the
            # image is kept; the row stays pausing for the kill (or a restart) to finish
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(image, ignore_errors=True)
            await self._teardown(sid)
            raise
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            await self._teardown(sid)
            msg = e.message if isinstance(e, ApiError | TransportError) else str(e)
            self._finish(sid, State.ERROR, f"checkpoint failed: {msg}"[:500])
            raise
        t2 = time.monotonic()
        self._teardown_later(sid)  # the container stopped at its checkpoint
        log.info("checkpoint of %s: quiesce %.0f ms, runsc checkpoint %.0f ms, teardown %.0f ms",
                 sid, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.monotonic() - t2) * 1e3)

    async def pause(self, workspace_id: str, sid: str, reason: str = "requested"
                    ) -> SandboxRow:
        """``reason`` (kept in the row while it is paused, shown by info): requested,
        idle, timeout, spending_cap."""
        async with self._lock(sid):
            lv = self._running(workspace_id, sid, "pause")
            await self.pause_locked(lv, reason)
        return self._get(workspace_id, sid)

    async def pause_locked(self, lv: Live, reason: str) -> None:
        sid = lv.row.id
        remaining = max(1.0, (lv.row.deadline or _now()) - _now())
        await self._checkpoint(lv, self._snap(sid))
        size = _du(self._snap(sid))
        if self.snapstore is not None and await self._upload(sid):
            # in the shared store: the row is on no node (a new epoch), any node resumes it
            self._set_state(sid, State.PAUSED, paused_at=_now(), remaining=remaining,
                            snapshot_bytes=size, deadline=None, reason=reason,
                            node_id=None, new_epoch=True)
            # handed off: its audit rows in the shared chain before the pause answers (a
            # node that dies next, or is drained and stopped, loses none of them)
            await self.events.settle()
            return
        self._set_state(sid, State.PAUSED, paused_at=_now(), remaining=remaining,
                        snapshot_bytes=size, deadline=None, reason=reason)

    async def _upload(self, sid: str) -> bool:
        """A paused image into the shared snapshot store, then off this node's disk (a
        stale local copy must never be restored later). False: the upload failed; the
        image stays here and the sandbox stays this node's (resumable here). Until it is
        done the row says pausing: a node killed mid-upload never leaves a row saying paused
        with an image that is not whole in the store."""
        assert self.snapstore is not None
        t0 = time.monotonic()
        try:
            m = await self._bounded(self.snapstore.put(sid, self._snap(sid)),
                                    self._transfer_bound(_du(self._snap(sid))))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # (TimeoutError included: a store that hangs)
            log.warning("upload of %s's snapshot failed (kept on this node): %s", sid,
                        e or type(e).__name__)
            return False
        shutil.rmtree(self._snap(sid), ignore_errors=True)
        log.info("snapshot of %s uploaded to the %s store: %d MiB in %.0f ms", sid,
                 self.snapstore.kind, m.total_bytes >> 20, (time.monotonic() - t0) * 1e3)
        return True

    async def _bounded(self, aw: Coroutine[Any, Any, T], seconds: float) -> T:
        """``aw``'s result, or TimeoutError after ``seconds``: then it is cancelled and left
        to finish in the background (a transfer's cancellation waits for its thread, which
        a store that hangs holds until botocore's own timeouts: minutes), never awaited
        here."""
        task = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait({task}, timeout=seconds)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            self._tasks.add(task)  # (kept referenced until it is done)
            task.add_done_callback(self._tasks.discard)
            raise TimeoutError(f"snapshot transfer took longer than {seconds:.0f} s")
        return task.result()

    def _transfer_bound(self, size: int) -> float:
        """s one snapshot transfer may take: CPUOS_SNAPSHOT_TRANSFER_TIMEOUT plus 1 s per
        20 MiB (a hanging store must not hold a pause or a resume without end)."""
        return self.cfg.cluster.snapshot_transfer_timeout + size / (20 << 20)

    async def _claim(self, row: SandboxRow) -> SandboxRow:
        """A sandbox paused into the shared store, taken by this node: paused -> resuming
        with this node's id and a new epoch in one compare-and-set (two nodes racing: one
        wins, the other answers 409), then its image fetched (and checked against this
        host: gVisor refuses a restore on a CPU lacking saved features). On failure it is
        paused on no node again."""
        assert self.snapstore is not None
        sid = row.id
        # admitted (its running size counts for the workspace from the claim on) in one step
        # with the claim, as creates on other nodes are
        with self.admission.admitting(row.workspace_id, row.spec.vcpus, row.spec.memory_mib,
                                      new_sandboxes=False):
            claimed = self.store.transition(sid, (State.PAUSED,), State.RESUMING,
                                            expect_epoch=row.epoch, new_epoch=True,
                                            node_id=self.node_id)
        if not claimed:
            now = self.store.get_sandbox(sid)
            raise ApiError("conflict", f"sandbox {sid} is being resumed elsewhere (now "
                           f"{now.state if now else 'gone'})",
                           {"state": now.state if now else None})
        self.events.emit(SandboxEvent(State.RESUMING, sid, row.workspace_id, State.PAUSED))
        snap = self._snap(sid)
        shutil.rmtree(snap, ignore_errors=True)
        try:
            t0 = time.monotonic()
            await self._bounded(self.snapstore.get(sid, snap),
                                self._transfer_bound(row.snapshot_bytes or 0))
            meta = read_meta(snap)
            bad = incompatibilities(meta, host_facts(self.backend)) if meta else []
            if bad:
                raise ApiError("conflict", f"sandbox {sid}'s snapshot cannot be restored on "
                               f"node {self.node_id}: " + "; ".join(bad)[:300])
            log.info("snapshot of %s fetched from the %s store in %.0f ms", sid,
                     self.snapstore.kind, (time.monotonic() - t0) * 1e3)
        except BaseException:
            shutil.rmtree(snap, ignore_errors=True)
            self.store.transition(sid, (State.RESUMING,), State.PAUSED, new_epoch=True,
                                  node_id=None)
            raise
        got = self.store.get_sandbox(sid)
        assert got is not None
        return got

    async def resume(self, workspace_id: str, sid: str) -> SandboxRow:
        async with self._lock(sid):
            row = self._get(workspace_id, sid)
            states.check("resume", sid, row.state, row.reason)
            if row.state == State.RUNNING:
                return row
            await self.resume_row(row)
        return self._get(workspace_id, sid)

    async def resume_row(self, row: SandboxRow) -> None:
        """Restore paused row, its lock held (``resume``, a wake): one paused into the
        shared store is claimed first (many hosts); one paused on another node is not
        ours (409)."""
        if row.node_id != self.node_id:
            if self.snapstore is None or row.node_id is not None:
                raise ApiError("conflict", f"sandbox {row.id} is paused on node "
                               f"{row.node_id}, not on this one ({self.node_id})")
            row = await self._claim(row)
        await self._resume_locked(row)

    async def _resume_locked(self, row: SandboxRow) -> None:
        """Restore a paused sandbox (its lock held); on any failure, cancellation included,
        it is paused as it was (the snapshot is kept until the restore succeeded)."""
        sid = row.id
        snap = self._snap(sid)
        claimed = row.state == State.RESUMING  # (fetched from the shared store: _claim,
        # which admitted it)
        try:
            if not claimed:
                with self.admission.admitting(row.workspace_id, row.spec.vcpus,
                                              row.spec.memory_mib, new_sandboxes=False):
                    self._set_state(sid, State.RESUMING)
            await self._boot(row, snap, resume=True)
        except BaseException:
            if claimed:  # the store's copy is still good: paused on no node again
                shutil.rmtree(snap, ignore_errors=True)
                self.store.transition(sid, (State.RESUMING,), State.PAUSED, new_epoch=True,
                                      node_id=None)
            else:
                self._set_state(sid, State.PAUSED)  # the snapshot is still good
            raise
        self._mark_running(row, row.remaining or row.spec.timeout or 300.0)
        self.store.update_sandbox(sid, paused_at=None, remaining=None, snapshot_bytes=None)
        shutil.rmtree(snap, ignore_errors=True)
        if claimed and self.snapstore is not None:
            try:  # (running again: its next pause uploads a new image)
                await self.snapstore.delete(sid)
            except Exception as e:
                log.warning("resumed %s: its old snapshot in the store stays: %s", sid, e)

    async def fork(self, workspace_id: str, sid: str, n: int) -> list[SandboxRow]:
        """n new sandboxes with the memory, processes and files of sid (which keeps running):
        checkpoint once, restore n + 1 times."""
        clones, _, _ = await self._fork(workspace_id, sid, n, publish=0)
        return clones

    async def fork_publish(self, workspace_id: str, sid: str, n_local: int,
                           n_remote: int) -> tuple[list[SandboxRow], str, int]:
        """A fork fanned out across nodes (cpuosd.cluster.forks), the parent's node's part:
        checkpoint sid once, restore it, put the image into the shared snapshot store under
        a key of its own (``fork-<sid>-<hex>``: other nodes restore their children from
        it), and restore ``n_local`` children here. (children, key, bytes); nothing is
        left made on failure (the children made are killed, the key deleted)."""
        if self.snapstore is None:
            raise ApiError("not_found", "this node has no shared snapshot store (a fork "
                           "across nodes needs CPUOS_SNAPSHOT_STORE)")
        if n_remote < 1:
            raise invalid_n(n_remote)
        clones, key, size = await self._fork(workspace_id, sid, n_local, publish=n_remote)
        assert key is not None
        return clones, key, size

    async def _fork(self, workspace_id: str, sid: str, n: int, publish: int
                    ) -> tuple[list[SandboxRow], str | None, int]:
        """Checkpoint sid, restore it, (``publish`` > 0: put the image into the shared
        store for that many children elsewhere), restore n children from it here."""
        async with self._lock(sid):
            lv = self._running(workspace_id, sid, "fork")
            row = lv.row
            if publish:  # the workspace's count for every child, wherever it lands
                self.admission.admit(workspace_id, row.spec.vcpus, row.spec.memory_mib,
                                     n=n + publish, reserve_host=False)
            if n:
                self.admission.admit(workspace_id, row.spec.vcpus, row.spec.memory_mib,
                                     n=n)
            image = self.cfg.snapshots_dir / f"fork-{sid}-{secrets.token_hex(4)}"
            remaining = max(1.0, (row.deadline or _now()) - _now())
            key: str | None = None
            size = 0
            try:
                await self._checkpoint(lv, image)
                self._set_state(sid, State.RESUMING)
                try:
                    await self._boot(row, image)
                except BaseException as e:
                    self._finish(sid, State.ERROR, f"restore after fork failed: {e}"[:500])
                    raise
                self._mark_running(row, remaining)
                if publish:
                    assert self.snapstore is not None
                    size = _du(image)
                    key = await self._publish_fork(sid, image, size)
                try:
                    clones = await self._clones(row, image, n, remaining)
                except BaseException:
                    if key is not None:
                        await self.release_fork(sid, key)
                    raise
            finally:
                shutil.rmtree(image, ignore_errors=True)
        return clones, key, size

    async def _publish_fork(self, sid: str, image: Path, size: int) -> str:
        assert self.snapstore is not None
        key = f"fork-{sid}-{secrets.token_hex(4)}"
        t0 = time.monotonic()
        try:
            await self._bounded(self.snapstore.put(key, image), self._transfer_bound(size))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # (TimeoutError included: a store that hangs)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.snapstore.delete(key), 10)
            raise ApiError("unavailable", f"the fork's image could not be stored in the "
                           f"{self.snapstore.kind} snapshot store: {e or type(e).__name__}"
                           ) from None
        log.info("fork image of %s stored as %s: %d MiB in %.0f ms", sid, key, size >> 20,
                 (time.monotonic() - t0) * 1e3)
        return key

    async def release_fork(self, sid: str, key: str) -> None:
        """The fork image ``key`` of sid out of the shared store (all its children are
        restored, or the fork failed)."""
        if self.snapstore is None:
            raise ApiError("not_found", "this node has no shared snapshot store")
        check_fork_key(sid, key)
        try:
            await asyncio.wait_for(self.snapstore.delete(key), 30)
        except Exception as e:  # (the orphan sweep removes it later)
            log.warning("fork image %s stays in the store: %s", key, e or type(e).__name__)

    async def fork_restore(self, workspace_id: str, sid: str, key: str, n: int,
                           size: int) -> list[SandboxRow]:
        """A fork fanned out across nodes, a target node's part: n children of sid (whose
        row may be any node's) restored here from the fork image ``key`` in the shared
        store (fetched once, checked against this host), each a row of this node with its
        own network identity. Nothing is left made on failure."""
        if self.snapstore is None:
            raise ApiError("not_found", "this node has no shared snapshot store (a fork "
                           "across nodes needs CPUOS_SNAPSHOT_STORE)")
        check_fork_key(sid, key)
        parent = self._get(workspace_id, sid)  # (404 unless the caller's)
        info = template_info(self.cfg.templates_dir, parent.template)
        if info is None or info.get("digest") != parent.spec.template_digest:
            raise ApiError("conflict", f"node {self.node_id} does not have the build of "
                           f"template {parent.template!r} that sandbox {sid} runs")
        self.admission.admit(workspace_id, parent.spec.vcpus, parent.spec.memory_mib,
                             n=n)
        image = self.cfg.snapshots_dir / f"fork-{sid}-{secrets.token_hex(4)}"
        shutil.rmtree(image, ignore_errors=True)
        try:
            t0 = time.monotonic()
            try:
                await self._bounded(self.snapstore.get(key, image), self._transfer_bound(size))
            except asyncio.CancelledError:
                raise
            except SnapshotMissing:
                raise ApiError("not_found", f"fork image {key} is not in the store") from None
            except Exception as e:
                raise ApiError("unavailable", f"fetching fork image {key} failed: "
                               f"{e or type(e).__name__}") from None
            meta = read_meta(image)
            bad = incompatibilities(meta, host_facts(self.backend)) if meta else []
            if bad:
                raise ApiError("conflict", f"sandbox {sid}'s fork image cannot be restored "
                               f"on node {self.node_id}: " + "; ".join(bad)[:300])
            log.info("fork image %s fetched in %.0f ms", key, (time.monotonic() - t0) * 1e3)
            remaining = max(1.0, (parent.deadline or _now()) - _now())
            return await self._clones(parent, image, n, remaining, rootfs=info["rootfs"])
        finally:
            shutil.rmtree(image, ignore_errors=True)

    async def _clones(self, row: SandboxRow, image: Path, n: int, remaining: float,
                      rootfs: str | None = None) -> list[SandboxRow]:
        """n children of row restored from image, each a new row of this node; on a failure
        (or a cancellation) the ones made are killed and the error raised."""
        info = {"rootfs": rootfs or row.spec.rootfs,
                "digest": row.spec.template_digest}
        clones: list[SandboxRow] = []
        try:
            for _ in range(n):
                # each child admitted again as its row is made (the fork's own admission
                # was before the checkpoint: creates meanwhile, here or on other nodes,
                # count by now), the host's room aside (checked then)
                with self.admission.admitting(row.workspace_id, row.spec.vcpus,
                                              row.spec.memory_mib, reserve_host=False):
                    c = self._new_row(row.workspace_id, row.template, info, remaining,
                                      row.metadata, row.spec.env, row.spec.vcpus,
                                      row.spec.memory_mib, on_timeout=row.on_timeout)
                    c.spec = replace(c.spec, pids=row.spec.pids,  # rlimits must match at
                                     disk_mib=row.spec.disk_mib,  # restore, and the
                                     network=row.spec.network,  # overlay's medium
                                     idle_timeout=row.spec.idle_timeout or 0.0)
                    self.store.update_sandbox(c.id, spec=c.spec)
                try:
                    await self._boot(c, image)
                except BaseException as e:
                    self._finish(c.id, State.ERROR, f"fork restore failed: {e}"[:500])
                    raise
                self._mark_running(c, remaining)
                clones.append(c)
        except BaseException:
            for c in clones:  # nothing half-made: a fork gives all its children or none
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._kill(c.id, reason="fork failed"))
            raise
        return clones


FORK_KEY = re.compile(r"^fork-(sbx-[a-z0-9]{1,60})-[0-9a-f]{8}$")


def check_fork_key(sid: str, key: str) -> str:
    """A fork image's key names its parent: a caller may fetch or delete only the fork
    images of a sandbox it may see (never another sandbox's paused image)."""
    m = FORK_KEY.fullmatch(key)
    if m is None or m.group(1) != sid:
        raise invalid(f"{key[:100]!r} is not a fork image of sandbox {sid}", field="image")
    return key


def invalid_n(n: int) -> ApiError:
    return invalid(f"n {n}: a fork across nodes has at least one child elsewhere", field="n")
