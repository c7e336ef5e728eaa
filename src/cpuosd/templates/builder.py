"""Template root filesystems: built with mmdebstrap from a spec (TOML or a Dockerfile subset,
see spec.py) or unpacked from an image tarball (see oci.py).

A build is cached by its digest: ``<templates_dir>/<name>-<digest>/rootfs`` plus
``<name>.json``, the info record of the current build (name, digest, rootfs, built_at,
cached, size_bytes, and for the daemon env, workdir, user, start, ready). A build goes to a
temporary directory first and is renamed into place only when it succeeded, so a failed or
interrupted build never leaves a half tree that looks finished.

A spec build runs mmdebstrap on the host (Debian's signed packages, named by the spec's
``apt`` list, which admits package names only, plus the base's: python3 for the guest
agent), then the steps one at a time: the base steps every template shares (user 1000, the
work directory), pip, npm, then the copies and the spec's run steps in their order. A shell
step is untrusted (a Dockerfile from anywhere, a package's install scripts): it runs as
root *inside a runsc sandbox* over the tree (``stepbox``), never on the host, with no
network unless the daemon gives the build one (the package registries, through its egress
proxy). Copies are done by the builder, every path resolved inside the tree. The steps see
the host's CA bundle (so a TLS-inspecting proxy on the way to the registries works); the CA
file is removed from the root afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from .oci import extract_image, image_config, resolve_in_root
from .spec import BUILTIN_DIR, DEFAULT_PATH, NAME_RE, CopySpec, Ready, TemplateError, TemplateSpec
from .stepbox import StepBox, StepRunner, stream

__all__ = ["BUILTIN_DIR", "CopySpec", "Ready", "Step", "StepBox", "TemplateError",
           "TemplateSpec", "base_apt", "base_steps", "build", "build_from_oci", "build_steps",
           "list_templates", "remove_template", "run_steps", "shell_steps",
           "spec_digest", "template_info"]

# 3: no statx compat shim (the runsc the project builds answers statx as Linux does)
BUILDER_VERSION = 3
RM_NAME_RE = re.compile(r"^[a-z0-9-]{1,64}$")
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
STEP_TAIL = 20
# The host's CA bundle is put in the root during the build steps (only), so pip, npm, curl
# and git there trust what the host trusts (e.g. a TLS-inspecting egress proxy's CA).
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CA = ".cpuos-build-ca.crt"
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS",
           "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
Emit = Callable[[str], None]


# ---- what every template gets --------------------------------------------------------------
def base_apt(spec: TemplateSpec) -> list[str]:
    """The spec's apt packages plus python3 (the guest agent is Python) and what its pip and
    npm installs need."""
    extra = ["python3"]
    if spec.pip:
        extra += ["python3-pip", "ca-certificates"]
    if spec.npm:
        extra += ["npm", "ca-certificates"]
    return list(dict.fromkeys([*spec.apt, *extra]))


def base_steps(spec: TemplateSpec) -> list[str]:
    """Shell steps run first in every new root: the sandbox user (uid and gid 1000) unless
    it is root, the work directory (made for that user unless it exists) and the agent's
    directories."""
    w = shlex.quote(spec.workdir)
    # the daemon serves each sandbox's own machine-id in /run/cpuos (new for every clone)
    dirs = "mkdir -p /run/cpuos /opt/cpuos && ln -sf /run/cpuos/machine-id /etc/machine-id"
    if spec.user == "root":
        return [f"{dirs} && mkdir -p {w}"]
    u = spec.user
    return [f"id -u {u} >/dev/null 2>&1 || "
            f"{{ groupadd -g 1000 {u} && useradd -m -u 1000 -g 1000 -s /bin/bash {u}; }}",
            f"{dirs} && if [ ! -d {w} ]; then mkdir -p {w} && chown 1000:1000 {w}; fi"]


@dataclass(frozen=True)
class Step:
    """One build step: a shell command run as root in the new root, or (``copy_from``) a
    host file or directory copied to ``copy_to`` in it."""
    label: str
    cmd: str = ""
    cwd: str = "/"
    copy_from: Path | None = None
    copy_to: str = ""


def shell_steps(cmds: Sequence[str], *, kind: str = "run", cwd: str = "/") -> list[Step]:
    return [Step(f"{kind} step {i}", cmd, cwd=cwd) for i, cmd in enumerate(cmds, 1)]


def build_steps(spec: TemplateSpec) -> list[Step]:
    """Everything after mmdebstrap, in order: base, pip, npm, then copies and run steps."""
    steps = shell_steps(base_steps(spec), kind="base")
    if spec.pip:
        steps.append(Step("pip install", "python3 -m pip install --break-system-packages "
                          "--no-cache-dir --root-user-action=ignore " + shlex.join(spec.pip)))
    if spec.npm:
        steps.append(Step("npm install", "npm install -g " + shlex.join(spec.npm)))
    copies = [Step(f"copy {c.src} -> {c.dest}", copy_from=src, copy_to=c.dest)
              for c, src in zip(spec.copy, spec.copy_sources(), strict=True)]
    runs = shell_steps(spec.run, cwd=spec.workdir)
    for i in range(len(runs) + 1):
        steps += [s for c, s in zip(spec.copy, copies, strict=True)
                  if min(c.after_run, len(runs)) == i]
        steps += runs[i:i + 1]
    return steps


def runtime(spec: TemplateSpec) -> dict[str, Any]:
    """What the daemon needs to run sandboxes of this template (kept in the info record)."""
    return {"env": dict(spec.env), "workdir": spec.workdir, "user": spec.user,
            "start": spec.start, "ready": asdict(spec.ready) if spec.ready else None}


def spec_digest(spec: TemplateSpec) -> str:
    """Covers the spec, the copied files' contents and the base."""
    files = {c.src: tree_digest(p)
             for c, p in zip(spec.copy, spec.copy_sources(), strict=True)}
    return _digest({"spec": spec.fields(), "files": files, "apt": base_apt(spec),
                    "base": base_steps(spec)})


