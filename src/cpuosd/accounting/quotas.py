"""Admission: a sandbox is made only if its workspace's maxima and the host allow it,
checked before anything is started, in one step with the write that makes the sandbox
count (``Admission.admitting``: under the workspace's lock in the store, so two creates,
on one host or on two nodes sharing Postgres, cannot both take the last place).

- Per sandbox: vCPUs and memory at most the workspace's ``max_vcpus`` / ``max_memory_mib``
  (by default the host's cores and memory: no sandbox larger than the machine) -> 422.
- Per workspace: at most ``max_sandboxes`` alive (paused ones included), and at most
  ``max_total_vcpus`` / ``max_total_memory_mib`` held by its running ones (their sizes)
  -> 429.
- The host, by what is really used (``HostUse``, measured): a sandbox's size is a cap, not
  a reservation. Memory: what the host can still give (MemAvailable), less what sandboxes
  admitted in the last ``RECENT`` seconds will take once up, less a reserve
  (``CPUOS_MEMORY_RESERVE_MIB``, default 5% of the host, at least 512 MiB), must hold the
  new one (as much as a running sandbox holds now, on average, up to its cap). CPU: the
  sandboxes' recent use (their cgroups, over the last minute) under the host's cores ×
  ``CPUOS_ADMIT_CPU`` (0.95). Disk: ``CPUOS_DISK_RESERVE_MIB`` (1024) free where writable
  layers live (a pause checks its snapshot's room itself: ``no_space``). A host that is
  full answers 429 naming what is full (``host_memory``, ``host_cpu``, ``host_disk``). A
  paused sandbox holds disk only.
  Operators who want nominal ceilings too set ``CPUOS_MEMORY_OVERCOMMIT`` and/or
  ``CPUOS_CPU_OVERCOMMIT``: the sizes of running sandboxes then stay under the host's memory
  and cores times those ratios (``host_capacity``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..config import LimitsConfig
from ..errors import ApiError, invalid
from ..store import ACTIVE_STATES, Store
from ..lifecycle.states import State

log = logging.getLogger("cpuosd.admission")

# states whose sandbox holds host memory and CPU (paused and killing ones do not, or not
# for long)
RESERVING = (State.CREATING, State.RUNNING, State.PAUSING, State.RESUMING, State.POOLED)
DEFAULT_MAX_DISK_MIB = 64 << 10
DEFAULT_MAX_PIDS = 32768
# s a newly admitted sandbox counts as about to take memory (its restore maps its pages in
# the background; until then MemAvailable does not show it)
RECENT = 15.0
# what a new sandbox is taken to hold when no running one shows it (MiB), and at least
DEFAULT_SANDBOX_MIB = 256
MIN_SANDBOX_MIB = 32
# the sandboxes' CPU use is averaged over this window (s); samples at most once a second
CPU_WINDOW = 60.0
# host cgroup parents whose children are sandboxes (gVisor's, the microVM jailer's)
CGROUP_PARENTS = ("cpuos", "cpuos-microvm")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def host_vcpus(cfg: LimitsConfig) -> int:
    return cfg.host_vcpus or os.cpu_count() or 1


def host_memory_mib(cfg: LimitsConfig) -> int:
    if cfg.host_memory_mib:
        return cfg.host_memory_mib
    return _meminfo().get("MemTotal", 1 << 30) >> 20


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k] = int(parts[0]) << 10
    except OSError:
        pass
    return out


@dataclass(frozen=True)
class HostUse:
    """What the host has and what its sandboxes use, now (admission's measurement)."""

    memory_total_mib: int
    memory_available_mib: int  # what the host can still give (MemAvailable)
    sandbox_mib: int  # what one running sandbox holds, on average (a new one's estimate)
    sandboxes: int  # running sandboxes the figures are of
    cpu_cores: float
    cpu_used_cores: float  # the sandboxes' CPU use, averaged over the last window
    disk_free_mib: int  # free where writable layers live


Measure = Callable[[], HostUse]


class HostMeter:
    """The real measurement: /proc/meminfo, the sandboxes' host cgroups (their parents:
    one read each, whatever the number of sandboxes), free space of ``disk_paths``. The
    CPU figure is the parents' usage counters sampled at most once a second (``measure``,
    and the daemon's tick), averaged over ``CPU_WINDOW``.

    ``CPUOS_HOST_MEMORY_MIB`` (a host smaller than the machine, e.g. for tests): what can
    still be given is that size less what this daemon's own sandbox cgroups (``ours``)
    hold, at most MemAvailable."""

    def __init__(self, disk_paths: Sequence[Path], root: Path = CGROUP_ROOT,
                 parents: Sequence[str] = CGROUP_PARENTS,
                 clock: Callable[[], float] = time.monotonic,
                 ours: Callable[[], Iterable[str]] | None = None,
                 limits: LimitsConfig | None = None) -> None:
        self.disk_paths, self.root, self.parents, self.clock = disk_paths, root, parents, clock
        self.cfg = limits or LimitsConfig()
        self.ours = ours
        self._cpu: collections.deque[tuple[float, float]] = collections.deque()

    def _read(self, *names: Path) -> str | None:
        for p in names:
            try:
                return p.read_text()
            except OSError:
                continue
        return None

    def cpu_seconds(self) -> float:
        total = 0.0
        for parent in self.parents:
            v1 = self._read(self.root / "cpuacct" / parent / "cpuacct.usage")
            if v1 is not None and v1.strip().isdigit():
                total += int(v1) / 1e9
                continue
            v2 = self._read(self.root / parent / "cpu.stat")
            for line in (v2 or "").splitlines():
                k, _, v = line.partition(" ")
                if k == "usage_usec" and v.strip().isdigit():
                    total += int(v) / 1e6
        return total

    def _resident(self, d: Path) -> int | None:
        """Bytes resident in the cgroup d and below: anonymous and shared memory (gVisor's
        memory file), not page cache the host can drop."""
        stat = self._read(d / "memory.stat")
        if stat is None:
            return None
        st = dict(line.split()[:2] for line in stat.splitlines() if " " in line)
        if "total_rss" in st:  # v1, hierarchical
            return int(st.get("total_rss", 0)) + int(st.get("total_shmem", 0))
        return int(st.get("anon", 0)) + int(st.get("shmem", 0))  # v2

    def sandboxes_memory(self, sids: Iterable[str] | None = None) -> tuple[int, int]:
        """(bytes resident in sandboxes' cgroups, how many sandbox cgroups): all of them
        (their parents), or those of ``sids``."""
        sids = None if sids is None else list(sids)
        used = count = 0
        for parent in self.parents:
            for d in (self.root / "memory" / parent, self.root / parent):
                if sids is not None:
                    for sid in sids:
                        got = self._resident(d / sid)
                        if got is not None:
                            used, count = used + got, count + 1
                    continue
                got = self._resident(d)
                if got is None:
                    continue
                used += got
                try:
                    count += sum(1 for e in os.scandir(d) if e.is_dir())
                except OSError:
                    pass
                break
        return used, count

    def sample_cpu(self) -> None:
        now = self.clock()
        if self._cpu and now - self._cpu[-1][0] < 1.0:
            return
        self._cpu.append((now, self.cpu_seconds()))
        while len(self._cpu) > 2 and now - self._cpu[1][0] >= CPU_WINDOW:
            self._cpu.popleft()

    def measure(self) -> HostUse:
        self.sample_cpu()
        (t0, c0), (t1, c1) = self._cpu[0], self._cpu[-1]
        cpu_used = max(0.0, c1 - c0) / (t1 - t0) if t1 - t0 >= 1.0 else 0.0
        mem = _meminfo()
        total = host_memory_mib(self.cfg)
        available = mem.get("MemAvailable", 0) >> 20
        used, count = self.sandboxes_memory()
        if self.cfg.host_memory_mib:  # a host smaller than the machine
            mine = self.sandboxes_memory(list(self.ours()))[0] if self.ours else used
            available = min(available, total - (mine >> 20))
        per = max(MIN_SANDBOX_MIB, (used >> 20) // count) if count else DEFAULT_SANDBOX_MIB
        free = min((shutil.disk_usage(p).free >> 20 for p in self.disk_paths if p.exists()),
                   default=1 << 30)
        return HostUse(memory_total_mib=total, memory_available_mib=max(0, available),
                       sandbox_mib=per, sandboxes=count, cpu_cores=float(host_vcpus(self.cfg)),
                       cpu_used_cores=cpu_used, disk_free_mib=free)


@dataclass
class Limits:
    """A workspace's maxima; what is not set in its record takes these defaults."""

    max_sandboxes: int = 100
    max_vcpus: int = 0  # 0: the host's cores
    max_memory_mib: int = 0  # 0: the host's memory
    max_total_vcpus: int = 0  # 0: no limit but the host's
    max_total_memory_mib: int = 0
    max_disk_mib: int = 0  # per sandbox; 0: DEFAULT_MAX_DISK_MIB
    max_pids: int = 0  # per sandbox; 0: DEFAULT_MAX_PIDS

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, stored: dict[str, Any], host: LimitsConfig) -> Limits:
        lim = cls(**{k: int(v) for k, v in stored.items() if k in cls.names()})
        lim.max_vcpus = lim.max_vcpus or host_vcpus(host)
        lim.max_memory_mib = lim.max_memory_mib or host_memory_mib(host)
        lim.max_disk_mib = lim.max_disk_mib or DEFAULT_MAX_DISK_MIB
        lim.max_pids = lim.max_pids or DEFAULT_MAX_PIDS
        return lim


def check_limits_body(limits: dict[str, Any]) -> dict[str, int]:
    """A workspace's limits as sent by the admin: known names, non-negative integers."""
    out = {}
    for k, v in limits.items():
        if k not in Limits.names():
            raise invalid(f"unknown limit {k!r} (known: {', '.join(Limits.names())})",
                          field="limits")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise invalid(f"limit {k} must be a non-negative integer", field="limits")
        out[k] = v
    return out


class Admission:
    def __init__(self, store: Store, measure: Measure,
                 clock: Callable[[], float] = time.monotonic,
                 limits: LimitsConfig | None = None) -> None:
        self.store, self.measure, self.clock = store, measure, clock
        self.cfg = cfg = limits or LimitsConfig()
        # nominal ceilings: only where the operator sets a ratio
        self.cpu_ratio = cfg.cpu_overcommit
        self.mem_ratio = cfg.memory_overcommit
        self.cpu_load = cfg.admit_cpu
        self.memory_reserve = cfg.memory_reserve_mib or max(512, host_memory_mib(cfg) // 20)
        self.disk_reserve = cfg.disk_reserve_mib
        # MiB promised to sandboxes admitted in the last RECENT seconds: (when, MiB)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        # (workspace, what) -> raises at the workspace's spending cap (accounting.usage)
        self.check_spending: Callable[[str, str], None] | None = None

    def capacity(self) -> dict[str, int]:
        """The nominal ceilings (0: none set)."""
        return {"vcpus": int(host_vcpus(self.cfg) * self.cpu_ratio),
                "memory_mib": int(host_memory_mib(self.cfg) * self.mem_ratio)}

    def _reserved(self, workspace_id: str | None) -> tuple[int, int]:
        """The vCPUs and memory (sizes) of running sandboxes: the workspace's (pooled ones
        belong to no one yet), or all of them."""
        states = RESERVING if workspace_id is None else tuple(
            s for s in RESERVING if s != State.POOLED)
        _, vcpus, mem = self.store.sandbox_totals(workspace_id, states)
        return vcpus, mem

    def limits(self, workspace_id: str) -> Limits:
        ws = self.store.workspace(workspace_id)
        return Limits.of(ws["limits"] if ws else {}, self.cfg)

    def _promised(self) -> int:
        now = self.clock()
        while self._recent and now - self._recent[0][0] > RECENT:
            self._recent.popleft()
        return sum(m for _, m in self._recent)

    def host(self) -> dict[str, Any]:
        """The host as admission sees it (the admin's ``GET /workspace``)."""
        use = self.measure()
        hv, hm = self._reserved(None)
        return {**asdict(use), "memory_reserve_mib": self.memory_reserve,
                "memory_promised_mib": self._promised(), "cpu_admit_cores": round(
                    use.cpu_cores * self.cpu_load, 2),
                "disk_reserve_mib": self.disk_reserve, "capacity": self.capacity(),
                "reserved": {"vcpus": hv, "memory_mib": hm}}

    def usage(self, workspace_id: str, *, host: bool = True) -> dict[str, Any]:
        """The workspace's maxima and what its sandboxes hold; with ``host`` (the admin's
        view), the host as admission sees it."""
        vcpus, mem = self._reserved(workspace_id)
        alive = self.store.sandbox_totals(workspace_id, ACTIVE_STATES)[0]
        out: dict[str, Any] = {"limits": asdict(self.limits(workspace_id)),
                               "used": {"sandboxes": alive, "vcpus": vcpus, "memory_mib": mem}}
        if host:
            out["host"] = self.host()
        return out

    def admit(self, workspace_id: str, vcpus: int, memory_mib: int, *, n: int = 1,
              new_sandboxes: bool = True, reserve_host: bool = True,
              pids: int | None = None, disk_mib: int | None = None, pending: int = 0) -> None:
        """Raise unless ``n`` sandboxes of this size may start for this workspace.
        ``new_sandboxes``: they add to the workspace's count (not for a resume);
        ``reserve_host``: they take new host memory (not when handed from the pool);
        ``pending``: sandboxes of this workspace admitted and not yet made (creates waiting
        for the warm pool), counted as made."""
        if self.store.workspace(workspace_id) is None:  # deleted (its keys are revoked)
            raise ApiError("unauthorized", "this workspace has been deleted")
        lim = self.limits(workspace_id)
        if self.check_spending is not None:
            self.check_spending(workspace_id, "create" if new_sandboxes else "resume")
        if vcpus > lim.max_vcpus:
            raise invalid(f"vcpus {vcpus} is over this workspace's maximum of "
                          f"{lim.max_vcpus} per sandbox", field="vcpus", max=lim.max_vcpus)
        if memory_mib > lim.max_memory_mib:
            raise invalid(f"memory_mib {memory_mib} is over this workspace's maximum of "
                          f"{lim.max_memory_mib} per sandbox", field="memory_mib",
                          max=lim.max_memory_mib)
        if disk_mib is not None and disk_mib > lim.max_disk_mib:
            raise invalid(f"disk_mib {disk_mib} is over this workspace's maximum of "
                          f"{lim.max_disk_mib} per sandbox", field="disk_mib",
                          max=lim.max_disk_mib)
        if pids is not None and pids > lim.max_pids:
            raise invalid(f"pids {pids} is over this workspace's maximum of {lim.max_pids} "
                          f"per sandbox", field="pids", max=lim.max_pids)
        if new_sandboxes:
            alive = self.store.sandbox_totals(workspace_id, ACTIVE_STATES)[0] + pending
            if alive + n > lim.max_sandboxes:
                raise ApiError("limit_exceeded", f"this workspace has {alive} sandboxes alive "
                               f"(paused included); its maximum is {lim.max_sandboxes}",
                               {"limit": "max_sandboxes", "max": lim.max_sandboxes})
        if lim.max_total_vcpus or lim.max_total_memory_mib:
            used_v, used_m = self._reserved(workspace_id)
            used_v, used_m = used_v + pending * vcpus, used_m + pending * memory_mib
            if lim.max_total_vcpus and used_v + n * vcpus > lim.max_total_vcpus:
                raise ApiError("limit_exceeded", f"this workspace's running sandboxes hold "
                               f"{used_v} vCPUs; {n * vcpus} more would pass its maximum of "
                               f"{lim.max_total_vcpus}", {"limit": "max_total_vcpus"})
            if lim.max_total_memory_mib and used_m + n * memory_mib > lim.max_total_memory_mib:
                raise ApiError("limit_exceeded", f"this workspace's running sandboxes hold "
                               f"{used_m} MiB; {n * memory_mib} more would pass its maximum "
                               f"of {lim.max_total_memory_mib}",
                               {"limit": "max_total_memory_mib"})
        if reserve_host:
            self.check_host(vcpus, memory_mib, n)

    @contextlib.contextmanager
    def admitting(self, workspace_id: str, vcpus: int, memory_mib: int, **kw: Any
                  ) -> Iterator[None]:
        """``admit`` (same arguments), then the caller's block: the write that makes the
        sandboxes count for the workspace (a row inserted, a pooled one handed over, a
        paused one claimed) goes in it. Both run as one step of the store
        (``Store.serialized``, scope ``admission:<workspace>``): where several nodes share
        the store, one workspace's admissions wait for each other and each counts what the
        one before it wrote, so no number of nodes creating at once passes its maxima."""
        with self.store.serialized(f"admission:{workspace_id}"):
            self.admit(workspace_id, vcpus, memory_mib, **kw)
            yield

    def _needs(self, use: HostUse, memory_mib: int, n: int) -> int:
        """MiB n new sandboxes of this size are taken to hold once up: what a running one
        holds on average, never more than its cap (and the sentry's share above it)."""
        return n * min(use.sandbox_mib, memory_mib + 256)

    def host_full(self, vcpus: int, memory_mib: int, n: int = 1,
                  use: HostUse | None = None) -> ApiError | None:
        """Why the host cannot take n more sandboxes of this size now, or None."""
        use = use or self.measure()
        need = self._needs(use, memory_mib, n)
        promised = self._promised()
        free = use.memory_available_mib - promised - self.memory_reserve
        if free < need:
            return ApiError(
                "limit_exceeded", f"the host is full (memory): {use.memory_available_mib} MiB "
                f"available, {promised} MiB promised to sandboxes starting, "
                f"{self.memory_reserve} MiB kept free; this needs about {need} MiB more",
                {"limit": "host_memory", "available_mib": use.memory_available_mib,
                 "promised_mib": promised, "reserve_mib": self.memory_reserve,
                 "needed_mib": need})
        if use.cpu_used_cores >= use.cpu_cores * self.cpu_load:
            return ApiError(
                "limit_exceeded", f"the host is full (CPU): its sandboxes used "
                f"{use.cpu_used_cores:.2f} of its {use.cpu_cores:g} cores over the last "
                f"minute (admitting up to {self.cpu_load:.0%})",
                {"limit": "host_cpu", "used_cores": round(use.cpu_used_cores, 3),
                 "cores": use.cpu_cores})
        if use.disk_free_mib < self.disk_reserve:
            return ApiError(
                "limit_exceeded", f"the host is full (disk): {use.disk_free_mib} MiB free for "
                f"sandboxes' writes, {self.disk_reserve} MiB kept free",
                {"limit": "host_disk", "free_mib": use.disk_free_mib,
                 "reserve_mib": self.disk_reserve})
        if self.cpu_ratio or self.mem_ratio:
            cap = self.capacity()
            hv, hm = self._reserved(None)
            if (cap["vcpus"] and hv + n * vcpus > cap["vcpus"]) or (
                    cap["memory_mib"] and hm + n * memory_mib > cap["memory_mib"]):
                return ApiError(
                    "limit_exceeded", f"the host is full: sandboxes hold {hv} vCPUs and "
                    f"{hm} MiB of the {cap['vcpus'] or 'any'} vCPUs and "
                    f"{cap['memory_mib'] or 'any'} MiB it admits (CPUOS_CPU_OVERCOMMIT, "
                    f"CPUOS_MEMORY_OVERCOMMIT); this needs {n * vcpus} vCPUs and "
                    f"{n * memory_mib} MiB more",
                    {"limit": "host_capacity", "capacity": cap,
                     "reserved": {"vcpus": hv, "memory_mib": hm}})
        return None

    def host_has_room(self, vcpus: int, memory_mib: int, n: int = 1) -> bool:
        return self.host_full(vcpus, memory_mib, n) is None

    def promise(self, memory_mib: int, n: int = 1) -> None:
        """n sandboxes of this size start now without check_host (the warm pool's, after
        host_has_room): they count as taking memory until they show."""
        self._recent.append((self.clock(), self._needs(self.measure(), memory_mib, n)))

    def check_host(self, vcpus: int, memory_mib: int, n: int = 1) -> None:
        """Raise (429) unless the host has room for n more; then they are promised it. The
        error names what is full and what was asked, not the host's figures or what other
        workspaces hold (those go to the daemon's log, and the admin's ``GET /workspace``)."""
        use = self.measure()
        full = self.host_full(vcpus, memory_mib, n, use)
        if full is not None:
            log.info("admission: %s", full.message)
            kind = str(full.details.get("limit", "host_capacity"))
            what = {"host_memory": "memory", "host_cpu": "CPU",
                    "host_disk": "disk"}.get(kind, "capacity")
            raise ApiError("limit_exceeded", f"the host is full ({what}): it cannot take "
                           f"{n} more sandbox{'es' if n != 1 else ''} of {vcpus} vCPUs and "
                           f"{memory_mib} MiB now; try again later, or pause or kill "
                           "sandboxes", {"limit": kind})
        self._recent.append((self.clock(), self._needs(use, memory_mib, n)))
