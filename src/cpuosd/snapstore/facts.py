"""What a snapshot needs of the node that restores it, recorded beside it at checkpoint
(``cpuos-snapshot.json`` in the image directory, and in the store's manifest) and checked
by placement before a restore elsewhere.

gVisor restores a checkpoint only into the runsc that made it (the image format and the
OCI spec: the backend's ``image_kind`` names both), and refuses a restore on a CPU that lacks
a feature the saved state had (its CPUID): a snapshot made on one CPU model restores on a
node whose features are a superset. The flags of ``/proc/cpuinfo`` stand for the CPUID
features here (they hold a few of Linux's own too, so the check errs on the side of
refusing).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from ..backends.base import Backend
from ..store.base import RowSpec

META = "cpuos-snapshot.json"
FORMAT = 1


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """(vendor, model name, sorted flags) of the first processor."""
    vendor = model = ""
    flags: list[str] = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k == "vendor_id" and not vendor:
                vendor = v
            elif k == "model name" and not model:
                model = v
            elif k == "flags" and not flags:
                flags = sorted(set(v.split()))
            elif not line.strip() and flags:
                break
    return {"cpu_vendor": vendor, "cpu_model": model, "cpu_features": flags}


def host_facts(backend: Backend) -> dict[str, Any]:
    """This node as a restore target: its backend, image kind, runtime versions, CPU."""
    rt = backend.runtime()
    return {"backend": backend.capabilities.name, "image_kind": backend.image_kind,
            "arch": platform.machine(),
            "runtime": {k: rt[k] for k in ("runsc_version", "platform", "accel") if k in rt},
            **cpu_info()}


def snapshot_meta(backend: Backend, sandbox: str, template: str, spec: RowSpec
                  ) -> dict[str, Any]:
    return {"format": FORMAT, **host_facts(backend), "sandbox": sandbox, "template": template,
            "template_digest": spec.template_digest, "vcpus": spec.vcpus,
            "memory_mib": spec.memory_mib, "disk_mib": spec.disk_mib,
            "created_at": time.time()}


def write_meta(image_dir: Path, meta: dict[str, Any]) -> None:
    fd = os.open(image_dir / META, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, sort_keys=True)


def read_meta(image_dir: Path) -> dict[str, Any] | None:
    try:
        d = json.loads((image_dir / META).read_bytes()[:1 << 20])
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def incompatibilities(meta: dict[str, Any], host: dict[str, Any]) -> list[str]:
    """Why a snapshot with ``meta`` cannot be restored on a node with facts ``host`` (empty:
    it can). A snapshot without facts (made before they were recorded) restores only where
    its image kind says (the caller checks the image kind it knows)."""
    why = []
    for k in ("backend", "image_kind", "arch"):
        if meta.get(k) and meta.get(k) != host.get(k):
            why.append(f"{k} {meta.get(k)} here {host.get(k)}")
    mrt, hrt = meta.get("runtime") or {}, host.get("runtime") or {}
    for k in ("runsc_version", "platform", "accel"):
        if mrt.get(k) and mrt.get(k) != hrt.get(k):
            why.append(f"{k} {mrt.get(k)} here {hrt.get(k)}")
    missing = sorted(set(meta.get("cpu_features") or ()) - set(host.get("cpu_features") or ()))
    if missing:
        why.append("CPU features missing here: " + " ".join(missing[:32])
                   + (" ..." if len(missing) > 32 else ""))
    return why
