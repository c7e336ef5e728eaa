"""Admission's arithmetic (cpuosd.accounting.quotas) on a fake measurement of the host: by
what sandboxes really use (memory available, recent CPU, free disk), sizes as caps, the
workspace maxima as before; and the real meter read from a fake cgroup tree."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuosd.lifecycle.states import State
from cpuosd.accounting import quotas
from cpuosd.accounting.quotas import Admission, HostMeter, Measure
from cpuosd.config import Config
from cpuosd.errors import ApiError
from cpuosd.store import RowSpec, SandboxRow, SqliteStore, Store
from support.fakes import FakeHost


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = SqliteStore(tmp_path / "db")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("CPUOS_CPU_OVERCOMMIT", "CPUOS_MEMORY_OVERCOMMIT", "CPUOS_ADMIT_CPU",
              "CPUOS_DISK_RESERVE_MIB", "CPUOS_HOST_VCPUS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CPUOS_HOST_MEMORY_MIB", "24000")
    monkeypatch.setenv("CPUOS_MEMORY_RESERVE_MIB", "1000")


def admission(store: Store, host: Measure, clock: Clock) -> Admission:
    return Admission(store, host, clock=clock, limits=Config.from_env().limits)


def limit_of(e: pytest.ExceptionInfo[ApiError]) -> str:
    return str(e.value.details["limit"])


def add_row(store: Store, ws: str, state: str, vcpus: int = 2, memory_mib: int = 2048) -> None:
    sid = f"sbx-{len(store.list_sandboxes()):012d}"
    store.insert_sandbox(SandboxRow(
        id=sid, workspace_id=ws, template="python", backend="fake", state=State(state), reason=None,
        created_at=time.time(), started_at=None, ended_at=None, deadline=None,
        spec=RowSpec(vcpus=vcpus, memory_mib=memory_mib), metadata={}))


def test_memory_admits_what_is_available_and_counts_starting_ones(store: Store) -> None:
    host, clock = FakeHost(), Clock()
    host.set(sandboxes=10)
    a = admission(store, host, clock)
    ws = store.create_workspace("w", {"max_sandboxes": 1000})
    host.set(memory_available_mib=1800)  # 800 over the reserve: twenty sandboxes of 40
    for _ in range(20):
        a.admit(ws, 2, 2048)
    with pytest.raises(ApiError) as e:
        a.admit(ws, 2, 2048)
    assert e.value.status == 429 and limit_of(e) == "host_memory"
    assert "the host is full (memory)" in e.value.message
    assert "MiB available" not in e.value.message  # the host's figures: the admin's only
    full = a.host_full(2, 2048)
    assert full is not None and full.details["promised_mib"] == 800
    # once they are up, MemAvailable shows them and the promise lapses
    clock.t += quotas.RECENT + 1
    host.set(memory_available_mib=1000 + 20 * 40)
    for _ in range(20):
        a.admit(ws, 2, 2048)


def test_sizes_are_caps_not_reservations(store: Store) -> None:
    host, clock = FakeHost(), Clock()
    a = admission(store, host, clock)
    ws = store.create_workspace("w", {"max_sandboxes": 1000})
    for _ in range(300):  # 300 x 2 vCPUs x 2 GiB on a 2-core 24 GB host: idle, they fit
        a.admit(ws, 2, 2048)
        clock.t += 1
    # a new sandbox is taken to hold what running ones hold, never more than its cap
    clock.t += quotas.RECENT + 1
    host.set(sandbox_mib=4000, memory_available_mib=1000 + 700)
    a.admit(ws, 1, 256)  # 256 + the sentry's 256 above it: 512 <= 700
    with pytest.raises(ApiError) as e:
        a.admit(ws, 1, 256)
    assert limit_of(e) == "host_memory"
    full = a.host_full(1, 256)
    assert full is not None and full.details["needed_mib"] == 512


def test_cpu_and_disk_full(store: Store) -> None:
    host, clock = FakeHost(), Clock()
    a = admission(store, host, clock)
    ws = store.create_workspace("w")
    host.set(cpu_used_cores=1.95)
    with pytest.raises(ApiError) as e:
        a.admit(ws, 2, 2048)
    assert limit_of(e) == "host_cpu" and "(CPU)" in e.value.message
    full = a.host_full(2, 2048)
    assert full is not None and "1.95 of its 2 cores" in full.message
    host.set(cpu_used_cores=1.5)
    a.admit(ws, 2, 2048)
    host.set(disk_free_mib=900)
    with pytest.raises(ApiError) as e:
        a.admit(ws, 2, 2048)
    assert limit_of(e) == "host_disk"
    # a pooled hand-out takes no new host room; a resume is not a new sandbox
    a.admit(ws, 2, 2048, reserve_host=False)
    host.set(disk_free_mib=5000)
    a.admit(ws, 2, 2048, new_sandboxes=False)


def test_workspace_maxima_keep_their_meaning(store: Store) -> None:
    host, clock = FakeHost(), Clock()
    a = admission(store, host, clock)
    ws = store.create_workspace("w", {"max_sandboxes": 3, "max_total_memory_mib": 4096})
    other = store.create_workspace("o")
    add_row(store, ws, "running")
    add_row(store, ws, "paused")  # counts as alive, holds no memory
    add_row(store, ws, "killed")
    add_row(store, other, "running")
    add_row(store, other, "pooled")  # no one's yet (filed under the default workspace)
    a.admit(ws, 2, 2048)  # 2048 running + 2048 = the maximum
    with pytest.raises(ApiError) as e:
        a.admit(ws, 2, 4096)
    assert limit_of(e) == "max_total_memory_mib"
    add_row(store, ws, "running")
    with pytest.raises(ApiError) as e:
        a.admit(ws, 1, 128)
    assert limit_of(e) == "max_sandboxes"
    u = a.usage(ws)
    assert u["used"] == {"sandboxes": 3, "vcpus": 4, "memory_mib": 4096}
    assert u["host"]["memory_available_mib"] == 20000
    assert u["host"]["reserved"] == {"vcpus": 8, "memory_mib": 8192}  # all running, pooled
    with pytest.raises(ApiError) as e:
        a.admit(ws, 64, 128)
    assert e.value.status == 422


def test_nominal_ceiling_only_where_set(store: Store, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.setenv("CPUOS_MEMORY_OVERCOMMIT", "1")
    monkeypatch.setenv("CPUOS_HOST_MEMORY_MIB", "4096")
    host, clock = FakeHost(), Clock()
    a = admission(store, host, clock)
    ws = store.create_workspace("w")
    add_row(store, ws, "running")
    add_row(store, ws, "running")
    with pytest.raises(ApiError) as e:
        a.admit(ws, 2, 2048)
    assert limit_of(e) == "host_capacity"
    assert a.capacity() == {"vcpus": 0, "memory_mib": 4096}


def test_host_meter_reads_the_sandboxes_cgroups(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CPUOS_HOST_MEMORY_MIB")
    root = tmp_path / "cg"
    mem, cpu = root / "memory" / "cpuos", root / "cpuacct" / "cpuos"
    for i in range(4):
        (mem / f"sbx-{i}").mkdir(parents=True)
    cpu.mkdir(parents=True)
    (mem / "memory.stat").write_text("cache 0\nrss 0\ntotal_cache 999999999\n"
                                     f"total_rss {100 << 20}\ntotal_shmem {60 << 20}\n")
    (cpu / "cpuacct.usage").write_text(str(10 * 10**9))
    clock = Clock()
    meter = HostMeter([tmp_path], root=root, clock=clock, limits=Config.from_env().limits)
    first = meter.measure()
    assert first.sandboxes == 4 and first.sandbox_mib == 40  # (100 + 60) / 4
    assert first.cpu_used_cores == 0.0  # one sample: no window yet
    assert first.memory_total_mib > 0 and first.disk_free_mib > 0
    clock.t += 10
    (cpu / "cpuacct.usage").write_text(str(25 * 10**9))
    assert meter.measure().cpu_used_cores == pytest.approx(1.5)
    for _ in range(200):  # the window slides: samples older than it are dropped
        clock.t += 1
        meter.sample_cpu()
    assert meter.measure().cpu_used_cores == 0.0 and len(meter._cpu) <= 62