def _digest(payload: dict[str, Any]) -> str:
    blob = json.dumps({"v": BUILDER_VERSION, **payload}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tree_digest(path: Path) -> str:
    """sha256 over a file's or a directory tree's names, types, modes, file contents and
    symlink targets."""
    h = hashlib.sha256()

    def walk(p: Path, rel: str) -> None:
        st = p.lstat()
        h.update(json.dumps([rel, stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode)]).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.fsencode(os.readlink(p)))
        elif stat.S_ISDIR(st.st_mode):
            for child in sorted(os.listdir(p)):
                walk(p / child, f"{rel}/{child}")
        elif stat.S_ISREG(st.st_mode):
            _hash_file(h, p)

    walk(path, ".")
    return h.hexdigest()


# ---- building --------------------------------------------------------------------------------
def build(spec: TemplateSpec, templates_dir: Path, *, force: bool = False,
          on_line: Emit | None = None, netns: str | None = None,
          cfg: Config | None = None) -> dict[str, Any]:
    """Build (or find cached) the template; returns its info record. Its steps run in runsc
    sandboxes, with the network namespace ``netns`` (prepared by the daemon) or none, and
    the runsc and limits of ``cfg`` (default: the environment's)."""
    _need_root()
    if shutil.which("mmdebstrap") is None:
        raise TemplateError("mmdebstrap is not installed (apt-get install mmdebstrap)")
    spec.validate(spec.name)  # a missing or escaping COPY source fails here, before mmdebstrap
    apt = base_apt(spec)
    steps = build_steps(spec)

    def populate(rootfs: Path, emit: Emit) -> None:
        box = StepBox.default(netns, cfg)  # no runsc: refused before mmdebstrap's minute
        emit("I: build steps run in a runsc sandbox (" + (
            f"network: the daemon's, namespace {os.path.basename(netns)})" if netns
            else "no network)"))
        rc, tail = stream(["mmdebstrap", f"--variant={spec.variant}", "--mode=root",
                           "--format=directory", f"--include={','.join(apt)}", spec.suite,
                           str(rootfs)], emit)
        if rc != 0:
            raise TemplateError(f"mmdebstrap failed (exit {rc}); last lines:\n" + "\n".join(tail))
        run_steps(rootfs, steps, env=spec.env, on_line=emit, box=box)

    record: dict[str, Any] = {"source": "spec", "packages": apt, **runtime(spec)}
    return _build_tree(templates_dir, spec.name, spec_digest(spec), record, populate,
                       force=force, on_line=on_line)


