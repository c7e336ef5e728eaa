"""Template snapshots (each template booted once and checkpointed: ``TemplateImages``,
``Manager.images``) and the warm pool of sandboxes restored ahead of time (``WarmPool``,
``Manager.pool``); the template's start command and ready check."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import glob
import logging
import os
import re
import secrets
import shlex
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


from cpuos_agent.protocol import Kind

from ..accounting.quotas import Admission
from ..agentconn import raise_for_agent_error
from ..backends.base import Backend
from ..config import Config
from ..errors import ApiError
from ..store import RowSpec, SandboxRow, Store
from ..templates.builder import list_templates, template_info
from .common import Boot, Finish, Kill, Live, NewRow, Spawn, _base_env, _now
from .states import State

log = logging.getLogger("cpuosd.lifecycle")

# s of creates counted as the pool's recent demand
DEMAND_WINDOW = 10.0
# s a create waits for a refill under way before it restores a sandbox of its own
POOL_WAIT = 10.0
# s before the pool tries again after a refill failed
POOL_RETRY = 30.0
# s a daemon waits for a template image's lock (another daemon making the image) before it
# boots instead
LOCK_WAIT = 300.0


class PoolMiss(Exception):
    """The refill a create waited for failed."""


class TemplateImages:
    """Template snapshots (``Manager.images``), given what they use: the configuration,
    the backend (which checkpoints; its kind of image), the agent copy sandboxes mount
    (``agent_dir``: an image is of one agent), and the Manager's operations: ``lock`` (one
    snapshot of a template at a time), ``boot`` and ``teardown`` of the sandbox that is
    checkpointed, ``quiesce`` (its agent hangs up first) and ``save_agent_key`` (beside the
    image, for the restored agent).

    Images live in CPUOS_TEMPLATE_IMAGES_DIR, which the daemons of one host may share:
    beside each image ``<name>`` is its lock file ``<name>.lock`` (flock). An image is made
    under the exclusive lock, in a directory of its maker's own (``<name>.tmp-<pid>-...``)
    renamed into place when complete (``checkpoint.img`` and ``agent.key`` in it); a
    daemon that has used an image holds the shared lock until it exits (``close``), so an
    image is deleted (under the exclusive lock, never waited for) only where no running
    daemon uses it."""

    def __init__(self, cfg: Config, backend: Backend, agent_dir: Path, *,
                 lock: Callable[[str], asyncio.Lock], boot: Boot,
                 teardown: Callable[[str], Awaitable[None]],
                 quiesce: Callable[[Live], Awaitable[None]],
                 save_agent_key: Callable[[Live, Path], None]) -> None:
        self.cfg, self.backend, self.agent_dir = cfg, backend, agent_dir
        self._lock, self._boot, self._teardown = lock, boot, teardown
        self._quiesce, self._save_agent_key = quiesce, save_agent_key
        self._held: dict[str, int] = {}  # image name -> fd of its lock file (shared lock)

    @property
    def _dir(self) -> Path:
        return self.cfg.template_images_dir

    def name(self, template: str, digest: str) -> str:
        """A template image is of one template build, one agent and one kind of machine
        (an image of another backend, platform, accelerator or device set never restores;
        nor one made with other limits: rlimits, and the writable layer's size and inode
        limit, which memory sets, must match at restore)."""
        s = self.cfg.sandbox
        rt = self.backend.runtime()  # (runsc's platform; the audit's runtime monitoring)
        extra = "".join(f"-{v}" for v in (rt.get("platform"), "audit" if "audit" in rt else "")
                        if v)
        return (f"{template}-{digest}-{self.agent_dir.name}-{self.backend.image_kind}{extra}"
                f"-p{s.default_pids}-d{s.default_disk_mib}-m{s.default_memory_mib}"
                f"-c{s.default_vcpus}")

    async def ensure(self, template: str, info: dict[str, Any]) -> Path | None:
        """The template booted once and checkpointed; made on first use (by this daemon or
        another sharing the directory). None when snapshots are off or the image could not
        be made (create then boots)."""
        if not self.cfg.pool.template_snapshots or not self.backend.capabilities.checkpoint:
            return None
        name = self.name(template, info["digest"])
        d = self._dir / name
        if name in self._held:
            return d  # (held: no daemon deletes it)
        async with self._lock("template:" + template):
            if name in self._held:
                return d
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = await self._flock(name, fcntl.LOCK_SH, LOCK_WAIT)
            if fd is not None and _complete(d):
                self._held[name] = fd
                return d
            if fd is not None:
                os.close(fd)
            # (until another daemon has made it: that one then holds it shared, for good)
            fd = await self._flock(name, fcntl.LOCK_EX, LOCK_WAIT, unless=lambda: _complete(d))
            if fd is None and not _complete(d):
                log.warning("template %s: its image's lock not had in %.0fs; booting instead",
                            template, LOCK_WAIT)
                return None
            if fd is not None:
                try:
                    if not _complete(d):
                        # (what a maker that died left: nobody else makes this image now)
                        await self._remove_tmps(name)
                        await asyncio.to_thread(shutil.rmtree, d, True)
                        await self._make(template, info, d)
                except Exception:
                    log.exception("snapshot of template %s failed; booting instead", template)
                    return None
                finally:
                    os.close(fd)
            # (the exclusive lock is let go before the shared one is had: the image may be
            # deleted between, then this create boots)
            fd = await self._flock(name, fcntl.LOCK_SH, LOCK_WAIT)
            if fd is None or not _complete(d):
                if fd is not None:
                    os.close(fd)
                return None
            self._held[name] = fd
        return d

    async def _flock(self, name: str, op: int, wait: float,
                     unless: Callable[[], bool] | None = None) -> int | None:
        """The fd of ``<name>.lock`` locked with ``op`` (LOCK_SH or LOCK_EX), tried every
        0.1 s for ``wait`` seconds (0: once) or until ``unless()`` says it is no longer
        needed; None if not had. The lock is of the file in place (one deleted meanwhile
        by its holder is opened again)."""
        path = self._dir / f"{name}.lock"
        deadline = time.monotonic() + wait
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline or (unless is not None and unless()):
                    return None
                await asyncio.sleep(0.1)
                continue
            try:
                st, now = os.fstat(fd), os.stat(path)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    async def _make(self, template: str, info: dict[str, Any], d: Path) -> None:
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
        # a directory of this maker's own, renamed into place once complete
        tmp = d.with_name(f"{d.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            lv = await self._boot(row, None, template_boot=True)
            await start_command(lv, info, snapshot=True)
            await self._quiesce(lv)
            await self.backend.checkpoint(row.id, tmp)
            self._save_agent_key(lv, tmp)
            os.rename(tmp, d)
        finally:
            await self._teardown(row.id)
            await asyncio.to_thread(shutil.rmtree, tmp, True)
        log.info("template %s snapshotted in %.2fs", template, time.monotonic() - t0)

    async def _delete(self, name: str) -> bool:
        """Delete image ``name`` (and what a maker of it left) if no daemon uses or makes it
        now (its lock had exclusively at once); True if an image was deleted."""
        fd = self._held.pop(name, None)
        if fd is not None:
            os.close(fd)  # (our own use of it ends)
        fd = await self._flock(name, fcntl.LOCK_EX, 0)
        if fd is None:
            return False  # in use by another daemon: left
        try:
            d = self._dir / name
            existed = d.is_dir() and not d.is_symlink()
            await self._remove_tmps(name)
            await asyncio.to_thread(shutil.rmtree, d, True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / f"{name}.lock")  # (while held: see _flock)
            return existed
        finally:
            os.close(fd)

    async def _remove_tmps(self, name: str) -> None:
        """The directories makers of image ``name`` left (its exclusive lock held: no maker
        is at work)."""
        for tmp in self._dir.glob(glob.escape(name) + ".tmp-*"):
            await asyncio.to_thread(shutil.rmtree, tmp, True)

    def _names(self) -> set[str]:
        """The image names the directory holds (images, their lock files, makers' tmp)."""
        out = set()
        for p in self._dir.iterdir() if self._dir.is_dir() else ():
            out.add(_IMAGE_SUFFIX.sub("", p.name))
        return out

    async def forget(self, template: str) -> int:
        """Delete the template's snapshot images (its lock held: ``Manager.forget_template``),
        but those another daemon uses. Returns how many."""
        ours = re.compile(rf"{re.escape(template)}-[0-9a-f]{{16}}-.+")
        n = 0
        for name in sorted(self._names()):
            if ours.fullmatch(name) and await self._delete(name):
                n += 1
        return n

    async def prune(self) -> None:
        """At startup, in a directory shared with other daemons: delete the images of this
        daemon's templates' older builds, and what makers that died left, where no daemon
        uses them. (Images of other agents, machines or limits may be another daemon's:
        left. A daemon's own directory is pruned by ``Reconcile``: all but the current.)"""
        current = {str(t["name"]): str(t["digest"])
                   for t in list_templates(self.cfg.templates_dir)
                   if t.get("name") and t.get("digest")}
        tmps = {_IMAGE_SUFFIX.sub("", p.name)
                for p in (self._dir.glob("*.tmp-*") if self._dir.is_dir() else ())}
        for name in sorted(self._names()):
            if any(re.fullmatch(rf"{re.escape(t)}-(?!{re.escape(digest)}-)[0-9a-f]{{16}}-.+", name)
                   for t, digest in current.items()):
                await self._delete(name)  # (an older build of a template of ours)
            elif name in tmps:
                fd = await self._flock(name, fcntl.LOCK_EX, 0)
                if fd is not None:  # no maker is at work: its tmp is a dead one's
                    try:
                        await self._remove_tmps(name)
                        if not (self._dir / name).exists():
                            os.unlink(self._dir / f"{name}.lock")  # (while held: _flock)
                    finally:
                        os.close(fd)

    def close(self) -> None:
        """The images this daemon used are no longer held (the daemon ends)."""
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def made(self) -> list[str]:
        """The templates whose checkpoint is made here for their current build (placement
        prefers the node: ``Manager.placement_facts``)."""
        images = []
        if self.cfg.pool.template_snapshots and self.backend.capabilities.checkpoint:
            for t in list_templates(self.cfg.templates_dir):
                name, digest = t.get("name"), t.get("digest")
                if name and digest and _complete(self._dir / self.name(str(name), str(digest))):
                    images.append(str(name))
        return sorted(images)


def _complete(d: Path) -> bool:
    """Is image ``d`` complete (it is renamed into place only once it is)?"""
    return (d / "checkpoint.img").exists()


# what follows an image's name in its lock file's and its makers' directories' names
_IMAGE_SUFFIX = re.compile(r"\.(lock|tmp-.*)$")


class WarmPool:
    """The warm pool (``Manager.pool``): ready sandboxes restored from their template's
    image ahead of creates, per template (``ready``). Given what it uses: the
    configuration (CPUOS_POOL_*), the store (the default workspace the pooled rows are of),
    admission (a pooled sandbox never takes a user's room), and the Manager's operations:
    ``image`` (the template's image: ``TemplateImages.ensure``), ``new_row``, ``boot``,
    ``finish`` and ``kill`` of a pooled sandbox, ``spawn`` (a refill is a task the Manager
    owns)."""

    def __init__(self, cfg: Config, store: Store, admission: Admission, *,
                 image: Callable[[str, dict[str, Any]], Awaitable[Path | None]],
                 new_row: NewRow, boot: Boot, finish: Finish, kill: Kill,
                 spawn: Spawn) -> None:
        self.cfg, self.store, self.admission = cfg, store, admission
        self._image, self._new_row, self._boot = image, new_row, boot
        self._finish, self._kill, self._spawn = finish, kill, spawn
        # ready sandboxes, refills under way, creates waiting for one (and per workspace,
        # how many), recent creates, generations (a removed template's), retry times
        self.ready: dict[str, list[Live]] = {}
        self.inflight: dict[str, int] = {}
        self.waiters: dict[str, collections.deque[asyncio.Future[Live]]] = {}
        self.claims: collections.Counter[str] = collections.Counter()
        self.demand: dict[str, collections.deque[float]] = {}
        self.gen: dict[str, int] = {}
        self.retry: dict[str, float] = {}
        self.closed = False  # the daemon is stopping: no more refills

    def close(self) -> None:
        """No refill starts from now on (the daemon is stopping; those under way are its
        tasks, cancelled with them)."""
        self.closed = True

    async def forget(self, template: str) -> None:
        """A template is being removed (its lock held: ``Manager.forget_template``): its
        fills under way are discarded when done, its pooled sandboxes ended."""
        self.gen[template] = self.gen.get(template, 0) + 1  # fills under way
        for lv in self.ready.pop(template, []):
            await self._kill(lv.row.id, reason="template removed")

    def on(self, template: str) -> bool:
        return self.cfg.pool.size > 0 and template in self.cfg.pool.templates

    def _target(self, template: str) -> int:
        """How many ready sandboxes the pool keeps: CPUOS_POOL_SIZE, or as many as creates
        of the template asked for in the last DEMAND_WINDOW seconds, at most
        CPUOS_POOL_MAX."""
        demand = self.demand.get(template)
        now = time.monotonic()
        while demand and now - demand[0] > DEMAND_WINDOW:
            demand.popleft()
        return min(max(self.cfg.pool.size, self.cfg.pool.max),
                   max(self.cfg.pool.size, len(demand or ())))

    def want(self, template: str) -> None:
        """Start refills (at most CPUOS_POOL_PARALLEL at once) until the pool, with what is
        under way and not yet claimed, reaches its target; never where the host could not
        then take one more sandbox of a user's (admission)."""
        if (self.closed or not self.on(template)
                or time.monotonic() < self.retry.get(template, 0)):
            return
        pool = self.ready.setdefault(template, [])
        while True:
            inflight = self.inflight.get(template, 0)
            claimed = len(self.waiters.get(template, ()))
            if (len(pool) + inflight - claimed >= self._target(template)
                    or inflight >= self.cfg.pool.parallel):
                return
            if not self.admission.host_has_room(self.cfg.sandbox.default_vcpus,
                                                self.cfg.sandbox.default_memory_mib, n=2):
                return  # a pooled sandbox must not take the place of a user's
            self.admission.promise(self.cfg.sandbox.default_memory_mib)
            self.inflight[template] = inflight + 1
            self._spawn(self._fill(template, self.gen.get(template, 0)))

    async def _fill(self, template: str, gen: int) -> None:
        """Restore one sandbox for the pool: to a create waiting for it, else into the
        pool."""
        ok = False
        try:
            info = template_info(self.cfg.templates_dir, template)
            ws = self.store.workspace_by_name("default")
            image = await self._image(template, info) if info and ws else None
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
            if gen != self.gen.get(template, 0):  # the template was removed meanwhile
                await self._kill(row.id, reason="pool_discarded")
                return
            waiters = self.waiters.get(template)
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(lv)  # straight to a create waiting for it
                    return
            self.ready.setdefault(template, []).append(lv)
        finally:
            self.inflight[template] = self.inflight.get(template, 1) - 1
            if not ok:
                self.retry[template] = time.monotonic() + POOL_RETRY
                waiters = self.waiters.get(template)
                while waiters:  # one create waiting for this fill goes on without it
                    fut = waiters.popleft()
                    if not fut.done():
                        fut.set_exception(PoolMiss())
                        break
            else:
                self.want(template)

    def take(self, template: str) -> Live | None:
        """A ready pooled sandbox (handed out once: no await between this and its use)."""
        self.demand.setdefault(template, collections.deque()).append(time.monotonic())
        pool = self.ready.get(template)
        lv = pool.pop() if pool else None
        self.want(template)
        return lv

    def can_wait(self, template: str) -> bool:
        """Is a refill under way that no other create waits for (it is done sooner than a
        restore of our own would be)?"""
        return self.inflight.get(template, 0) > len(self.waiters.get(template, ()))

    async def wait(self, template: str, workspace_id: str) -> Live | None:
        """The sandbox of a refill under way, or None (it failed, or took longer than
        POOL_WAIT: the caller restores its own)."""
        fut: asyncio.Future[Live] = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(template, collections.deque()).append(fut)
        self.claims[workspace_id] += 1
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
            self.claims[workspace_id] -= 1
            if not self.claims[workspace_id]:
                del self.claims[workspace_id]
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters[template].remove(fut)
            elif got is None and not fut.cancelled() and fut.exception() is None:
                # given to us as we were cancelled: back into the pool
                self.ready.setdefault(template, []).append(fut.result())

    def tick(self) -> None:
        """Each second (the daemon's tick): a pool larger than its target, with no demand
        for a while, gives back one sandbox (its memory); then refills as needed."""
        now = time.monotonic()
        for template in self.cfg.pool.templates if self.cfg.pool.size > 0 else ():
            pool = self.ready.get(template)
            demand = self.demand.get(template)
            idle = not demand or now - demand[-1] > DEMAND_WINDOW
            if pool and idle and len(pool) > self._target(template):
                lv = pool.pop(0)
                self._spawn(self._kill(lv.row.id, reason="pool_discarded"))
            self.want(template)


async def run_simple(lv: Live, cmd: str, timeout: float) -> tuple[int, bytes]:
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


async def start_command(lv: Live, info: dict[str, Any], snapshot: bool = False) -> None:
    """The template's long-running start command, then its ready check (a command that
    must exit 0, or a port that must accept connections). ``snapshot``: the boot that
    makes the template snapshot; the command sees CPUOS_TEMPLATE_SNAPSHOT=1 (and may
    warm up more than a cold boot's create should wait for)."""
    start = info.get("start")
    if not start:
        return
    await run_simple(
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
        code, _ = await run_simple(lv, check, 10)
        if code == 0:
            return
        if time.monotonic() > deadline:
            _, log_tail = await run_simple(lv, "tail -c 2000 /tmp/cpuos-start.log", 10)
            raise ApiError("timeout", f"template {info.get('name')}: ready check {check!r} "
                           f"did not pass within {timeout:.0f}s; start log: "
                           f"{log_tail.decode(errors='replace')[-500:]}")
        await asyncio.sleep(0.2)
