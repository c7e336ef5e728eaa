"""Template snapshots (each template booted once and checkpointed) and the warm pool
of sandboxes restored ahead of time; the template's start command and ready check."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import secrets
import shlex
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any


from cpuos_agent.protocol import Kind

from ..agentconn import raise_for_agent_error
from ..errors import ApiError
from ..store import RowSpec, SandboxRow
from ..templates.builder import template_info
from .common import (Live, _base_env, _now)
from .states import State

if TYPE_CHECKING:
    from .manager import Manager

log = logging.getLogger("cpuosd.lifecycle")

MAX_SNAPSHOTS_LISTED = 500  # paused sandboxes a heartbeat names (placement's preference)

# s of creates counted as the pool's recent demand
DEMAND_WINDOW = 10.0
# s a create waits for a refill under way before it restores a sandbox of its own
POOL_WAIT = 10.0
# s before the pool tries again after a refill failed
POOL_RETRY = 30.0


class PoolMiss(Exception):
    """The refill a create waited for failed."""


class Templates:
    def _template_image_name(self: Manager, template: str, digest: str) -> str:
        """A template image is of one template build, one agent and one kind of machine
        (an image of another backend, accelerator or device set never restores)."""
        return (f"{template}-{digest}-{self.agent_dir.name}-{self.backend.image_kind}"
                f"-p{self.cfg.sandbox.default_pids}-d{self.cfg.sandbox.default_disk_mib}")
        # (rlimits must match at restore; the disk's size is the checkpoint's)

    async def _template_image(self: Manager, template: str, info: dict[str, Any]) -> Path | None:
        """The template booted once and checkpointed; made on first use. None when
        snapshots are off or could not be made (create then boots)."""
        if not self.cfg.pool.template_snapshots or not self.backend.capabilities.checkpoint:
            return None
        d = (self.cfg.snapshots_dir / "templates"
             / self._template_image_name(template, info["digest"]))
        if (d / "checkpoint.img").exists():
            return d
        async with self._lock("template:" + template):
            if (d / "checkpoint.img").exists():
                return d
            try:
                await self._make_template_image(template, info, d)
            except Exception:
                log.exception("snapshot of template %s failed; booting instead", template)
                return None
        return d

    async def _make_template_image(self: Manager, template: str, info: dict[str, Any],
                                   d: Path) -> None:
        t0 = time.monotonic()
        row = SandboxRow(id="tpl-" + secrets.token_hex(6), workspace_id="", template=template,
                         backend=self.backend.capabilities.name, state=State.CREATING, reason=None,
                         created_at=_now(), started_at=None, ended_at=None, deadline=None,
                         spec=RowSpec(rootfs=info["rootfs"],
                                      vcpus=self.cfg.sandbox.default_vcpus,
                                      memory_mib=self.cfg.sandbox.default_memory_mib,
                                      pids=self.cfg.sandbox.default_pids,
                                      disk_mib=self.cfg.sandbox.default_disk_mib,
                                      network={"mode": "off", "allow": []},
                                      hostname="sandbox", env={},
                                      machine_id=secrets.token_hex(16),
                                      template_env=info.get("env") or {},
                                      workdir=info.get("workdir")),
                         metadata={})
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            lv = await self._boot(row, None, template_boot=True)
            await self._start_command(lv, info, snapshot=True)
            await self._quiesce(lv)
            await self.backend.checkpoint(row.id, tmp)
            self._save_agent_key(lv, tmp)
            os.rename(tmp, d)
        finally:
            await self._teardown(row.id)
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("template %s snapshotted in %.2fs", template, time.monotonic() - t0)

    async def forget_template(self: Manager, template: str) -> int:
        """A template is being removed: end its pooled sandboxes and delete its snapshot
        images (sandboxes users hold are the caller's concern). Returns how many images."""
        async with self._lock("template:" + template):
            self._pool_gen[template] = self._pool_gen.get(template, 0) + 1  # fills under way
            for lv in self.pool.pop(template, []):
                await self.kill(lv.row.id, reason="template removed")
            ours = re.compile(rf"{re.escape(template)}-[0-9a-f]{{16}}-.+")
            tdir = self.cfg.snapshots_dir / "templates"
            gone = [d for d in (tdir.iterdir() if tdir.is_dir() else ())
                    if ours.fullmatch(d.name) and d.is_dir() and not d.is_symlink()]
            for d in gone:
                await asyncio.to_thread(shutil.rmtree, d, True)
            return len(gone)

    def placement_facts(self: Manager) -> dict[str, Any]:
        """What a node holds that placement prefers it for (cpuosd.cluster.nodes.place),
        read by its heartbeat (a thread: only copies of the loop's dicts are walked): the
        templates with a warm pool sandbox ready (``pools``), those whose template
        checkpoint is made here for their current build (``template_images``), and the
        paused sandboxes whose image is on this node's disk (``snapshots``)."""
        pools = sorted(t for t, ready in list(self.pool.items()) if ready)
        images = []
        if self.cfg.pool.template_snapshots and self.backend.capabilities.checkpoint:
            from ..templates.builder import list_templates

            tdir = self.cfg.snapshots_dir / "templates"
            for t in list_templates(self.cfg.templates_dir):
                name, digest = t.get("name"), t.get("digest")
                if name and digest and (tdir / self._template_image_name(
                        str(name), str(digest)) / "checkpoint.img").exists():
                    images.append(str(name))
        snaps = sorted(r.id for r in self.store.list_sandboxes(None, (State.PAUSED,),
                                                               node_id=self.node_id)
                       if r.node_id is not None)[:MAX_SNAPSHOTS_LISTED]
        return {"pools": pools, "template_images": sorted(images), "snapshots": snaps}

    # ---- the warm pool ------------------------------------------------------------------
    def _pool_on(self: Manager, template: str) -> bool:
        return self.cfg.pool.size > 0 and template in self.cfg.pool.templates

    def _pool_target(self: Manager, template: str) -> int:
        """How many ready sandboxes the pool keeps: CPUOS_POOL_SIZE, or as many as creates
        of the template asked for in the last DEMAND_WINDOW seconds, at most
        CPUOS_POOL_MAX."""
        demand = self._pool_demand.get(template)
        now = time.monotonic()
        while demand and now - demand[0] > DEMAND_WINDOW:
            demand.popleft()
        return min(max(self.cfg.pool.size, self.cfg.pool.max),
                   max(self.cfg.pool.size, len(demand or ())))

    def _pool_want(self: Manager, template: str) -> None:
        """Start refills (at most CPUOS_POOL_PARALLEL at once) until the pool, with what is
        under way and not yet claimed, reaches its target; never where the host could not
        then take one more sandbox of a user's (admission)."""
        if not self._pool_on(template) or time.monotonic() < self._pool_retry.get(template, 0):
            return
        pool = self.pool.setdefault(template, [])
        while True:
            inflight = self._pool_inflight.get(template, 0)
            claimed = len(self._pool_waiters.get(template, ()))
            if (len(pool) + inflight - claimed >= self._pool_target(template)
                    or inflight >= self.cfg.pool.parallel):
                return
            if not self.admission.host_has_room(self.cfg.sandbox.default_vcpus,
                                                self.cfg.sandbox.default_memory_mib, n=2):
                return  # a pooled sandbox must not take the place of a user's
            self.admission.promise(self.cfg.sandbox.default_memory_mib)
            self._pool_inflight[template] = inflight + 1
            self._spawn(self._pool_fill(template, self._pool_gen.get(template, 0)))

    async def _pool_fill(self: Manager, template: str, gen: int) -> None:
        """Restore one sandbox for the pool: to a create waiting for it, else into the
        pool."""
        ok = False
        try:
            info = template_info(self.cfg.templates_dir, template)
            ws = self.store.workspace_by_name("default")
            image = await self._template_image(template, info) if info and ws else None
            if image is None or info is None or ws is None:
                return
            row = self._new_row(ws, template, info, self.cfg.sandbox.default_timeout, {}, {},
                                self.cfg.sandbox.default_vcpus, self.cfg.sandbox.default_memory_mib,
                                state=State.POOLED)
            try:
                lv = await self._boot(row, image)
            except Exception:
                log.exception("warm pool: restoring %s failed", template)
                self._finish(row.id, State.ERROR, "pool restore failed")
                return
            ok = True
            if gen != self._pool_gen.get(template, 0):  # the template was removed meanwhile
                await self.kill(row.id, reason="pool_discarded")
                return
            waiters = self._pool_waiters.get(template)
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(lv)  # straight to a create waiting for it
                    return
            self.pool.setdefault(template, []).append(lv)
        finally:
            self._pool_inflight[template] = self._pool_inflight.get(template, 1) - 1
            if not ok:
                self._pool_retry[template] = time.monotonic() + POOL_RETRY
                waiters = self._pool_waiters.get(template)
                while waiters:  # one create waiting for this fill goes on without it
                    fut = waiters.popleft()
                    if not fut.done():
                        fut.set_exception(PoolMiss())
                        break
            else:
                self._pool_want(template)

    def _pool_take(self: Manager, template: str) -> Live | None:
        """A ready pooled sandbox (handed out once: no await between this and its use)."""
        self._pool_demand.setdefault(template, collections.deque()).append(time.monotonic())
        pool = self.pool.get(template)
        lv = pool.pop() if pool else None
        self._pool_want(template)
        return lv

    def _pool_can_wait(self: Manager, template: str) -> bool:
        """Is a refill under way that no other create waits for (it is done sooner than a
        restore of our own would be)?"""
        return self._pool_inflight.get(template, 0) > len(self._pool_waiters.get(template, ()))

    async def _pool_wait(self: Manager, template: str, workspace_id: str) -> Live | None:
        """The sandbox of a refill under way, or None (it failed, or took longer than
        POOL_WAIT: the caller restores its own)."""
        fut: asyncio.Future[Live] = asyncio.get_running_loop().create_future()
        self._pool_waiters.setdefault(template, collections.deque()).append(fut)
        self._pool_claims[workspace_id] += 1
        got: Live | None = None
        try:
            try:
                got = await asyncio.wait_for(asyncio.shield(fut), POOL_WAIT)
            except TimeoutError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    got = fut.result()  # (it came as we gave up)
            except PoolMiss:
                pass
            return got
        finally:
            self._pool_claims[workspace_id] -= 1
            if not self._pool_claims[workspace_id]:
                del self._pool_claims[workspace_id]
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._pool_waiters[template].remove(fut)
            elif got is None and not fut.cancelled() and fut.exception() is None:
                # given to us as we were cancelled: back into the pool
                self.pool.setdefault(template, []).append(fut.result())

    def _pool_tick(self: Manager) -> None:
        """Each second (the daemon's tick): a pool larger than its target, with no demand
        for a while, gives back one sandbox (its memory); then refills as needed."""
        now = time.monotonic()
        for template in self.cfg.pool.templates if self.cfg.pool.size > 0 else ():
            pool = self.pool.get(template)
            demand = self._pool_demand.get(template)
            idle = not demand or now - demand[-1] > DEMAND_WINDOW
            if pool and idle and len(pool) > self._pool_target(template):
                lv = pool.pop(0)
                self._spawn(self.kill(lv.row.id, reason="pool_discarded"))
            self._pool_want(template)

    async def _run_simple(self: Manager, lv: Live, cmd: str, timeout: float) -> tuple[int, bytes]:
        """Run a shell line in the sandbox for the daemon itself: (exit code, output tail)."""
        st = lv.chan.open()
        try:
            await st.send({"t": Kind.EXEC, "shell": cmd, "env": _base_env(lv.row), "cwd": "/",
                           "timeout": timeout, "stdin": False})
            out = b""
            while True:
                h, payload = await st.get(timeout + 10)
                raise_for_agent_error(h)
                if h["t"] == Kind.OUT:
                    out = (out + payload)[-4000:]
                elif h["t"] == Kind.EXIT:
                    code = h.get("exit_code")
                    return (code if isinstance(code, int) else -1), out
        except TimeoutError:
            raise ApiError("timeout", f"{cmd!r} did not finish in the sandbox") from None
        finally:
            st.close()

    async def _start_command(self: Manager, lv: Live, info: dict[str, Any],
                             snapshot: bool = False) -> None:
        """The template's long-running start command, then its ready check (a command that
        must exit 0, or a port that must accept connections). ``snapshot``: the boot that
        makes the template snapshot; the command sees CPUOS_TEMPLATE_SNAPSHOT=1 (and may
        warm up more than a cold boot's create should wait for)."""
        start = info.get("start")
        if not start:
            return
        await self._run_simple(
            lv, f"cd {shlex.quote(lv.row.spec.workdir or '/')} && "
            f"{'CPUOS_TEMPLATE_SNAPSHOT=1 ' if snapshot else ''}"
            f"nohup sh -c {shlex.quote(start)} >/tmp/cpuos-start.log 2>&1 &", 30)
        ready = info.get("ready") or {}
        check = ready.get("cmd")
        if ready.get("port"):
            check = (f"python3 -c 'import socket; socket.create_connection("
                     f"(\"127.0.0.1\", {int(ready['port'])}), 1)'")
        if not check:
            return
        timeout = float(ready.get("timeout") or 30)
        deadline = time.monotonic() + timeout
        while True:
            code, _ = await self._run_simple(lv, check, 10)
            if code == 0:
                return
            if time.monotonic() > deadline:
                _, log_tail = await self._run_simple(lv, "tail -c 2000 /tmp/cpuos-start.log", 10)
                raise ApiError("timeout", f"template {info.get('name')}: ready check {check!r} "
                               f"did not pass within {timeout:.0f}s; start log: "
                               f"{log_tail.decode(errors='replace')[-500:]}")
            await asyncio.sleep(0.2)
