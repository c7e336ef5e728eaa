"""Networking attached to the backend contract: ``Networked`` wraps a backend so that every
sandbox it starts or restores gets a network namespace of its own (attached to the daemon's
Network with the sandbox's policy, ``spec.network``) and loses it when it stops, is
checkpointed or killed. The lifecycle calls the same five methods as before.

Each sandbox's attachment is written to ``<sandbox dir>/net.json`` (namespace index and
policy) so that a restarted daemon adopts the namespaces of the sandboxes still running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from ..backends.base import Backend, Capabilities, SandboxSpec
from ..templates.oci import resolve_in_root
from ..templates.spec import TemplateError
from .policy import Policy
from .service import Network

log = logging.getLogger("cpuosd.network")
MAX_CA_BUNDLE = 4 << 20


def template_ca_bundle(rootfs: Path) -> str:
    """The template's CA bundle, read as the sandbox would see it: its links resolved inside
    the tree (a template built from an untrusted Dockerfile or image may make it a link to
    a host file), a regular file only, bounded; "" if there is none."""
    try:
        path = resolve_in_root(rootfs, "etc/ssl/certs/ca-certificates.crt")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, TemplateError):
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MAX_CA_BUNDLE).decode(errors="replace")
    finally:
        os.close(fd)


class Networked:
    def __init__(self, inner: Backend, net: Network, sandboxes_dir: Path) -> None:
        self.inner = inner
        self.net = net
        self.sandboxes_dir = sandboxes_dir
        self.capabilities: Capabilities = dataclasses.replace(inner.capabilities,
                                                              network=True)
        # an image made with a network namespace restores only into one
        self.image_kind = f"{inner.image_kind}-net"
        self._adopted = False
        self._specs: dict[str, SandboxSpec] = {}  # of attached sandboxes (their CA's place)

    def runtime(self) -> dict[str, str]:
        return {**self.inner.runtime(), "network": "per-sandbox netns",
                "uplink": self.net.uplink.netns or "host"}

    def _state(self, sid: str) -> Path:
        return self.sandboxes_dir / sid / "net.json"

    async def _attach(self, spec: SandboxSpec) -> None:
        policy = Policy.stored(spec.network)
        if policy.ca:
            self._place_ca(spec, policy.ca)
        slot = await self.net.attach(spec.id, policy)
        self._specs[spec.id] = spec
        spec.netns = slot.netns_path
        spec.address, spec.gateway, spec.prefix = slot.address, slot.gateway, 30
        spec.dir.mkdir(parents=True, exist_ok=True)
        self._state(spec.id).write_text(json.dumps({"index": slot.index,
                                                    "policy": policy.to_json()}))

    def _place_ca(self, spec: SandboxSpec, ca_id: str) -> None:
        """The sandbox's CA, and the template's CA bundle with it, where the sandbox reads
        them (/run/cpuos, read-only to its commands): what its TLS clients trust."""
        pem = self.net.secrets.ca_cert_pem(ca_id)
        if pem is None:
            log.warning("sandbox %s: its CA %s is gone; its secrets will not work", spec.id,
                        ca_id)
            return
        spec.ca_pem = pem
        spec.sock_dir.mkdir(parents=True, exist_ok=True)
        system = template_ca_bundle(spec.rootfs)
        for name, text in (("ca.pem", pem), ("ca-bundle.pem", system.rstrip() + "\n" + pem)):
            # the directory is the sandbox's /run/cpuos: never follow what may be there
            tmp = spec.sock_dir / f".{name}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
            os.fchmod(fd, 0o444)  # read by the sandbox's user, whatever the daemon's umask
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, spec.sock_dir / name)

    # a start or restore that failed (or was cancelled) may leave its sandbox running until
    # the caller's teardown kills it, holding the namespace: it is removed in the
    # background (Network.detach_later), once that sandbox is gone
    async def start(self, spec: SandboxSpec) -> None:
        await self._attach(spec)
        try:
            await self.inner.start(spec)
        except BaseException:
            self.net.detach_later(spec.id)
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        await self._attach(spec)
        try:
            await self.inner.restore(spec, image_dir)
        except BaseException:
            self.net.detach_later(spec.id)
            raise

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        try:
            await self.inner.checkpoint(sandbox_id, image_dir)
        finally:  # the sandbox has stopped either way; a restore gets a new namespace
            self._specs.pop(sandbox_id, None)
            self.net.detach_later(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        try:
            await self.inner.kill(sandbox_id)
        finally:
            self._specs.pop(sandbox_id, None)
            self.net.detach_later(sandbox_id)

    async def running(self) -> dict[str, str]:
        live = await self.inner.running()
        if not self._adopted:  # the first call, at start-up: adopt, then sweep
            self._adopted = True
            for sid in live:
                if sid in self.net.by_sid:
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    st = json.loads(self._state(sid).read_text())
                    if await self.net.adopt(sid, int(st["index"]),
                                            Policy.stored(st.get("policy"))):
                        log.info("network of %s adopted (namespace %d)", sid, st["index"])
            gone = await self.net.remove_strays()
            if gone:
                log.info("removed %d network namespace(s) no sandbox holds", gone)
        return live

    async def set_network(self, sandbox_id: str, policy: dict[str, Any]) -> None:
        """A running sandbox's policy changes: new connections follow it."""
        p = Policy.stored(policy)
        spec = self._specs.get(sandbox_id)
        if p.ca and spec is not None:  # e.g. a pooled sandbox handed out with secrets
            self._place_ca(spec, p.ca)
        await self.net.update(sandbox_id, p)
        a = self.net.by_sid.get(sandbox_id)
        if a is not None:
            self._state(sandbox_id).write_text(json.dumps({"index": a.slot.index,
                                                           "policy": p.to_json()}))

    def memory_usage(self, sandbox_id: str) -> int | None:
        return self.inner.memory_usage(sandbox_id)

    def memory_watch(self, sandbox_id: str, threshold: int) -> int | None:
        return self.inner.memory_watch(sandbox_id, threshold)

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        return self.inner.cpu_seconds(sandbox_id)

    def stats(self, sandbox_id: str) -> dict[str, int | float]:
        """The inner backend's, and the bytes on the sandbox's link (the host end's
        counters: what it receives, the sandbox sent)."""
        out = self.inner.stats(sandbox_id)
        a = self.net.by_sid.get(sandbox_id)
        if a is not None:
            base = Path("/sys/class/net") / a.slot.host_if / "statistics"
            try:
                out["net_tx_bytes"] = int((base / "rx_bytes").read_text())
                out["net_rx_bytes"] = int((base / "tx_bytes").read_text())
            except (OSError, ValueError):
                pass
        return out

    async def close(self) -> None:
        await self.inner.close()
