"""Template specs (TOML) and the root filesystem builder (mmdebstrap).

A build is cached by the sha256 of its spec: ``$CPUOS_HOME/templates/<name>-<hash>/rootfs``
plus ``<name>.json`` pointing at the current build. A build goes to a temporary
directory first and is renamed into place only when it succeeded, so a failed or
interrupted build never leaves a half tree that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BUILDER_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*$")
BUILTIN_DIR = Path(__file__).parent / "builtin"
KNOWN_KEYS = {"name", "suite", "variant", "apt", "run"}
SHIMS_DIR = Path(__file__).parent / "shims"
SHIM_DEST = "usr/local/lib/cpuos"


class TemplateError(Exception):
    pass


@dataclass
class TemplateSpec:
    name: str
    suite: str = "bookworm"
    variant: str = "minbase"
    apt: list[str] = field(default_factory=list)
    run: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, name_or_path: str) -> TemplateSpec:
        p = Path(name_or_path)
        if not p.suffix:
            p = BUILTIN_DIR / f"{name_or_path}.toml"
            if not p.exists():
                known = ", ".join(sorted(x.stem for x in BUILTIN_DIR.glob("*.toml")))
                raise TemplateError(f"no built-in template {name_or_path!r} (known: {known})")
        try:
            data = tomllib.loads(p.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise TemplateError(f"{p}: {e}") from None
        unknown = set(data) - KNOWN_KEYS
        if unknown:
            raise TemplateError(f"{p}: unknown key(s) {sorted(unknown)}; "
                                f"known: {sorted(KNOWN_KEYS)}")
        spec = cls(**data)
        if not NAME_RE.fullmatch(spec.name):
            raise TemplateError(f"{p}: bad template name {spec.name!r}")
        bad = [x for x in spec.apt if not PKG_RE.fullmatch(x)]
        if bad:
            raise TemplateError(f"{p}: bad package name(s) {bad}")
        return spec

    def digest(self) -> str:
        shims = {p.name: p.read_text() for p in sorted(SHIMS_DIR.glob("*.c"))}
        blob = json.dumps({"v": BUILDER_VERSION, **asdict(self), "shims": shims},
                          sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def template_info(templates_dir: Path, name: str) -> dict[str, Any] | None:
    p = templates_dir / f"{name}.json"
    try:
        info: dict[str, Any] = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not Path(info.get("rootfs", "")).is_dir():
        return None
    return info


def list_templates(templates_dir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(templates_dir.glob("*.json")):
        info = template_info(templates_dir, p.stem)
        if info:
            out.append(info)
    return out


def build(spec: TemplateSpec, templates_dir: Path, *, force: bool = False,
          on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build (or find cached) the template; returns its info record."""
    if os.geteuid() != 0:
        raise TemplateError("building a template needs root (mmdebstrap in root mode)")
    if shutil.which("mmdebstrap") is None:
        raise TemplateError("mmdebstrap is not installed (apt-get install mmdebstrap)")
    digest = spec.digest()
    final = templates_dir / f"{spec.name}-{digest}"
    info_path = templates_dir / f"{spec.name}.json"
    info: dict[str, Any] = {"name": spec.name, "digest": digest, "rootfs": str(final / "rootfs"),
            "packages": spec.apt}
    if (final / "rootfs").is_dir() and not force:
        info["built_at"] = json.loads(info_path.read_text()).get("built_at") \
            if info_path.exists() else time.time()
        info["cached"] = True
        _write_json(info_path, info)
        return info
    templates_dir.mkdir(parents=True, exist_ok=True)
    work = templates_dir / f".build-{spec.name}-{digest}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    log_path = templates_dir / f"{spec.name}-{digest}.log"
    hooks = []
    for cmd in spec.run:
        hooks += ["--customize-hook", f'chroot "$1" /bin/sh -euc {_shq(cmd)}']
    argv = ["mmdebstrap", f"--variant={spec.variant}", "--mode=root", "--format=directory",
            f"--include={','.join(spec.apt)}", *hooks, spec.suite, str(work / "rootfs")]
    tail: deque[str] = deque(maxlen=40)
    t0 = time.time()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            tail.append(line.rstrip())
            if on_line:
                on_line(line.rstrip())
        rc = proc.wait()
    if rc != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise TemplateError(f"mmdebstrap failed (exit {rc}); log {log_path}; last lines:\n"
                            + "\n".join(tail))
    try:
        install_shims(work / "rootfs", on_line)
    except TemplateError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)
    info.update(built_at=time.time(), build_seconds=round(time.time() - t0, 1), cached=False)
    _write_json(info_path, info)
    return info


def install_shims(rootfs: Path, on_line: Callable[[str], None] | None = None) -> None:
    """Compile the compat shims (shims/*.c) with the host's gcc into the new root and list
    them in its /etc/ld.so.preload (see statx_no_automount.c for why)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise TemplateError("gcc is needed to build the template's compat shims "
                            "(apt-get install gcc libc6-dev)")
    dest = rootfs / SHIM_DEST
    dest.mkdir(parents=True, exist_ok=True)
    preload = []
    for src in sorted(SHIMS_DIR.glob("*.c")):
        out = dest / (src.stem + ".so")
        r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(out), str(src)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise TemplateError(f"compiling shim {src.name} failed:\n{r.stderr[-2000:]}")
        preload.append("/" + SHIM_DEST + "/" + out.name)
        if on_line:
            on_line(f"I: installed compat shim {out.name}")
    (rootfs / "etc" / "ld.so.preload").write_text("\n".join(preload) + "\n")


def _write_json(p: Path, data: dict[str, Any]) -> None:
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, p)


def _shq(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"