def build_from_oci(tar_path: str | Path, name: str, templates_dir: Path, *, force: bool = False,
                   on_line: Emit | None = None) -> dict[str, Any]:
    """A template from a ``docker save`` tarball or an OCI layout tarball: its layers. The
    digest covers the tarball's bytes."""
    _need_root()
    if not NAME_RE.fullmatch(name):
        raise TemplateError(f"bad template name {name!r} (want ^[a-z0-9][a-z0-9-]{{0,63}}$)")
    tar = Path(tar_path)
    if not tar.is_file():
        raise TemplateError(f"{tar}: no such file")
    h = hashlib.sha256()
    _hash_file(h, tar)
    config = image_config(tar)
    env = dict(str(e).partition("=")[::2] for e in config.get("Env") or [])

    def populate(rootfs: Path, emit: Emit) -> None:
        rootfs.mkdir()
        extract_image(tar, rootfs, emit)
        if not resolve_in_root(rootfs, "usr/bin/python3").is_file():
            raise TemplateError("the image has no /usr/bin/python3, which the cpuos guest "
                                "agent needs")

    record: dict[str, Any] = {
        "source": "oci", "tarball": str(tar.resolve()), "packages": [], "env": env,
        "workdir": config.get("WorkingDir") or "/", "user": config.get("User") or "root",
        "start": None, "ready": None}
    return _build_tree(templates_dir, name, _digest({"oci": h.hexdigest()}), record, populate,
                       force=force, on_line=on_line)


def _build_tree(templates_dir: Path, name: str, digest: str, record: dict[str, Any],
                populate: Callable[[Path, Emit], None], *, force: bool,
                on_line: Emit | None) -> dict[str, Any]:
    """The build-or-cache frame around ``populate(rootfs, emit)``: temporary directory, log,
    rename into place, info record."""
    final = templates_dir / f"{name}-{digest}"
    info_path = templates_dir / f"{name}.json"
    info: dict[str, Any] = {"name": name, "digest": digest, "rootfs": str(final / "rootfs"),
                            **record}
    if (final / "rootfs").is_dir() and not force:
        old = _read_json(info_path)
        if old.get("digest") != digest:
            old = {"built_at": (final / "rootfs").stat().st_mtime}
        info.update(built_at=old.get("built_at"), build_seconds=old.get("build_seconds"),
                    size_bytes=old.get("size_bytes") or disk_usage(final), cached=True)
        _write_json(info_path, info)
        return info
    templates_dir.mkdir(parents=True, exist_ok=True)
    work = templates_dir / f".build-{name}-{digest}-{os.getpid()}"
    _rmtree(work)
    work.mkdir()
    log_path = templates_dir / f"{name}-{digest}.log"
    t0 = time.time()
    try:
        with open(log_path, "w") as logf:
            def emit(line: str) -> None:
                logf.write(line + "\n")
                if on_line:
                    on_line(line)

            populate(work / "rootfs", emit)
    except TemplateError as e:
        _rmtree(work)
        first, _, rest = str(e).partition("\n")
        raise TemplateError(f"{first} (log: {log_path})" + (f"\n{rest}" if rest else "")) \
            from None
    except BaseException:
        _rmtree(work)
        raise
    if final.exists():
        _rmtree(final)
    os.rename(work, final)
    info.update(built_at=time.time(), build_seconds=round(time.time() - t0, 1),
                size_bytes=disk_usage(final), cached=False)
    _write_json(info_path, info)
    return info


# ---- build steps -----------------------------------------------------------------------------
def run_steps(root: Path, steps: Sequence[Step], *, env: Mapping[str, str] | None = None,
              on_line: Emit | None = None, box: StepBox | None = None) -> None:
    """Run ``steps`` one at a time over ``root``: a shell step as root in a runsc sandbox
    (``box``: the runsc, network and limits; default: no network), a copy by the builder.
    Output goes to ``on_line``. A failing step raises TemplateError naming it, its command,
    its exit code and its last lines."""
    emit = on_line or (lambda _line: None)
    root = root.resolve()
    runner = StepRunner(root, box or StepBox.default())
    try:
        with _host_ca(root) as ca_env:
            full_env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8",
                        "DEBIAN_FRONTEND": "noninteractive", **ca_env,
                        **{k: os.environ[k] for k in PROXY_VARS if k in os.environ},
                        **(env or {})}
            for step in steps:
                if step.copy_from is not None:
                    emit(f"I: {step.label}")
                    try:
                        copy_into(root, step.copy_from, step.copy_to)
                    except (OSError, TemplateError) as e:
                        raise TemplateError(f"{step.label} failed: {e}") from None
                    continue
                emit(f"I: {step.label}: {step.cmd}")
                script = step.cmd if step.cwd == "/" else \
                    f"cd {shlex.quote(step.cwd)}\n{step.cmd}"
                rc, tail = runner.run(script, full_env, emit, tail=STEP_TAIL)
                if rc != 0:
                    raise TemplateError(f"{step.label} failed with exit code {rc}: "
                                        f"{' '.join(step.cmd.split())}\n" + "\n".join(tail))
    finally:
        runner.close()


