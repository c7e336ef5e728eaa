"""Stand-ins for the tests of the API layer's own logic (never the proof that a feature
works): a backend that runs nothing, a host measurement that says what a test wants."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cpuosd.accounting.quotas import HostUse
from cpuosd.backends.base import Capabilities, SandboxSpec


class Unmeasured:
    """The measuring half of a Backend, for backends whose sandboxes the host does not
    measure: every figure unknown, no memory event."""

    def memory_usage(self, sandbox_id: str) -> int | None:
        return None

    def memory_watch(self, sandbox_id: str, threshold: int) -> int | None:
        return None

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        return None

    def stats(self, sandbox_id: str) -> dict[str, int | float]:
        return {}


class FakeBackend(Unmeasured):
    """A Backend that runs nothing and records the calls it gets: for tests of the API
    layer's own logic (never the proof that a feature works)."""

    image_kind = "fake"

    def __init__(self, checkpoint: bool = True) -> None:
        self.capabilities = Capabilities(name="fake", checkpoint=checkpoint, network=False)
        self.calls: list[str] = []

    def runtime(self) -> dict[str, str]:
        return {}

    async def start(self, spec: SandboxSpec) -> None:
        self.calls.append("start")

    async def kill(self, sandbox_id: str) -> None:
        self.calls.append("kill")

    async def running(self) -> dict[str, str]:
        return {}

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        self.calls.append("checkpoint")

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        self.calls.append("restore")

    async def close(self) -> None:
        pass


class FakeHost:
    """Stands in for the host's measurement (cpuosd.accounting.quotas.Measure: what
    HostMeter.measure answers) in tests of admission and the warm pool: a roomy host unless
    a test ``set``s otherwise."""

    def __init__(self) -> None:
        self.use = HostUse(memory_total_mib=24000, memory_available_mib=20000, sandbox_mib=40,
                           sandboxes=0, cpu_cores=2.0, cpu_used_cores=0.0,
                           disk_free_mib=50000)

    def __call__(self) -> HostUse:
        return self.use

    def set(self, **kw: float) -> None:
        self.use = dataclasses.replace(self.use, **kw)  # type: ignore[arg-type]
