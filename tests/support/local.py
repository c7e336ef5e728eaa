"""Tier 0: the real daemon (``build_services`` + ``create_app``, served by uvicorn on a
loopback port in a thread of the test process) over a backend whose sandboxes are the real
``cpuos_agent`` run as local processes: no root needed, no runsc, no template build.

``LocalAgentBackend`` isolates nothing (its "sandbox" sees the host's files): it exists to
test the daemon, the SDK and the agent together, fast; the proof that a sandbox contains
anything is the runsc suite (tests/e2e, tests/security). Each agent runs as PID 1 of a PID
and mount namespace of its own (``unshare``: its own /proc, and killing it ends every
process it started), as an unprivileged user: ``nobody`` when the tests run as root, else
the test's user in a user namespace. So what its identity step tries (hostname,
/etc/hosts, the clock) is refused, as for any user, and the host is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from cpuosd import procs
from cpuosd.api.app import create_app
from cpuosd.backends.base import Capabilities, SandboxSpec
from cpuosd.config import (AuditConfig, Config, IdleConfig, NetworkConfig, PoolConfig,
                           PreviewConfig)
from cpuosd.wiring import Services, build_services

from .daemon import SdkKwargs
from .fakes import FakeHost, Unmeasured

NOBODY = 65534
PYTHON = "/usr/bin/python3"  # the agent is stdlib-only; readable by nobody (not /root's)
TEMPLATE = "local"


def local_unavailable() -> str | None:
    """Why tier 0 cannot run here, or None."""
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux)"
    if not os.path.exists(PYTHON if os.geteuid() == 0 else sys.executable):
        return f"needs {PYTHON}"
    return None


class LocalAgentBackend(Unmeasured):
    """A Backend running each sandbox's agent as a local process (see the module)."""

    image_kind = "local"

    def __init__(self) -> None:
        self.capabilities = Capabilities(name="local", checkpoint=False, network=False)
        self.agents: dict[str, procs.Child] = {}

    def argv(self) -> list[str]:
        ns = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
        if os.geteuid() == 0:
            return [*ns, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                    "--clear-groups", "--inh-caps=-all", "--", PYTHON, "-s", "-m",
                    "cpuos_agent"]
        return [*ns, "--user", "--", sys.executable, "-s", "-m", "cpuos_agent"]

    def runtime(self) -> dict[str, str]:
        return {"agent": "local process"}

    async def start(self, spec: SandboxSpec) -> None:
        if os.geteuid() == 0:
            # nobody reaches its socket and the agent copy: search (not read) on the way
            for d in (spec.dir.parent.parent, spec.dir.parent, spec.dir):
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(d.stat().st_mode | 0o111)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": str(spec.agent_dir), "CPUOS_AGENT_SOCKET": str(spec.sock_path)}
        with open(spec.dir / "agent.log", "ab") as log:
            self.agents[spec.id] = procs.spawn(self.argv(), stdout=log, stderr=log, env=env,
                                               cwd="/")

    async def kill(self, sandbox_id: str) -> None:
        child = self.agents.pop(sandbox_id, None)
        if child is None:
            return
        child.killpg(signal.SIGKILL)  # unshare and its PID 1: the namespace goes with it
        child.kill()
        await child.wait(10)

    async def running(self) -> dict[str, str]:
        return {sid: "running" for sid, c in self.agents.items() if c.poll() is None}

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        raise NotImplementedError("the local backend cannot checkpoint")

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        raise NotImplementedError("the local backend cannot restore")

    async def close(self) -> None:
        """Unlike a real backend's, its sandboxes end with it: nothing would reattach."""
        for sid in list(self.agents):
            await self.kill(sid)


def local_config(home: Path) -> Config:
    """A daemon configuration for tier 0: its own home, no network, no pool or template
    snapshot (the local backend cannot checkpoint), never paused for idleness."""
    return Config(home=home, host="127.0.0.1", port=0,
                  preview=PreviewConfig(port=0), network=NetworkConfig(enabled=False),
                  pool=PoolConfig(size=0, template_snapshots=False),
                  audit=AuditConfig(runtime=False), idle=IdleConfig(timeout=0.0))


@dataclass
class LocalDaemon:
    """A running tier-0 daemon: ``url``, the admin ``key``, ``work`` (a directory its
    sandboxes' commands may write: the template's workdir and HOME), and its ``services``
    (the same objects the app serves: tests may look inside)."""

    url: str
    key: str
    work: Path
    services: Services
    backend: LocalAgentBackend

    def sdk_kwargs(self, key: str | None = None) -> SdkKwargs:
        return {"api_url": self.url, "api_key": key or self.key}


@contextlib.contextmanager
def local_daemon() -> Iterator[LocalDaemon]:
    """Start one (a thread of its own runs its event loop and uvicorn), stop it after."""
    home = Path(tempfile.mkdtemp(prefix="cpuos-t0-", dir="/tmp"))
    work = home.with_name(home.name + "-work")
    work.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(work, NOBODY, NOBODY)
    tdir = home / "templates"
    tdir.mkdir()
    (tdir / f"{TEMPLATE}.json").write_text(json.dumps({
        "name": TEMPLATE, "rootfs": "/", "digest": "0" * 16, "workdir": str(work),
        "env": {"HOME": str(work), "PATH": "/usr/local/bin:/usr/bin:/bin"}}))
    cfg = local_config(home)
    if cfg.templates_dir != tdir:
        raise RuntimeError(f"tier 0 needs its own templates ({tdir}), not "
                           f"{cfg.templates_dir}: unset CPUOS_TEMPLATES_DIR")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    backend = LocalAgentBackend()
    loop = asyncio.new_event_loop()
    started: list[Services] = []
    server: list[uvicorn.Server] = []
    failed: list[BaseException] = []
    up = threading.Event()

    async def serve() -> None:
        services = await build_services(cfg, backend=backend, measure=FakeHost())
        started.append(services)
        try:
            srv = uvicorn.Server(uvicorn.Config(create_app(cfg, services), log_level="warning",
                                                log_config=None, access_log=False,
                                                lifespan="on"))
            server.append(srv)
            task = asyncio.ensure_future(srv.serve(sockets=[sock]))
            while not srv.started and not task.done():
                await asyncio.sleep(0.01)
            up.set()
            await task
        finally:
            await services.close()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as e:  # reported by the caller
            failed.append(e)
        finally:
            up.set()
            loop.close()

    thread = threading.Thread(target=run, name="tier0-daemon", daemon=True)
    thread.start()
    try:
        up.wait(60)
        if failed or not started or not server:
            raise RuntimeError(f"the tier-0 daemon did not start: {failed!r}")
        port = sock.getsockname()[1]
        key = cfg.admin_key_path.read_text().strip()
        yield LocalDaemon(f"http://127.0.0.1:{port}", key, work, started[0], backend)
    finally:
        if server:
            server[0].should_exit = True
        thread.join(60)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the tier-0 daemon did not stop within 60 s")
        left = sorted(backend.agents)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        if failed and not isinstance(failed[0], asyncio.CancelledError):
            raise RuntimeError("the tier-0 daemon failed") from failed[0]
        if left:
            raise RuntimeError(f"agents left running: {left}")
