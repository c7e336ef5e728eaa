"""Which backend cpuosd runs: ``CPUOS_BACKEND`` = ``gvisor`` | ``microvm`` | ``auto``.

``auto`` (the default) runs the KVM boot probe once (``probe.kvm_boot_probe``, bounded by
``PROBE_TIMEOUT``) and picks the microVM backend only when a guest actually booted, else
gVisor. ``microvm`` runs the same probe and refuses to start when it fails
(``BackendUnavailable``, a one-line reason). ``gvisor`` never probes.

The probe is fast when it cannot pass for a simple reason (no /dev/kvm, no QEMU, no guest
artifacts in ``$CPUOS_HOME/microvm`` or ``$CPUOS_MICROVM_DIR``); when the artifacts exist
it boots a guest and, on a host where KVM guests do not run, takes its whole timeout.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ...config import Config
from ..base import Backend
from ..gvisor import GVisorBackend
from ..runsc import RunscUnavailable, find_runsc
from . import guest_artifacts
from . import probe as probe_mod
from .backend import QEMU_BIN, MicroVMBackend

log = logging.getLogger("cpuosd.backend")

CHOICES = ("gvisor", "microvm", "auto")
PROBE_TIMEOUT = 5.0


class BackendUnavailable(Exception):
    """The configured backend cannot run on this host; str() is the one-line reason."""


def microvm_cache(cfg: Config) -> Path:
    """Where the daemon looks for the guest artifacts (CPUOS_MICROVM_DIR, else
    $CPUOS_HOME/microvm)."""
    return cfg.microvm_dir


def run_probe(cfg: Config, timeout: float = PROBE_TIMEOUT
              ) -> tuple[bool, str, guest_artifacts.Artifacts | None]:
    """(ok, reason, artifacts): the KVM boot probe against the artifacts the backend would
    use. Never raises: a probe that crashes is a failed probe."""
    cache = microvm_cache(cfg)
    art = guest_artifacts.current_artifacts(cache)
    try:
        ok, reason = probe_mod.kvm_boot_probe(
            timeout, artifacts=art, cache=cache,
            qemu=QEMU_BIN if os.path.exists(QEMU_BIN) else None)
    except Exception as e:  # an unexpected host condition: not a usable KVM host
        ok, reason = False, f"the probe itself failed: {type(e).__name__}: {e}"
    return ok, reason, art


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _gvisor(cfg: Config) -> GVisorBackend:
    try:
        runsc = find_runsc(cfg=cfg.runsc)
    except RunscUnavailable as e:
        raise BackendUnavailable(f"gvisor backend: {_one_line(str(e))}") from None
    log.info("runsc %s (%s) at %s, platform %s", runsc.version, runsc.source, runsc.path,
             runsc.platform)
    return GVisorBackend(runsc, cfg.runsc_root)


def select_backend(cfg: Config) -> Backend:
    """The backend ``cfg.backend`` asks for (see the module docstring). Raises
    ``BackendUnavailable`` for an unknown choice or a forced microvm the host cannot run."""
    choice = cfg.backend.strip().lower()
    if choice not in CHOICES:
        raise BackendUnavailable(f"CPUOS_BACKEND={cfg.backend!r} is not one of "
                                 f"{', '.join(CHOICES)}")
    if choice == "gvisor":
        log.info("backend: gvisor (CPUOS_BACKEND=gvisor; KVM boot probe not run)")
        return _gvisor(cfg)
    accel = cfg.microvm.accel.strip().lower()
    if accel not in ("kvm", "tcg"):
        raise BackendUnavailable(f"CPUOS_MICROVM_ACCEL={cfg.microvm.accel!r} is not kvm or tcg")
    if accel == "tcg":
        if choice != "microvm":
            raise BackendUnavailable("CPUOS_MICROVM_ACCEL=tcg needs CPUOS_BACKEND=microvm "
                                     "(emulated guests are for tests, never picked by auto)")
        art = guest_artifacts.current_artifacts(microvm_cache(cfg))
        if art is None or not art.exist():
            raise BackendUnavailable(f"CPUOS_BACKEND=microvm: guest kernel artifacts missing "
                                     f"in {microvm_cache(cfg)} (scripts/build-microvm-kernel.sh)")
        log.warning("backend: microvm under TCG (CPUOS_MICROVM_ACCEL=tcg): guests are "
                    "emulated, slow; for tests only")
        return MicroVMBackend(cfg.home, artifacts=art, accel="tcg",
                              standby=cfg.microvm.standby,
                              images=microvm_cache(cfg) / "images")
    t0 = time.monotonic()
    ok, reason, art = run_probe(cfg)
    took = time.monotonic() - t0
    reason = _one_line(reason)
    if ok:
        try:
            backend = MicroVMBackend(cfg.home, artifacts=art, standby=cfg.microvm.standby,
                                     images=microvm_cache(cfg) / "images")
        except Exception as e:
            why = _one_line(f"{type(e).__name__}: {e}")
            if choice == "microvm":
                raise BackendUnavailable(f"CPUOS_BACKEND=microvm: the KVM boot probe passed "
                                         f"but the microVM backend cannot be set up: {why}"
                                         ) from None
            log.warning("backend: gvisor (CPUOS_BACKEND=auto; KVM boot probe passed in %.2fs "
                        "but the microVM backend cannot be set up: %s)", took, why)
            return _gvisor(cfg)
        log.info("backend: microvm (CPUOS_BACKEND=%s; KVM boot probe passed in %.2fs: %s)",
                 choice, took, reason)
        return backend
    if choice == "microvm":
        raise BackendUnavailable(f"CPUOS_BACKEND=microvm, but the KVM boot probe failed "
                                 f"after {took:.2f}s: {reason}")
    log.info("backend: gvisor (CPUOS_BACKEND=auto; KVM boot probe failed in %.2fs: %s)",
             took, reason)
    return _gvisor(cfg)
