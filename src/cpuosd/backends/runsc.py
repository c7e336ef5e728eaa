"""Which ``runsc`` the gVisor backend runs, and on which platform.

The project builds its own runsc from the gVisor Go module pinned in
``deps/runsc/go.mod``, with its changes from ``deps/runsc/patches`` (``scripts/build-runsc.sh``),
and installs it at ``/usr/local/lib/cpuos/runsc-<version>+cpuos.<patch level>/runsc``. Order
of choice:

1. ``CPUOS_RUNSC`` (a path or a name on PATH), as the operator said;
2. the pinned build;
3. another build under the same prefix (newest first), with a warning;
4. ``runsc`` on PATH (Debian's 2022-12-19 build: ptrace only), with a warning.

The platform is ``CPUOS_RUNSC_PLATFORM`` when set, else ``systrap`` where the binary
knows it, else ``ptrace``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import procs
from ..config import Config, RunscConfig

log = logging.getLogger("cpuosd.runsc")

# The gVisor module version built by scripts/build-runsc.sh, and the level of cpuos's
# changes to it (deps/runsc/patches; a unit test keeps these, deps/runsc/go.mod and the
# build script in step).
MODULE_VERSION = "v0.0.0-20260905035102-160fafc42237"
PATCH_LEVEL = 4
PINNED_VERSION = f"{MODULE_VERSION}+cpuos.{PATCH_LEVEL}"
PLATFORMS = ("systrap", "ptrace", "kvm")
PROBE_TIMEOUT = 20.0  # s each of the commands that tell what a runsc binary can do


class RunscUnavailable(Exception):
    """No usable runsc; str() is the one-line reason."""


@dataclass(frozen=True)
class Runsc:
    path: str
    version: str  # what `runsc --version` says
    platform: str
    source: str  # env | pinned | other-build | path
    platforms: tuple[str, ...]  # those the binary knows
    # --gofer-network-namespace (not in Debian's 2022 build)
    gofer_netns: bool = False
    # restore --background (memory keeps loading after restore returns; not in Debian's)
    background_restore: bool = False

    @property
    def is_fallback(self) -> bool:
        return self.source in ("path", "other-build")

    @property
    def patch_level(self) -> int:
        """The level of cpuos's changes in this build (deps/runsc/patches), 0 for none."""
        m = re.search(r"\+cpuos\.(\d+)$", self.version)
        return int(m.group(1)) if m is not None else 0

    @property
    def overlay_inodes(self) -> bool:
        """Takes an inode limit with the overlay's size (``size=5120m/98304``: cpuos's
        patch level 1, deps/runsc/patches)."""
        return self.patch_level >= 1

    @property
    def audit_points(self) -> bool:
        """Has cpuos's trace points for the audit (level 2: file-system changes, opens
        filtered to writes in the Sentry, coalescing in the remote sink)."""
        return self.patch_level >= 2

    def gofer_flags(self) -> list[str]:
        """Each gofer in an empty netns of its own: runsc's default (one shared netns
        bind-mounted at <root>/null-netns) leaves that mount behind for good."""
        return ["--gofer-network-namespace=new"] if self.gofer_netns else []



def pinned_path(prefix: Path | None = None) -> Path:
    return (prefix or RunscConfig.prefix) / f"runsc-{PINNED_VERSION}" / "runsc"


def _probe(path: str) -> tuple[str, tuple[str, ...], bool, bool]:
    """(version, platforms known, knows --gofer-network-namespace, knows restore
    --background) of a runsc binary; raises RunscUnavailable."""
    outputs = []
    for args in (["--version"], ["flags"], ["help", "restore"]):
        try:
            rc, out, err = procs.run_sync([path, *args], timeout=PROBE_TIMEOUT)
        except OSError as e:
            raise RunscUnavailable(f"cannot run {path}: {e}") from None
        if rc == procs.KILLED:  # (at the timeout)
            raise RunscUnavailable(f"cannot run {path}: {' '.join(args)} was killed (it may "
                                   f"have taken over {PROBE_TIMEOUT:g}s)")
        outputs.append((rc, out + err))
    (rc, version), (_, text), (_, restore) = outputs
    m = re.search(rb"runsc version (\S+)", version)
    if rc != 0 or m is None:
        raise RunscUnavailable(f"{path} --version failed: {version[-200:]!r}")
    line = next((ln for ln in text.splitlines() if b"platform to use" in ln), b"")
    known = tuple(p for p in PLATFORMS if p.encode() in line) or ("ptrace",)
    return (m.group(1).decode(), known, b"-gofer-network-namespace" in text,
            b"-background" in restore)


def _others(prefix: Path) -> list[Path]:
    found = [p / "runsc" for p in prefix.glob("runsc-*") if (p / "runsc").is_file()]
    return sorted(found, key=lambda p: p.parent.name, reverse=True)


def find_runsc(prefix: Path | None = None, cfg: RunscConfig | None = None) -> Runsc:
    """The runsc ``cfg`` names (CPUOS_RUNSC, CPUOS_RUNSC_PLATFORM; default: this process's
    environment's), else the pinned build under ``prefix`` (default CPUOS_RUNSC_PREFIX),
    another build there, or the one on PATH."""
    cfg = cfg or Config.from_env().runsc
    prefix = prefix or cfg.prefix
    env = cfg.path
    candidates: list[tuple[str, str]] = []
    if env:
        found = shutil.which(env) if "/" not in env else env
        if not found or not os.access(found, os.X_OK):
            raise RunscUnavailable(f"CPUOS_RUNSC={env!r} is not an executable")
        candidates.append((found, "env"))
    else:
        pin = pinned_path(prefix)
        if pin.is_file():
            candidates.append((str(pin), "pinned"))
        candidates += [(str(p), "other-build") for p in _others(prefix) if p != pin]
        on_path = shutil.which("runsc")
        if on_path:
            candidates.append((on_path, "path"))
    if not candidates:
        raise RunscUnavailable(f"no runsc: build it with scripts/build-runsc.sh (installs "
                               f"{pinned_path(prefix)}) or install Debian's runsc")
    errors = []
    for path, source in candidates:
        try:
            version, known, gofer_netns, background = _probe(path)
        except RunscUnavailable as e:
            errors.append(str(e))
            continue
        platform = cfg.platform or (
            "systrap" if "systrap" in known else "ptrace")
        if platform not in known:
            raise RunscUnavailable(f"runsc {version} ({path}) has no platform {platform!r}; "
                                   f"it knows {', '.join(known)}")
        r = Runsc(path, version, platform, source, known, gofer_netns, background)
        if r.is_fallback:
            log.warning("runsc %s at %s is not the pinned build %s (run scripts/build-runsc.sh)"
                        "; platform %s", version, path, PINNED_VERSION, platform)
        return r
    raise RunscUnavailable("; ".join(errors))
