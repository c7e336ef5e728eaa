"""Template build steps in a runsc sandbox: a spec's ``run`` steps, a Dockerfile's RUN, its
pip and npm installs and the base steps run as root *inside gVisor*, never on the host.

Each step is one ``runsc run`` (in the foreground; it ends with the step, as a Dockerfile's
RUN ends its container) whose root filesystem is the tree being built, written through
(``--overlay2=none``: what a step writes lands in the tree, owned by the ids it has inside).
The step is root in the sandbox with Docker's default capabilities (no CAP_SYS_ADMIN:
no mounts), ``no_new_privs``, gVisor's own /proc, /sys and /dev (nothing of the host's), the
tree's /tmp bound over runsc's usual tmpfs (so a step's files there persist, as in Docker),
and cgroup limits on memory, CPU and tasks (``CPUOS_BUILD_MEMORY_MIB``, default 4096;
``CPUOS_BUILD_VCPUS``, default the host's cores; ``CPUOS_BUILD_PIDS``, default 4096).

Network: none (``--network=none``: loopback only) unless the caller hands over a network
namespace (``netns``): the daemon attaches one to its network as it does a sandbox's, with
the build's egress policy (``CPUOS_BUILD_NETWORK``, by default the package registries'
allowlist; see api/templates.py); the step then runs gVisor's netstack in it and its traffic
goes through the daemon's egress proxy and resolver like any sandbox's. runsc takes the
interface's addresses and routes into its netstack (they are gone from the namespace when
it ends), so the runner notes them before the first step and puts them back before each
next one: the same address, which the daemon's firewall knows the build by.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import procs
from ..backends.gvisor import KERNEL_MOUNTS
from ..backends.runsc import Runsc, RunscUnavailable, find_runsc
from ..config import BuildConfig, Config
from .spec import TemplateError

Emit = Callable[[str], None]

# Docker's default capability set: what Dockerfile RUN steps expect root to have (apt drops
# to _apt, chown, setuid binaries...); inside gVisor, none of it reaches the host
CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
        "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
MAX_LINE = 16 << 10  # bytes of one output line kept (a step's output is hostile input)
DELETE_TIMEOUT = 60.0


@dataclass
class StepBox:
    """How build steps are sandboxed: the runsc, the network namespace (None: no network)
    and the limits."""
    runsc: Runsc
    netns: str | None = None
    memory_mib: int = BuildConfig.memory_mib
    vcpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    pids: int = BuildConfig.pids

    @classmethod
    def default(cls, netns: str | None = None, cfg: Config | None = None) -> StepBox:
        """The runsc and limits of ``cfg`` (default: this process's environment's)."""
        cfg = cfg or Config.from_env()
        try:
            runsc = find_runsc(cfg=cfg.runsc)
        except RunscUnavailable as e:
            raise TemplateError(f"template build steps run in a runsc sandbox, and there is "
                                f"no usable runsc: {e}") from None
        if netns is not None and not _netns_path_ok(netns):
            raise TemplateError(f"{netns!r} is not a network namespace under /run/netns")
        return cls(runsc, netns, cfg.builds.memory_mib, cfg.builds.vcpus or os.cpu_count() or 1,
                   cfg.builds.pids)


def _netns_path_ok(path: str) -> bool:
    real = os.path.realpath(path)
    return os.path.dirname(real) in ("/run/netns", "/var/run/netns") and os.path.exists(real)


def oci_spec(root: Path, argv: list[str], env: Mapping[str, str], box: StepBox,
             cid: str) -> dict[str, Any]:
    caps = {k: list(CAPS) for k in ("bounding", "effective", "permitted")}
    mounts: list[dict[str, Any]] = list(KERNEL_MOUNTS)
    tmp = root / "tmp"
    if tmp.is_dir() and not tmp.is_symlink():  # (checked with no step running)
        mounts.append({"destination": "/tmp", "type": "bind", "source": str(tmp),
                       "options": ["rbind", "rw"]})
    return {
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 0, "gid": 0}, "args": argv,
                    "env": [f"{k}={v}" for k, v in env.items()], "cwd": "/",
                    "terminal": False, "noNewPrivileges": True, "capabilities": caps,
                    "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}]},
        "root": {"path": str(root), "readonly": False},
        "hostname": "cpuos-build",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
            + ([{"type": "network", "path": box.netns}] if box.netns else []),
            "resources": {"memory": {"limit": box.memory_mib << 20},
                          "cpu": {"quota": 100000 * box.vcpus, "period": 100000},
                          "pids": {"limit": box.pids}},
            "cgroupsPath": f"/cpuos-build/{cid}",
        },
    }


@dataclass(frozen=True)
class NetConfig:
    """The build namespace's interface as the daemon made it: what each step's runsc takes."""
    netns: str  # its name under /run/netns
    iface: str
    address: str  # with its prefix length, e.g. 10.213.0.6/30
    gateway: str

    @classmethod
    def read(cls, netns_path: str) -> NetConfig:
        name = os.path.basename(netns_path)
        addrs = json.loads(_ip("-n", name, "-j", "-4", "addr", "show") or "[]")
        routes = json.loads(_ip("-n", name, "-j", "-4", "route", "show", "default") or "[]")
        for link in addrs:
            for a in link.get("addr_info") or []:
                if link.get("ifname") != "lo" and a.get("local"):
                    if not routes or not routes[0].get("gateway"):
                        break
                    return cls(name, str(link["ifname"]), f"{a['local']}/{a['prefixlen']}",
                               str(routes[0]["gateway"]))
        raise TemplateError(f"the build's network namespace {name} has no address and "
                            "default route")

    def restore(self) -> None:
        """Put the address and default route back if a step's runsc took them."""
        have = json.loads(_ip("-n", self.netns, "-j", "-4", "addr", "show", "dev", self.iface)
                          or "[]")
        if any(f"{a.get('local')}/{a.get('prefixlen')}" == self.address
               for link in have for a in link.get("addr_info") or []):
            return
        _ip("-n", self.netns, "addr", "add", self.address, "dev", self.iface)
        _ip("-n", self.netns, "link", "set", self.iface, "up")
        _ip("-n", self.netns, "route", "replace", "default", "via", self.gateway)