@contextmanager
def _host_ca(root: Path) -> Iterator[dict[str, str]]:
    """The host's CA bundle in ``root`` while the steps run; yields the variables that point
    the usual tools at it."""
    if not HOST_CA.is_file():
        yield {}
        return
    dest = root / BUILD_CA
    _remove_entry(dest)
    shutil.copyfile(HOST_CA, dest)
    try:
        yield {k: "/" + BUILD_CA for k in CA_VARS}
    finally:
        _remove_entry(dest)  # (a step may have put anything there)


def _remove_entry(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (from /proc/self/mounts)."""
    prefix = str(path.resolve())
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[1])
            if mnt == prefix or mnt.startswith(prefix + "/"):
                out.append(mnt)
    return out


def copy_into(root: Path, src: Path, dest: str) -> None:
    """Copy the host file or directory ``src`` to ``dest`` in ``root`` (a file goes inside
    ``dest`` when that is a directory or ends in '/'; a directory's contents go into
    ``dest``). Every path is resolved inside the root, so nothing is written through a
    symlink to the host."""
    if not src.is_dir() and (dest.endswith("/") or resolve_in_root(root, dest).is_dir()):
        dest = posixpath.join(dest, src.name)
    _copy_entry(src, resolve_in_root(root, dest))


def _copy_entry(src: Path, target: Path) -> None:
    """``target``'s parents are real directories (resolved in the root)."""
    real_dir = target.is_dir() and not target.is_symlink()
    if src.is_dir() and not src.is_symlink():
        if not real_dir:
            if os.path.lexists(target):
                target.unlink()
            target.mkdir(parents=True)
            shutil.copystat(src, target)
        for child in sorted(src.iterdir()):
            _copy_entry(child, target / child.name)
        return
    if real_dir:
        raise TemplateError(f"cannot replace directory {target} with {src}")
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(target):
        target.unlink()
    if src.is_symlink():
        os.symlink(os.readlink(src), target)
    else:
        shutil.copy2(src, target)


# ---- the cache -------------------------------------------------------------------------------
def template_info(templates_dir: Path, name: str) -> dict[str, Any] | None:
    info = _read_json(templates_dir / f"{name}.json")
    rootfs = info.get("rootfs")
    if not isinstance(rootfs, str) or not rootfs or not Path(rootfs).is_dir():
        return None
    return info


def list_templates(templates_dir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(templates_dir.glob("*.json")):
        info = template_info(templates_dir, p.stem)
        if info:
            out.append(info)
    return out


def remove_template(templates_dir: Path, name: str) -> list[Path]:
    """Delete every build of ``name`` (``<name>-<digest>`` dirs and logs) and ``<name>.json``;
    returns what was removed. Sandboxes still running from it will break."""
    if not RM_NAME_RE.fullmatch(name):
        raise TemplateError(f"bad template name {name!r} (want ^[a-z0-9-]{{1,64}}$)")
    if not templates_dir.is_dir():
        return []
    ours = re.compile(rf"{re.escape(name)}-[0-9a-f]{{16}}(\.log)?|{re.escape(name)}\.json")
    gone = sorted(p for p in templates_dir.iterdir() if ours.fullmatch(p.name))
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            _rmtree(p, strict=True)
        else:
            p.unlink()
    return gone


def disk_usage(path: Path) -> int:
    """Bytes allocated under ``path`` (hard-linked files counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in [".", *dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _rmtree(path: Path, *, strict: bool = False) -> None:
    """rmtree that refuses to run into a mount (nothing is mounted in a tree any more: a
    mount found there is someone else's)."""
    if not path.exists():
        return
    left = mounts_under(path)
    if left:
        raise TemplateError(f"not removing {path}: still mounted there: {', '.join(left)}")
    shutil.rmtree(path, ignore_errors=not strict)


def _need_root() -> None:
    if os.geteuid() != 0:
        raise TemplateError("building a template needs root (mmdebstrap in root mode, "
                            "runsc, file ownership)")


def _hash_file(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(p: Path, data: dict[str, Any]) -> None:
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, p)


