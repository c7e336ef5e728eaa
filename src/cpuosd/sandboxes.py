"""Sandbox lifecycle: create, exec, files, timeout reaper, kill, reconcile after restart.

States: ``creating -> running -> killing -> killed``, plus ``error``. Every
transition is written to SQLite before it is acted on, so a restarted daemon can
reconcile its records with what really runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import shlex
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cpuos_agent
from cpuos_agent import protocol as P

from .agentconn import AgentChannel, AgentGone, raise_for_agent_error
from .backends.base import Backend, SandboxSpec
from .config import Config
from .errors import ApiError, not_found
from .events import EventBus, SandboxEvent
from .lifecycle import states
from .paths import check_id
from . import procs
from .store import LIVE_STATES, SandboxRow, Store
from .templates.builder import list_templates, template_info

log = logging.getLogger("cpuosd.sandboxes")

ENTRY_TYPES = {"file", "dir", "symlink", "other"}
MAX_ENTRIES = 10000
# s a device agent (CharDeviceTransport) gets to see the host hang up after a quiesce
DEVICE_SETTLE = 0.1
# s a request waits for the agent of a running sandbox that is reconnecting
RECONNECT_GRACE = 5.0
# s a kill waits for another operation on the sandbox to let go, then for its teardown
KILL_LOCK_WAIT = 3.0
KILL_TIMEOUT = 20.0
KILL_RETRY_INTERVAL = 5.0


def _now() -> float:
    return time.time()


@dataclass
class Live:
    row: SandboxRow
    spec: SandboxSpec
    chan: AgentChannel


class Manager:
    def __init__(self, cfg: Config, store: Store, backend: Backend,
                 events: EventBus | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.backend = backend
        self.events = events or EventBus()
        self.live: dict[str, Live] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        # creates in progress (cancelled by a DELETE of their sandbox)
        self._inflight: dict[str, asyncio.Task[Any] | None] = {}
        self.pool: dict[str, list[Live]] = {}
        self._filling: dict[str, bool] = {}
        self.agent_dir = self._install_agent()
        cfg.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        # agent sockets live below: no other host user may reach (and impersonate) an agent
        cfg.sandboxes_dir.chmod(0o700)

    # ---- setup ----------------------------------------------------------------------
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
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        return dest

    def _prune_agents(self) -> None:
        """Agent copies other than the current one, once no live sandbox mounts them."""
        if self.store.list_sandboxes(states=LIVE_STATES):
            return  # a reattached or paused sandbox may still use an older copy
        for d in self.agent_dir.parent.iterdir():
            if d != self.agent_dir:
                shutil.rmtree(d, ignore_errors=True)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    def _spec(self, row: SandboxRow) -> SandboxSpec:
        s = row.spec
        return SandboxSpec(id=row.id, rootfs=Path(s["rootfs"]), dir=self.cfg.sandboxes_dir / row.id,
                           agent_dir=self.agent_dir, vcpus=s["vcpus"], memory_mib=s["memory_mib"],
                           hostname=s.get("hostname", "sandbox"), env=s.get("env", {}))

    async def startup(self) -> None:
        self.cfg.snapshots_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.snapshots_dir.chmod(0o700)
        await self.reconcile()
        self._spawn(self._reaper())
        self._spawn(procs.reap_loop())  # the runsc/QEMU processes we adopted
        if self.cfg.pool_size > 0 and template_info(self.cfg.templates_dir, "python"):
            self._spawn(self._fill_pool("python"))

    async def shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for pool in self.pool.values():  # pooled sandboxes belong to no one: end them
            while pool:
                await self.kill(pool.pop().row.id, reason="pool_discarded")
        for lv in list(self.live.values()):
            await lv.chan.close()  # sandboxes keep running; a restarted daemon reattaches
        await self.backend.close()

    # ---- reconcile ------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Make SQLite and the host agree after a (possibly unclean) restart."""
        actual = await self.backend.running()
        keep: set[str] = set()
        for row in self.store.list_sandboxes(states=LIVE_STATES):
            alive = actual.get(row.id) == "running"
            snap = self._snap(row.id)
            if alive and row.state in ("running", "pausing", "resuming"):
                # a pause that did not get to checkpoint, or a resume that did: running
                await self._reattach(row)
                keep.add(row.id)
                if row.state != "running":
                    # a paused row has no deadline: it gets back the time it had left
                    deadline = row.deadline or _now() + float(
                        row.remaining or row.spec.get("timeout") or self.cfg.default_timeout)
                    self._set_state(row.id, "running", deadline=deadline)
                    log.info("sandbox %s was %s at restart: running", row.id, row.state)
                    row.state, row.deadline = "running", deadline
                continue
            if alive:
                await self.backend.kill(row.id)
            has_snap = (snap / "checkpoint.img").exists()
            tmp = snap.with_name("." + snap.name + ".tmp")
            if row.state == "pausing" and not has_snap and (tmp / "checkpoint.img").exists() \
                    and (tmp / "checkpoint.img").stat().st_size > 0:
                # the daemon died after runsc wrote the image but before it was renamed
                os.rename(tmp, snap)
                has_snap = True
            if row.state in ("paused", "pausing", "resuming") and has_snap:
                if row.state != "paused":
                    left = row.remaining or max(1.0, (row.deadline or _now()) - _now())
                    self._set_state(row.id, "paused", paused_at=_now(),
                                              remaining=left, deadline=None,
                                              snapshot_bytes=_du(snap))
                continue
            reason = {"running": "lost", "paused": "snapshot_lost", "pooled": "pool_discarded",
                      "killing": row.reason or "killed"}.get(row.state, "interrupted")
            self._finish(row.id, "killed" if row.state in ("killing", "pooled") else "error",
                         reason)
        for cid in actual:
            if cid not in keep:
                log.warning("killing runsc sandbox %s that has no live record", cid)
                await self.backend.kill(cid)
        for d in self.cfg.sandboxes_dir.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
        paused = {r.id for r in self.store.list_sandboxes(states=("paused",))}
        for d in self.cfg.snapshots_dir.iterdir():
            if d.name != "templates" and d.name not in paused:
                shutil.rmtree(d, ignore_errors=True)
        # template images of older builds or older agents are never restored again
        current = {self._template_image_name(t["name"], t["digest"])
                   for t in list_templates(self.cfg.templates_dir)}
        tdir = self.cfg.snapshots_dir / "templates"
        for d in tdir.iterdir() if tdir.is_dir() else ():
            if d.name not in current:
                shutil.rmtree(d, ignore_errors=True)
        self._prune_agents()

    async def _reattach(self, row: SandboxRow) -> None:
        lv = Live(row, self._spec(row), AgentChannel(self._spec(row).sock_path,
                                                     row.spec.get("agent_key")))
        self.live[row.id] = lv
        await lv.chan.listen()
        lv.chan.on_disconnect.append(lambda sid=row.id: self._on_disconnect(sid))
        self._spawn(self._await_reattach(row.id))
        log.info("reattaching to sandbox %s", row.id)

    async def _await_reattach(self, sid: str) -> None:
        lv = self.live.get(sid)
        if lv is None:
            return
        try:
            await lv.chan.wait_connected(self.cfg.agent_connect_timeout)
        except ApiError:
            log.warning("sandbox %s: agent did not reconnect; killing it", sid)
            await self.kill(sid, reason="lost", final_state="error")

    def _on_disconnect(self, sid: str) -> None:
        self._spawn(self._check_alive(sid))

    async def _check_alive(self, sid: str) -> None:
        """The agent dropped its connection: it reconnects unless the sandbox died."""
        await asyncio.sleep(2.0)
        lv = self.live.get(sid)
        if lv is None or lv.chan.connected or lv.row.state != "running":
            return
        row = self.store.get_sandbox(sid)
        if row is None or row.state != "running":
            return
        state = (await self.backend.running()).get(sid)
        if state != "running":
            await self.kill(sid, reason="exited", final_state="error")

    # ---- lifecycle ------------------------------------------------------------------
    def _snap(self, sid: str) -> Path:
        return self.cfg.snapshots_dir / sid

    def _new_row(self, workspace_id: str, template: str, info: dict[str, Any], timeout: float,
                 metadata: dict[str, str], env: dict[str, str], vcpus: int, memory_mib: int,
                 state: str = "creating", on_timeout: str = "kill") -> SandboxRow:
        sid = "sbx-" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                               for _ in range(12))
        now = _now()
        row = SandboxRow(
            id=sid, workspace_id=workspace_id, template=template,
            backend=self.backend.capabilities.name, state=state, reason=None,
            created_at=now, started_at=None, ended_at=None, deadline=now + timeout,
            spec={"rootfs": info["rootfs"], "template_digest": info["digest"], "vcpus": vcpus,
                  "memory_mib": memory_mib, "hostname": "sandbox", "env": env,
                  "timeout": timeout, "machine_id": secrets.token_hex(16),
                  "template_env": info.get("env") or {}, "workdir": info.get("workdir")},
            metadata=metadata, on_timeout=on_timeout,
        )
        self.store.insert_sandbox(row)
        return row

    async def _boot(self, row: SandboxRow, image: Path | None, *,
                    template_boot: bool = False) -> Live:
        """Start (image None) or restore a sandbox for row; returns it with its agent
        connected and told who it is. On failure everything made for it is removed and
        the error raised."""
        spec = self._spec(row)
        key = self._agent_key(row, image)
        chan = AgentChannel(spec.sock_path, key)
        spec.template_boot, spec.adopt = template_boot, chan.adopt
        lv = Live(row, spec, chan)
        self.live[row.id] = lv
        try:
            spec.sock_dir.mkdir(parents=True, exist_ok=True)
            # Per sandbox, also after a restore: templates link /etc/machine-id here.
            mid = row.spec.setdefault("machine_id", secrets.token_hex(16))
            (spec.sock_dir / "machine-id").write_text(mid + "\n")
            (spec.sock_dir / "machine-id").chmod(0o444)
            key_file = spec.sock_dir / P.KEY_PATH.rsplit("/", 1)[1]
            if key is not None and image is None:
                # read once by the agent at start; removed at its hello, before any command
                fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o444)
                with os.fdopen(fd, "w") as f:
                    f.write(key)
            await chan.listen()
            t0 = time.monotonic()
            if image is None:
                await self.backend.start(spec)
            else:
                await self.backend.restore(spec, image)
            t1 = time.monotonic()
            await chan.wait_connected(self.cfg.agent_connect_timeout)
            key_file.unlink(missing_ok=True)
            t2 = time.monotonic()
            await self._identity(lv)
            log.info("%s of %s: backend %.0f ms, agent hello %.0f ms, identity %.0f ms",
                     "boot" if image is None else "restore", row.id, (t1 - t0) * 1e3,
                     (t2 - t1) * 1e3, (time.monotonic() - t2) * 1e3)
        except BaseException:
            await self._teardown(row.id)
            raise
        chan.on_disconnect.append(lambda: self._on_disconnect(row.id))
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
        key = key or row.spec.get("agent_key") or secrets.token_hex(32)
        row.spec["agent_key"] = key
        return key

    @staticmethod
    def _save_agent_key(lv: Live, image_dir: Path) -> None:
        key = lv.row.spec.get("agent_key")
        if key:
            fd = os.open(image_dir / "agent.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key)

    async def _identity(self, lv: Live) -> None:
        """New for every boot, restore and clone: hostname (the sandbox id), machine-id,
        randomness for the guest's RNG and the time (cpuos_agent.agent.apply_identity)."""
        h = await lv.chan.call({"t": "identity", "hostname": lv.row.id,
                                "machine_id": lv.row.spec["machine_id"],
                                "seed": secrets.token_hex(64), "time": time.time()},
                               timeout=30)
        raise_for_agent_error(h)
        log.debug("identity of %s: %s", lv.row.id, h.get("applied"))

    def _mark_running(self, row: SandboxRow, timeout: float) -> None:
        started = _now()
        row.deadline = started + timeout
        row.started_at = row.started_at or started
        self._set_state(row.id, "running", started_at=row.started_at,
                        deadline=row.deadline, workspace_id=row.workspace_id,
                        spec=row.spec, metadata=row.metadata, on_timeout=row.on_timeout)
        row.state = "running"

    async def create(self, workspace_id: str, template: str, timeout: float,
                     metadata: dict[str, str], env: dict[str, str], vcpus: int,
                     memory_mib: int, on_timeout: str = "kill") -> SandboxRow:
        info = template_info(self.cfg.templates_dir, template)
        if info is None:
            raise ApiError("not_found", f"template {template!r} is not built; run "
                           f"`cpuos template build {template}` on the daemon's host",
                           {"template": template})
        default_size = (vcpus, memory_mib) == (self.cfg.default_vcpus,
                                              self.cfg.default_memory_mib)
        pool = self.pool.get(template)
        if default_size and pool:
            lv = pool.pop()  # no await between the check and the pop: handed out once
            self._spawn(self._fill_pool(template))
            row = lv.row
            row.workspace_id, row.metadata, row.on_timeout = workspace_id, metadata, on_timeout
            row.spec = {**row.spec, "env": env, "timeout": timeout}
            lv.spec.env = env
            self._mark_running(row, timeout)
            return row
        image = await self._template_image(template, info) if default_size else None
        row = self._new_row(workspace_id, template, info, timeout, metadata, env, vcpus,
                            memory_mib, on_timeout=on_timeout)
        async with self._lock(row.id):
            self._inflight[row.id] = asyncio.current_task()
            try:
                await self._boot_or_fallback(row, image, info)
            except BaseException as e:
                await self._teardown(row.id)
                why = "cancelled (deleted while creating)" if isinstance(
                    e, asyncio.CancelledError) else str(e)
                self._finish(row.id, "error", f"create failed: {why}"[:500])
                raise
            finally:
                self._inflight.pop(row.id, None)
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
                except ApiError as e:
                    log.warning("restore of %s from %s failed (attempt %d): %s", row.id,
                                image.name, attempt, e.message)
            log.warning("sandbox %s: restores failed; booting it instead", row.id)
            row.spec.pop("agent_key", None)  # a cold boot's agent gets a key of its own
        lv = await self._boot(row, None)
        await self._start_command(lv, info)
        return lv

    # ---- template snapshots and the warm pool -----------------------------------------
    def _template_image_name(self, template: str, digest: str) -> str:
        """A template image is of one template build, one agent and one kind of machine
        (an image of another backend, accelerator or device set never restores)."""
        return f"{template}-{digest}-{self.agent_dir.name}-{self.backend.image_kind}"

    async def _template_image(self, template: str, info: dict[str, Any]) -> Path | None:
        """The template booted once and checkpointed; made on first use. None when
        snapshots are off or could not be made (create then boots)."""
        if not self.cfg.template_snapshots or not self.backend.capabilities.checkpoint:
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

    async def _make_template_image(self, template: str, info: dict[str, Any], d: Path) -> None:
        t0 = time.monotonic()
        row = SandboxRow(id="tpl-" + secrets.token_hex(6), workspace_id="", template=template,
                         backend=self.backend.capabilities.name, state="creating", reason=None,
                         created_at=_now(), started_at=None, ended_at=None, deadline=None,
                         spec={"rootfs": info["rootfs"], "vcpus": self.cfg.default_vcpus,
                               "memory_mib": self.cfg.default_memory_mib,
                               "hostname": "sandbox", "env": {},
                               "machine_id": secrets.token_hex(16),
                               "template_env": info.get("env") or {},
                               "workdir": info.get("workdir")},
                         metadata={})
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            lv = await self._boot(row, None, template_boot=True)
            await self._start_command(lv, info)
            await self._quiesce(lv)
            await self.backend.checkpoint(row.id, tmp)
            self._save_agent_key(lv, tmp)
            os.rename(tmp, d)
        finally:
            await self._teardown(row.id)
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("template %s snapshotted in %.2fs", template, time.monotonic() - t0)

    async def _fill_pool(self, template: str) -> None:
        if self._filling.get(template):
            return
        self._filling[template] = True
        try:
            info = template_info(self.cfg.templates_dir, template)
            ws = self.store.workspace_by_name("default")
            pool = self.pool.setdefault(template, [])
            while info and ws and len(pool) < self.cfg.pool_size:
                image = await self._template_image(template, info)
                if image is None:
                    return
                row = self._new_row(ws, template, info, self.cfg.default_timeout, {}, {},
                                    self.cfg.default_vcpus, self.cfg.default_memory_mib,
                                    state="pooled")
                try:
                    lv = await self._boot(row, image)
                except Exception:
                    log.exception("warm pool: restoring %s failed", template)
                    self._finish(row.id, "error", "pool restore failed")
                    return
                pool.append(lv)
        finally:
            self._filling[template] = False

    async def _run_simple(self, lv: Live, cmd: str, timeout: float) -> tuple[int, bytes]:
        """Run a shell line in the sandbox for the daemon itself: (exit code, output tail)."""
        st = lv.chan.open()
        try:
            await st.send({"t": "exec", "shell": cmd, "env": _base_env(lv.row), "cwd": "/",
                           "timeout": timeout, "stdin": False})
            out = b""
            while True:
                h, payload = await st.get(timeout + 10)
                raise_for_agent_error(h)
                if h["t"] == "out":
                    out = (out + payload)[-4000:]
                elif h["t"] == "exit":
                    code = h.get("exit_code")
                    return (code if isinstance(code, int) else -1), out
        except TimeoutError:
            raise ApiError("timeout", f"{cmd!r} did not finish in the sandbox") from None
        finally:
            st.close()

    async def _start_command(self, lv: Live, info: dict[str, Any]) -> None:
        """The template's long-running start command, then its ready check (a command that
        must exit 0, or a port that must accept connections)."""
        start = info.get("start")
        if not start:
            return
        await self._run_simple(
            lv, f"cd {shlex.quote(lv.row.spec.get('workdir') or '/')} && "
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

    # ---- pause / resume / fork ------------------------------------------------------
    async def _quiesce(self, lv: Live) -> None:
        """Have the agent drop its connection (a checkpoint cannot carry it); the socket
        is removed first, so it can only come back once we listen again."""
        if lv.chan.streams:
            raise ApiError("conflict", "commands or file transfers are still running in the "
                           "sandbox; wait for them to finish")
        lv.chan.stop_listening()
        try:
            await lv.chan.call({"t": "quiesce"}, timeout=10)
            if (lv.chan.hello or {}).get("transport") == "device":
                # a device agent (microVM) cannot hang up: we do, and give it the moment
                # it needs to see that (else a restored copy would wait for it)
                lv.chan.disconnect()
                await asyncio.sleep(DEVICE_SETTLE)
            else:
                try:  # a socket agent closes its end
                    await lv.chan.wait_disconnected(1.0)
                except ApiError:
                    lv.chan.disconnect()
        except BaseException as e:
            await lv.chan.listen()  # the agent keeps retrying: it comes back
            await lv.chan.wait_connected(self.cfg.agent_connect_timeout)
            if isinstance(e, ApiError) and e.code == "already_exists":
                raise ApiError("conflict", e.message) from None
            raise

    def _check_space(self, sid: str, where: Path) -> None:
        need = (self.backend.memory_usage(sid) or 0) + self.cfg.snapshot_margin
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
        self._set_state(sid, "pausing")
        try:
            await self._quiesce(lv)
        except BaseException:
            self._set_state(sid, "running")
            raise
        tmp = image.with_name("." + image.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        t1 = time.monotonic()
        try:
            await self.backend.checkpoint(sid, tmp)
            self._save_agent_key(lv, tmp)
            os.rename(tmp, image)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            await self._teardown(sid)
            msg = e.message if isinstance(e, ApiError) else str(e)
            self._finish(sid, "error", f"checkpoint failed: {msg}"[:500])
            raise
        t2 = time.monotonic()
        await self._teardown(sid)
        log.info("checkpoint of %s: quiesce %.0f ms, runsc checkpoint %.0f ms, teardown %.0f ms",
                 sid, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.monotonic() - t2) * 1e3)

    async def pause(self, workspace_id: str, sid: str) -> SandboxRow:
        async with self._lock(sid):
            lv = self.running(workspace_id, sid, "pause")
            remaining = max(1.0, (lv.row.deadline or _now()) - _now())
            await self._checkpoint(lv, self._snap(sid))
            size = _du(self._snap(sid))
            self._set_state(sid, "paused", paused_at=_now(), remaining=remaining,
                                      snapshot_bytes=size, deadline=None)
        return self.get(workspace_id, sid)

    async def resume(self, workspace_id: str, sid: str) -> SandboxRow:
        async with self._lock(sid):
            row = self.get(workspace_id, sid)
            states.check("resume", sid, row.state, row.reason)
            if row.state == "running":
                return row
            snap = self._snap(sid)
            self._set_state(sid, "resuming")
            try:
                await self._boot(row, snap)
            except BaseException:
                self._set_state(sid, "paused")  # the snapshot is still good
                raise
            self._mark_running(row, row.remaining or row.spec.get("timeout") or 300.0)
            self.store.update_sandbox(sid, paused_at=None, remaining=None, snapshot_bytes=None)
            shutil.rmtree(snap, ignore_errors=True)
        return self.get(workspace_id, sid)

    async def fork(self, workspace_id: str, sid: str, n: int) -> list[SandboxRow]:
        """n new sandboxes with the memory, processes and files of sid (which keeps running):
        checkpoint once, restore n + 1 times."""
        async with self._lock(sid):
            lv = self.running(workspace_id, sid, "fork")
            row = lv.row
            image = self.cfg.snapshots_dir / f"fork-{sid}-{secrets.token_hex(4)}"
            remaining = max(1.0, (row.deadline or _now()) - _now())
            try:
                await self._checkpoint(lv, image)
                self._set_state(sid, "resuming")
                try:
                    await self._boot(row, image)
                except BaseException as e:
                    self._finish(sid, "error", f"restore after fork failed: {e}"[:500])
                    raise
                self._mark_running(row, remaining)
                info = {"rootfs": row.spec["rootfs"], "digest": row.spec.get("template_digest")}
                clones = []
                for _ in range(n):
                    c = self._new_row(workspace_id, row.template, info, remaining, row.metadata,
                                      row.spec.get("env", {}), row.spec["vcpus"],
                                      row.spec["memory_mib"], on_timeout=row.on_timeout)
                    try:
                        await self._boot(c, image)
                    except BaseException as e:
                        self._finish(c.id, "error", f"fork restore failed: {e}"[:500])
                        raise
                    self._mark_running(c, remaining)
                    clones.append(c)
            finally:
                shutil.rmtree(image, ignore_errors=True)
        return clones

    # ---- lookups, timeouts, kill ----------------------------------------------------
    def get(self, workspace_id: str, sid: str) -> SandboxRow:
        check_id(sid)
        row = self.store.get_sandbox(sid)
        if row is None or row.workspace_id != workspace_id or row.state == "pooled":
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
        """A running sandbox whose agent is connected; waits a little for one that is
        reconnecting (a restarted daemon: a microVM's QEMU redials once a second)."""
        lv = self.running(workspace_id, sid, op)
        if not lv.chan.connected:
            with contextlib.suppress(ApiError):
                await lv.chan.wait_connected(RECONNECT_GRACE)
        return lv

    def set_timeout(self, workspace_id: str, sid: str, timeout: float) -> SandboxRow:
        row = self.get(workspace_id, sid)
        states.check("set_timeout", sid, row.state, row.reason)
        if row.state == "paused":
            self.store.update_sandbox(sid, remaining=timeout)
            return self.get(workspace_id, sid)
        lv = self.running(workspace_id, sid, "set_timeout")
        deadline = _now() + timeout
        self.store.update_sandbox(sid, deadline=deadline)
        lv.row.deadline = deadline
        return self.get(workspace_id, sid)

    async def kill(self, sid: str, reason: str = "killed", final_state: str = "killed") -> None:
        """Returns within about KILL_LOCK_WAIT + KILL_TIMEOUT in every state: a create in
        progress is cancelled; an operation that holds the sandbox longer is not waited
        for; a teardown that overruns leaves the row in error with that reason."""
        task = self._inflight.get(sid)
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
            self._set_state(sid, "killing", reason=reason)
            try:
                await asyncio.wait_for(self._teardown(sid), KILL_TIMEOUT)
            except TimeoutError:
                log.error("kill of %s: teardown did not finish in %.0fs", sid, KILL_TIMEOUT)
                self._finish(sid, "error", f"kill timed out after {KILL_TIMEOUT:.0f}s")
                self._spawn(self._retry_teardown(sid))
                return
            shutil.rmtree(self._snap(sid), ignore_errors=True)
            self._finish(sid, final_state, reason)
        finally:
            if locked:
                lock.release()

    async def _retry_teardown(self, sid: str, attempts: int = 12) -> None:
        """A teardown that overran is tried again in the background (a restarted daemon's
        reconcile also ends any runsc sandbox without a live record)."""
        for _ in range(attempts):
            await asyncio.sleep(KILL_RETRY_INTERVAL)
            try:
                await asyncio.wait_for(self._teardown(sid), KILL_TIMEOUT)
                log.info("kill of %s: teardown finished on a retry", sid)
                return
            except Exception as e:
                log.warning("kill of %s: retry failed: %s", sid, e)

    async def _teardown(self, sid: str) -> None:
        lv = self.live.pop(sid, None)
        if lv is not None:
            await lv.chan.close()
        await self.backend.kill(sid)
        shutil.rmtree(self.cfg.sandboxes_dir / sid, ignore_errors=True)

    def _set_state(self, sid: str, to: str, **fields: Any) -> None:
        """The one way a sandbox changes state: checked against the table
        (lifecycle.states), written to SQLite before anything acts on it, published as an
        event."""
        row = self.store.get_sandbox(sid)
        frm = row.state if row is not None else None
        if frm is not None and frm != to:
            states.check_transition(frm, to)
        self.store.update_sandbox(sid, state=to, **fields)
        lv = self.live.get(sid)
        if lv is not None:
            lv.row.state = to
        if row is not None and frm != to:
            self.events.emit(SandboxEvent(
                to, sid, str(fields.get("workspace_id") or row.workspace_id), frm,
                fields={k: v for k, v in fields.items()
                        if k in ("reason", "deadline", "remaining", "snapshot_bytes")}))

    def _finish(self, sid: str, state: str, reason: str) -> None:
        self._set_state(sid, state, reason=reason, ended_at=_now())
        self._locks.pop(sid, None)

    async def _reaper(self) -> None:
        """Deadlines: each expired sandbox is handled in a task of its own, so one slow or
        stuck kill never holds up another workspace's deadlines."""
        expiring: set[str] = set()
        while True:
            await asyncio.sleep(self.cfg.reaper_interval)
            for sid, on_timeout in self.store.expired(_now()):
                if sid in expiring:
                    continue
                expiring.add(sid)
                self._spawn(self._expire(sid, on_timeout, expiring))

    async def _expire(self, sid: str, on_timeout: str, expiring: set[str]) -> None:
        log.info("sandbox %s reached its deadline (%s)", sid, on_timeout)
        try:
            if on_timeout == "pause":
                row = self.store.get_sandbox(sid)
                if row is not None:
                    try:
                        await self.pause(row.workspace_id, sid)
                        self.store.update_sandbox(sid, remaining=row.spec.get("timeout"))
                        return
                    except ApiError as e:
                        log.warning("auto-pause of %s failed (%s); killing", sid, e)
            await self.kill(sid, reason="timeout")
        except Exception:
            log.exception("deadline handling failed on %s", sid)
        finally:
            expiring.discard(sid)

    # ---- exec -----------------------------------------------------------------------
    async def exec_start(self, lv: Live, cmd: str | list[str], env: dict[str, str],
                         cwd: str | None,
                         timeout: float | None, stdin: bytes | None
                         ) -> AsyncIterator[bytes]:
        """Start a command; returns the frame stream for the HTTP response.

        Errors that happen before the command runs raise ApiError (a proper HTTP
        status); everything after is reported inside the stream.
        """
        eid = "exe-" + secrets.token_hex(6)
        st = lv.chan.open()
        try:
            target = {"shell": cmd} if isinstance(cmd, str) else {"argv": cmd}
            cwd = cwd or lv.row.spec.get("workdir") or "/work"
            await st.send({"t": "exec", **target, "env": {**_base_env(lv.row), **env},
                           "cwd": cwd, "timeout": timeout, "stdin": stdin is not None})
            if stdin is not None:
                for i in range(0, len(stdin), P.CHUNK):
                    await st.send({"t": "stdin"}, stdin[i:i + P.CHUNK])
                await st.send({"t": "stdin"})
            h, _ = await st.get(15.0)
            raise_for_agent_error(h)
            if h["t"] != "started":
                raise ApiError("internal", f"unexpected agent answer {h['t']!r}")
        except TimeoutError:
            st.close()
            raise ApiError("timeout", "sandbox agent did not start the command") from None
        except BaseException:
            st.close()
            raise
        self.store.insert_exec(eid, lv.row.id, ["/bin/bash", "-c", cmd] if isinstance(cmd, str)
                               else cmd)
        return self._exec_frames(lv, st, eid, timeout)

    async def _exec_frames(self, lv: Live, st: Any, eid: str, timeout: float | None
                           ) -> AsyncIterator[bytes]:
        t0 = time.monotonic()
        counts = {1: 0, 2: 0}
        done = False
        result: dict[str, Any] = {}
        try:
            yield P.encode({"t": "started", "exec_id": eid})
            # The agent enforces the timeout; the host allows a grace period on top.
            host_deadline = None if timeout is None else t0 + timeout + 10.0
            while True:
                wait = None if host_deadline is None else max(0.1, host_deadline - time.monotonic())
                try:
                    h, payload = await st.get(wait)
                except TimeoutError:
                    result = {"t": "error", "code": "timeout",
                              "message": "command did not finish after its timeout"}
                    yield P.encode(result)
                    break
                t = h["t"]
                if t == "out":
                    fd = h.get("fd")
                    if fd not in (1, 2):
                        continue
                    counts[fd] += len(payload)
                    yield P.encode({"t": "out", "fd": fd}, payload)
                elif t == "exit":
                    result = _exit_frame(h, time.monotonic() - t0)
                    yield P.encode(result)
                    done = True
                    break
                elif t == "err":
                    raise_for_agent_error(h)
        except AgentGone:
            row = self.store.get_sandbox(lv.row.id)
            why = f"sandbox is {row.state} ({row.reason})" if row and row.state != "running" \
                else "sandbox agent disconnected"
            result = {"t": "error", "code": "unavailable", "message": why}
            yield P.encode(result)
        except ApiError as e:
            result = {"t": "error", "code": e.code, "message": e.message}
            yield P.encode(result)
        finally:
            if not done:
                # client went away or we gave up: kill the command's whole tree
                with contextlib.suppress(Exception):
                    self._spawn(lv.chan.send({"t": "kill", "id": st.id, "reason": "cancelled"}))
            st.close()
            self.store.finish_exec(
                eid, exit_code=result.get("exit_code"), signal=result.get("signal"),
                timed_out=int(bool(result.get("timed_out"))), error=result.get("message"),
                stdout_bytes=counts[1], stderr_bytes=counts[2])

    # ---- files ----------------------------------------------------------------------
    async def write_file(self, lv: Live, path: str, body: AsyncIterator[bytes]) -> dict[str, Any]:
        st = lv.chan.open()
        try:
            await st.send({"t": "write", "path": path})
            async for chunk in body:
                for i in range(0, len(chunk), P.CHUNK):
                    if not st.queue.empty():  # the agent refused early (e.g. permission)
                        h, _ = await st.get()
                        raise_for_agent_error(h)
                    await st.send({"t": "data"}, chunk[i:i + P.CHUNK])
            await st.send({"t": "eof"})
            h, _ = await st.get(120.0)
            raise_for_agent_error(h)
            return _clean_stat(h.get("stat"), path)
        except TimeoutError:
            raise ApiError("timeout", f"sandbox agent did not finish writing {path}") from None
        except BaseException:
            with contextlib.suppress(Exception):
                self._spawn(lv.chan.send({"t": "eof", "id": st.id, "abort": True}))
            raise
        finally:
            st.close()

    async def read_file(self, lv: Live, path: str) -> AsyncIterator[bytes]:
        st = lv.chan.open()
        try:
            await st.send({"t": "read", "path": path})
            h, _ = await st.get(30.0)
            raise_for_agent_error(h)
        except TimeoutError:
            st.close()
            raise ApiError("timeout", f"sandbox agent did not open {path}") from None
        except BaseException:
            st.close()
            raise

        async def gen() -> AsyncIterator[bytes]:
            try:
                while True:
                    h, payload = await st.get(60.0)
                    if h["t"] == "data":
                        yield payload
                    elif h["t"] == "eof":
                        return
                    else:
                        raise_for_agent_error(h)
                        raise ApiError("internal", f"unexpected agent frame {h['t']!r}")
            finally:
                st.close()

        return gen()

    async def file_call(self, lv: Live, op: str, path: str, **extra: Any) -> Any:
        h = await lv.chan.call({"t": op, "path": path, **extra})
        if op == "list":
            entries = h.get("entries")
            if not isinstance(entries, list):
                raise ApiError("internal", "sandbox agent sent a malformed listing")
            return [_clean_stat(e, None, parent=path) for e in entries[:MAX_ENTRIES]]
        if op in ("stat", "mkdir"):
            return _clean_stat(h.get("stat"), path)
        return None


def _base_env(row: SandboxRow) -> dict[str, str]:
    """A command's environment before its own: defaults, the template's, the sandbox's."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/home/user", "USER": "user", "LANG": "C.UTF-8", "TERM": "xterm",
           "HOSTNAME": row.id}
    env.update(row.spec.get("template_env") or {})
    env.update(row.spec.get("env") or {})
    return env


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _exit_frame(h: P.Header, duration: float) -> dict[str, Any]:
    """Rebuild the agent's exit report from checked fields only."""
    code = h.get("exit_code")
    sig = h.get("signal")
    return {
        "t": "exit",
        "exit_code": code if isinstance(code, int) and -1 <= code <= 255 else -1,
        "signal": sig if isinstance(sig, int) and 0 < sig < 128 else None,
        "timed_out": h.get("timed_out") is True,
        "killed": h.get("killed") is True,
        "duration": round(duration, 6),
    }


def _clean_stat(d: Any, path: str | None, parent: str | None = None) -> dict[str, Any]:
    """Rebuild an entry from the agent with checked fields; never pass its data through."""
    if not isinstance(d, dict):
        raise ApiError("internal", "sandbox agent sent a malformed entry")
    name = d.get("name")
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 255 or (
            "/" in name and name != "/"):
        raise ApiError("internal", "sandbox agent sent a malformed file name")
    if path is None:
        path = (parent.rstrip("/") if parent else "") + "/" + name
    size, mode, mtime = d.get("size"), d.get("mode"), d.get("mtime")
    out: dict[str, Any] = {
        "name": name,
        "path": path,
        "type": d.get("type") if d.get("type") in ENTRY_TYPES else "other",
        "size": size if isinstance(size, int) and size >= 0 else 0,
        "mode": mode if isinstance(mode, int) and 0 <= mode <= 0o7777 else 0,
        "mtime": float(mtime) if isinstance(mtime, (int, float)) else 0.0,
    }
    target = d.get("target")
    if out["type"] == "symlink" and isinstance(target, str):
        out["target"] = target[:4096]
    return out