def _ip(*argv: str) -> str:
    rc, out, err = procs.run_sync(["ip", *argv], timeout=30, new_session=False)
    if rc != 0:
        raise TemplateError(f"ip {' '.join(argv)}: "
                            f"{err.decode(errors='replace').strip()[:300] or f'status {rc}'}")
    return out.decode(errors="replace")


class StepRunner:
    """Runs steps in sandboxes over one tree; its runsc state lives in a directory of its
    own next to the tree, removed by ``close``."""

    def __init__(self, root: Path, box: StepBox) -> None:
        self.root = root
        self.box = box
        self.net = NetConfig.read(box.netns) if box.netns else None
        self.state = Path(tempfile.mkdtemp(prefix=".steps-", dir=root.parent))
        self.n = 0

    def run(self, script: str, env: Mapping[str, str], emit: Emit, *, tail: int
            ) -> tuple[int, list[str]]:
        """``/bin/sh -euc script`` as root in a sandbox over the tree; (its exit code, its
        last lines). The sandbox is gone when this returns (or raises)."""
        self.n += 1
        if self.net is not None and self.n > 1:
            self.net.restore()
        cid = f"build-{os.getpid()}-{self.n}-{secrets.token_hex(3)}"
        bundle = self.state / cid
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(oci_spec(
            self.root, ["/bin/sh", "-euc", script], env, self.box, cid)))
        rs = self.box.runsc
        net = "--network=sandbox" if self.box.netns else "--network=none"
        argv = [rs.path, "--root", str(self.state / "runsc"), f"--platform={rs.platform}",
                net, "--overlay2=none", f"--log={bundle / 'runsc.log'}",
                *rs.gofer_flags(), "run", "--bundle", str(bundle), cid]
        try:
            rc, lines = stream(argv, emit, tail=tail)
        finally:
            self._delete(cid)
        if rc > 128 or rc < 0:  # killed, or runsc itself failed: say what runsc said
            why = _log_tail(bundle / "runsc.log")
            if why:
                lines.append(f"(runsc: {why})")
        return rc, lines

    def _delete(self, cid: str) -> None:
        """The sandbox gone, whatever happened (a foreground run that ended normally has
        removed it already)."""
        procs.run_sync([self.box.runsc.path, "--root", str(self.state / "runsc"), "delete",
                        "--force", cid], timeout=DELETE_TIMEOUT, new_session=False)

    def close(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)


def _log_tail(path: Path, limit: int = 400) -> str:
    try:
        raw = path.read_bytes()[-8192:]
    except OSError:
        return ""
    for line in reversed(raw.decode(errors="replace").splitlines()):
        if line.strip() and ("error" in line.lower() or "fail" in line.lower()):
            return line.strip()[-limit:]
    return ""


def stream(argv: list[str], emit: Emit, *, env: Mapping[str, str] | None = None,
           tail: int = 40) -> tuple[int, list[str]]:
    """Run ``argv`` with stdout and stderr line by line to ``emit`` (a line is cut at
    MAX_LINE bytes: output is untrusted); (exit code, last lines)."""
    lines: deque[str] = deque(maxlen=tail)
    fd, w = os.pipe()
    try:  # in our process group: the daemon ends a build by signalling the build's group
        child = procs.spawn(argv, stdout=w, stderr=w,
                            env=None if env is None else dict(env), new_session=False)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(w)
    buf = b""
    cut = False

    def out(raw: bytes) -> None:
        line = raw.decode(errors="replace")
        lines.append(line)
        emit(line)

    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    break
                if not cut:
                    out(buf[:i])
                cut, buf = False, buf[i + 1:]
            if len(buf) > MAX_LINE:
                if not cut:
                    out(buf[:MAX_LINE] + b" [... line cut]")
                cut, buf = True, b""
        if buf and not cut:
            out(buf)
    except BaseException:
        child.kill()
        child.wait_sync()
        raise
    finally:
        os.close(fd)
    rc = child.wait_sync()
    assert rc is not None  # (no timeout)
    return rc, list(lines)
