"""Admission: a sandbox is made only if its workspace's maxima and the host's capacity
allow it, checked before anything is started (and in the same event-loop step as the row
is written, so two creates cannot both take the last place).

- Per sandbox: vCPUs and memory at most the workspace's ``max_vcpus`` / ``max_memory_mib``
  (by default the host's cores and memory: no sandbox larger than the machine) -> 422.
- Per workspace: at most ``max_sandboxes`` alive (paused ones included), and at most
  ``max_total_vcpus`` / ``max_total_memory_mib`` reserved by its running ones -> 429.
- The host: the vCPUs and memory reserved by every running, starting, pooled or resuming
  sandbox, plus the new one, within the host's times an overcommit ratio
  (``CPUOS_CPU_OVERCOMMIT``, default 32: a vCPU is a CFS quota, time-shared;
  ``CPUOS_MEMORY_OVERCOMMIT``, default 4: a sandbox's memory is a limit, and an idle one
  holds about 30 MiB; set 1 where every sandbox may use all of its memory at once) -> 429.
  A paused sandbox reserves nothing (it is on disk) until it resumes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ApiError, invalid
from ..store import ACTIVE_STATES, Store

log = logging.getLogger("cpuosd.admission")

# states whose sandbox holds host memory and CPU (paused and killing ones do not, or not
# for long)
RESERVING = ("creating", "running", "pausing", "resuming", "pooled")
DEFAULT_MAX_DISK_MIB = 64 << 10
DEFAULT_MAX_PIDS = 32768


def host_vcpus() -> int:
    return int(os.environ.get("CPUOS_HOST_VCPUS") or os.cpu_count() or 1)


def host_memory_mib() -> int:
    if os.environ.get("CPUOS_HOST_MEMORY_MIB"):
        return int(os.environ["CPUOS_HOST_MEMORY_MIB"])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


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
    def of(cls, stored: dict[str, Any]) -> Limits:
        lim = cls(**{k: int(v) for k, v in stored.items() if k in cls.names()})
        lim.max_vcpus = lim.max_vcpus or host_vcpus()
        lim.max_memory_mib = lim.max_memory_mib or host_memory_mib()
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
    def __init__(self, store: Store) -> None:
        self.store = store
        self.cpu_ratio = float(os.environ.get("CPUOS_CPU_OVERCOMMIT") or 32)
        self.mem_ratio = float(os.environ.get("CPUOS_MEMORY_OVERCOMMIT") or 4)
        # (workspace, what) -> raises at the workspace's spending cap (accounting.usage)
        self.check_spending: Callable[[str, str], None] | None = None

    def capacity(self) -> dict[str, int]:
        return {"vcpus": int(host_vcpus() * self.cpu_ratio),
                "memory_mib": int(host_memory_mib() * self.mem_ratio)}

    def _reserved(self, workspace_id: str | None) -> tuple[int, int]:
        rows = self.store.list_sandboxes(workspace_id, RESERVING)
        if workspace_id is not None:  # pooled sandboxes belong to no one yet
            rows = [r for r in rows if r.state != "pooled"]
        return (sum(int(r.spec.get("vcpus") or 0) for r in rows),
                sum(int(r.spec.get("memory_mib") or 0) for r in rows))

    def limits(self, workspace_id: str) -> Limits:
        ws = self.store.workspace(workspace_id)
        return Limits.of(ws["limits"] if ws else {})

    def usage(self, workspace_id: str, *, host: bool = True) -> dict[str, Any]:
        """The workspace's maxima and what its sandboxes hold; with ``host`` (the admin's
        view), the host's capacity and what all sandboxes reserve."""
        vcpus, mem = self._reserved(workspace_id)
        alive = len(self.store.list_sandboxes(workspace_id, ACTIVE_STATES))
        out: dict[str, Any] = {"limits": asdict(self.limits(workspace_id)),
                               "used": {"sandboxes": alive, "vcpus": vcpus, "memory_mib": mem}}
        if host:
            hv, hm = self._reserved(None)
            out["host"] = {"capacity": self.capacity(),
                           "reserved": {"vcpus": hv, "memory_mib": hm}}
        return out

    def admit(self, workspace_id: str, vcpus: int, memory_mib: int, *, n: int = 1,
              new_sandboxes: bool = True, reserve_host: bool = True,
              pids: int | None = None, disk_mib: int | None = None) -> None:
        """Raise unless ``n`` sandboxes of this size may start for this workspace.
        ``new_sandboxes``: they add to the workspace's count (not for a resume);
        ``reserve_host``: they take new host capacity (not when handed from the pool)."""
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
            alive = len(self.store.list_sandboxes(workspace_id, ACTIVE_STATES))
            if alive + n > lim.max_sandboxes:
                raise ApiError("limit_exceeded", f"this workspace has {alive} sandboxes alive "
                               f"(paused included); its maximum is {lim.max_sandboxes}",
                               {"limit": "max_sandboxes", "max": lim.max_sandboxes})
        used_v, used_m = self._reserved(workspace_id)
        if lim.max_total_vcpus and used_v + n * vcpus > lim.max_total_vcpus:
            raise ApiError("limit_exceeded", f"this workspace's running sandboxes hold {used_v} "
                           f"vCPUs; {n * vcpus} more would pass its maximum of "
                           f"{lim.max_total_vcpus}", {"limit": "max_total_vcpus"})
        if lim.max_total_memory_mib and used_m + n * memory_mib > lim.max_total_memory_mib:
            raise ApiError("limit_exceeded", f"this workspace's running sandboxes hold {used_m} "
                           f"MiB; {n * memory_mib} more would pass its maximum of "
                           f"{lim.max_total_memory_mib}", {"limit": "max_total_memory_mib"})
        if reserve_host:
            self.check_host(vcpus * n, memory_mib * n)

    def host_has_room(self, vcpus: int, memory_mib: int) -> bool:
        cap = self.capacity()
        hv, hm = self._reserved(None)
        return hv + vcpus <= cap["vcpus"] and hm + memory_mib <= cap["memory_mib"]

    def check_host(self, vcpus: int, memory_mib: int) -> None:
        """Raise unless the host has room. The error names what the caller asked for, not
        the host's capacity or what other workspaces hold (the admin's ``GET /workspace``
        shows those, and the daemon's log)."""
        if not self.host_has_room(vcpus, memory_mib):
            cap = self.capacity()
            hv, hm = self._reserved(None)
            log.info("admission: host full: sandboxes hold %d of %d vCPUs and %d of %d MiB; "
                     "refused %d vCPUs and %d MiB more", hv, cap["vcpus"], hm,
                     cap["memory_mib"], vcpus, memory_mib)
            raise ApiError("limit_exceeded", f"the host is full: it cannot take {vcpus} vCPUs "
                           f"and {memory_mib} MiB more now; try again later, or pause or kill "
                           "sandboxes", {"limit": "host_capacity"})
