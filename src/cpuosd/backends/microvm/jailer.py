"""Our jailer: what Firecracker's ``jailer`` does, for any VMM binary (QEMU here).

Run as root::

    python -m cpuosd.backends.microvm.jailer --id ID --exec-file /usr/bin/qemu-system-x86_64 \\
        --uid 300001 --gid 300001 --chroot-base /var/lib/cpuos/microvm/jail \\
        [--file SRC[:DST]]... [--bind SRC:DST[:ro|rw]]... [--netns /run/netns/x | --new-netns] \\
        [--tap tap0] \\
        [--cgroup memory.limit_in_bytes=...]... [--rlimit nofile=N] [--rlimit fsize=N] \\
        -- VMM-ARGS...

In order, it:

1. closes every fd but 0-2 (and those named by ``--keep-fd``: the VMM inherits them, e.g.
   a template's RAM memfd it opens as ``/proc/self/fd/N``, with ``--mount-proc``) and
   clears the environment (the VMM is exec'd with none);
2. validates the id (``^[a-z0-9-]{1,64}$``), the uid/gid (never 0) and every path: the
   chroot base must be an absolute, existing directory reached without symlinks, the
   jail directory ``<base>/<exec-name>/<id>`` must not exist yet, and no destination
   inside it may be a symlink or a hard link;
3. makes the chroot ``<base>/<exec-name>/<id>/root`` and hard-links (or copies, across
   devices) the VMM binary to ``/<exec-name>`` and each ``--file`` into it;
4. creates the cgroup ``<parent>/<id>`` (v1: under each controller's hierarchy; v2:
   in the unified one), writes the limits, and joins it;
5. sets rlimits (nofile, fsize, ...), joins the network namespace given by path (or, with
   ``--new-netns``, makes an empty one of its own: nothing named on the host, it goes when
   the VMM does); with ``--tap NAME`` makes a persistent tap device there owned by the
   sandbox uid/gid, which the VMM opens by name (the daemon may move it into the
   sandbox's namespace later: its open file keeps working);
6. unshares the pid namespace and forks: the child is PID 1 of its own pid namespace.
   The child unshares mount (+ IPC, UTS) namespaces, makes every mount private, does
   the ``--bind`` mounts, ``pivot_root``\\ s into the chroot (old root detached), remounts
   ``/`` read-only, mounts a small tmpfs on ``/dev`` holding ``/dev/kvm`` and
   ``/dev/net/tun`` owned by the sandbox uid (plus null, zero, urandom), drops the
   whole capability bounding set, ``setgroups([])``, setresgid/setresuid to the
   sandbox ids, sets no_new_privs and a parent-death SIGKILL, then execs the VMM
   with an empty environment;
7. the parent stays outside as the VMM's supervisor: it records the VMM's host pid in
   ``<jail>/vmm.pid``, forwards SIGTERM/SIGINT/SIGHUP to it and exits with its status;
   with ``--detach`` it records the pid, waits until the VMM has been exec'd (or reports
   the child's error, status 127) and exits 0: no supervisor process stays per VM (it
   costs ~8 MiB), the VMM is reparented to the nearest subreaper (cpuosd) and has no
   parent-death signal.

``cleanup(id, chroot_base)`` kills whatever is left in the jail's cgroup, removes the
cgroup directories and the jail directory. It is idempotent.

The child after ``pivot_root`` cannot import anything: every module it uses is
imported at the top of this file.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import re
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

ID_RE = re.compile(r"[a-z0-9-]{1,64}")
DEFAULT_PARENT_CGROUP = "cpuos-microvm"
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "pids", "blkio", "devices", "freezer")
RLIMITS = {
    "nofile": resource.RLIMIT_NOFILE,
    "fsize": resource.RLIMIT_FSIZE,
    "nproc": resource.RLIMIT_NPROC,
    "core": resource.RLIMIT_CORE,
    "memlock": resource.RLIMIT_MEMLOCK,
}
DEFAULT_RLIMITS = {"nofile": 2048, "core": 0}
PID_FILE = "vmm.pid"
JAILER_PID_FILE = "jailer.pid"

# name -> (path in the jail, major, minor, owned by the sandbox uid (mode 0600) or not (0666))
DEVICES: dict[str, tuple[str, int, int, bool]] = {
    "kvm": ("/dev/kvm", 10, 232, True),
    "tun": ("/dev/net/tun", 10, 200, True),
    "null": ("/dev/null", 1, 3, False),
    "zero": ("/dev/zero", 1, 5, False),
    "urandom": ("/dev/urandom", 1, 9, False),
}
DEFAULT_DEVICES = ("kvm", "tun", "null", "zero", "urandom")
TAP_RE = re.compile(r"[a-z][a-z0-9]{0,14}")
# linux/if_tun.h
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000

# linux/sched.h, linux/mount.h, linux/prctl.h
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_libc.syscall.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p]


class JailError(Exception):
    """A refused or failed jail setup; the message says what and why."""


@dataclass(frozen=True)
class JailPaths:
    jail_dir: Path  # <base>/<exec-name>/<id>
    root: Path  # the chroot: <jail_dir>/root
    exec_in_jail: str  # /<exec-name>

    @property
    def pid_file(self) -> Path:
        return self.jail_dir / PID_FILE

    def host_path(self, jail_path: str) -> Path:
        """The host path of a path inside the jail (e.g. a QMP socket under /run)."""
        return self.root / jail_path.lstrip("/")


@dataclass
class JailConfig:
    id: str
    exec_file: Path
    uid: int
    gid: int
    chroot_base: Path
    args: list[str] = field(default_factory=list)
    files: list[tuple[str, str]] = field(default_factory=list)  # (host src, jail dst)
    binds: list[tuple[str, str, bool]] = field(default_factory=list)  # (src, dst, read-only)
    netns: Path | None = None
    new_netns: bool = False  # an empty network namespace of its own (not with netns)
    tap: str | None = None  # a persistent tap, owned by uid/gid, in the VMM's namespace
    cgroups: list[tuple[str, str]] = field(default_factory=list)  # (file, value)
    cgroup_version: int | None = None  # None: detect
    parent_cgroup: str = DEFAULT_PARENT_CGROUP
    rlimits: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_RLIMITS))
    devices: tuple[str, ...] = DEFAULT_DEVICES
    writable_dirs: tuple[str, ...] = ("/run",)
    mount_proc: bool = False
    exec_dest: str | None = None  # default /<exec-name>
    keep_fds: tuple[int, ...] = ()  # open fds the VMM inherits (e.g. a RAM memfd)
    detach: bool = False  # exit once the VMM runs instead of supervising it

    def version_or_detect(self, root: Path = CGROUP_ROOT) -> int:
        return self.cgroup_version or cgroup_version(root)


# ---- validation ----------------------------------------------------------------------------

def check_id(value: str) -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise JailError(f"invalid jail id {str(value)[:80]!r}: must match ^[a-z0-9-]{{1,64}}$")
    return value


def check_chroot_base(base: Path | str) -> Path:
    p = str(base)
    if not p or not os.path.isabs(p):
        raise JailError(f"chroot base {p!r} must be an absolute path")
    norm = os.path.normpath(p)
    if not os.path.isdir(norm):
        raise JailError(f"chroot base {p!r} is not an existing directory")
    if os.path.realpath(norm) != norm:
        raise JailError(f"chroot base {p!r} goes through a symlink "
                        f"(resolves to {os.path.realpath(norm)!r})")
    return Path(norm)


def _check_jail_path(p: str, what: str) -> str:
    if not p.startswith("/") or "\x00" in p:
        raise JailError(f"{what} {p!r} must be an absolute path inside the jail")
    if ".." in p.split("/"):
        raise JailError(f"{what} {p!r} may not contain '..'")
    norm = os.path.normpath(p)
    if norm == "/":
        raise JailError(f"{what} may not be the jail's root")
    return norm


def jail_paths(sandbox_id: str, exec_file: Path | str, chroot_base: Path | str,
               exec_dest: str | None = None) -> JailPaths:
    """Where a jail lives. ``exec_dest``: the VMM's path inside the jail (default
    ``/<exec-name>``, as Firecracker's jailer; QEMU wants its host path, since it finds its
    firmware and modules relative to its own location)."""
    check_id(sandbox_id)
    name = os.path.basename(str(exec_file))
    if not name or name in (".", "..") or not re.fullmatch(r"[A-Za-z0-9._+-]{1,128}", name):
        raise JailError(f"exec file name {name!r} is not usable as a jail directory name")
    jail_dir = Path(os.path.normpath(str(chroot_base))) / name / sandbox_id
    dest = "/" + name if exec_dest is None else _check_jail_path(exec_dest, "exec destination")
    return JailPaths(jail_dir, jail_dir / "root", dest)


# ---- placing files into the chroot ---------------------------------------------------------

def _mkdirs_in(root: Path, rel_parent: str, mode: int = 0o755) -> Path:
    """Create the directories of ``rel_parent`` below ``root``, refusing symlinked ones."""
    cur = root
    for part in [x for x in rel_parent.split("/") if x]:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            os.mkdir(cur, mode)
            st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            raise JailError(f"refusing symlink on the way to a jail destination: {cur}")
        if not stat.S_ISDIR(st.st_mode):
            raise JailError(f"{cur} is in the way of a jail destination and is not a directory")
    return cur


def place_file(root: Path, src: str, dst: str) -> Path:
    """Hard-link (or copy across devices) the regular file ``src`` to ``dst`` in the jail.

    The destination must not exist: a symlink or a hard link planted there is refused.
    """
    if not os.path.isabs(src):
        raise JailError(f"file {src!r} must be an absolute host path")
    real = os.path.realpath(src)
    try:
        sst = os.stat(real)
    except OSError as e:
        raise JailError(f"file {src!r} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(sst.st_mode):
        raise JailError(f"file {src!r} is not a regular file")
    dst = _check_jail_path(dst, "destination")
    target = root / dst.lstrip("/")
    _mkdirs_in(root, os.path.dirname(dst))
    try:
        dstat = os.lstat(target)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISLNK(dstat.st_mode):
            raise JailError(f"refusing symlink destination {target}")
        if stat.S_ISREG(dstat.st_mode) and dstat.st_nlink > 1:
            raise JailError(f"refusing hard-linked destination {target}")
        raise JailError(f"destination {target} already exists")
    try:
        os.link(real, target, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise JailError(f"cannot link {real} to {target}: {e.strerror}") from None
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     sst.st_mode & 0o755)
        with os.fdopen(fd, "wb") as out, open(real, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)
    return target


def ldd_deps(binary: str | Path) -> list[str]:
    """Absolute paths of the shared libraries ``binary`` loads (as the loader names them),
    the ELF interpreter included, from ``ldd``."""
    from ... import procs  # (the jailer itself runs as a program of its own: import late)

    rc, bout, berr = procs.run_sync(["ldd", str(binary)],
                                    env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
    stdout, stderr = bout.decode(errors="replace"), berr.decode(errors="replace")
    if rc != 0:
        if "not a dynamic executable" in (stdout + stderr):
            return []
        raise JailError(f"ldd {binary} failed: {(stderr or stdout).strip()[:300]}")
    out: list[str] = []
    for line in stdout.splitlines():
        line = line.strip()
        if "not found" in line:
            raise JailError(f"{binary}: missing library: {line}")
        if "=>" in line:
            path = line.split("=>", 1)[1].strip().split(" (")[0].strip()
        else:
            path = line.split(" (")[0].strip()
        if path.startswith("/") and path not in out:
            out.append(path)
    return out


# ---- cgroups --------------------------------------------------------------------------------

def cgroup_version(root: Path = CGROUP_ROOT) -> int:
    return 2 if (root / "cgroup.controllers").exists() else 1


def cgroup_limits(version: int, *, cpus: float | None = None, memory_bytes: int | None = None,
                  pids: int | None = None, period_us: int = 100_000) -> list[tuple[str, str]]:
    """Cgroup files and values for the usual limits, in the form ``--cgroup`` takes."""
    out: list[tuple[str, str]] = []
    if version == 2:
        if cpus is not None:
            out.append(("cpu.max", f"{int(cpus * period_us)} {period_us}"))
        if memory_bytes is not None:
            out += [("memory.max", str(memory_bytes)), ("memory.swap.max", "0")]
        if pids is not None:
            out.append(("pids.max", str(pids)))
    else:
        if cpus is not None:
            out += [("cpu.cfs_period_us", str(period_us)),
                    ("cpu.cfs_quota_us", str(int(cpus * period_us)))]
        if memory_bytes is not None:
            out.append(("memory.limit_in_bytes", str(memory_bytes)))
        if pids is not None:
            out.append(("pids.max", str(pids)))
    return out


def _check_parent_cgroup(parent: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*", parent) or ".." in parent.split("/"):
        raise JailError(f"bad parent cgroup {parent!r}")
    return parent


def cgroup_dirs(sandbox_id: str, parent: str = DEFAULT_PARENT_CGROUP,
                version: int | None = None, controllers: Iterable[str] | None = None,
                root: Path = CGROUP_ROOT) -> list[Path]:
    """The jail's cgroup directories (existing or not): one per v1 controller, or one (v2)."""
    check_id(sandbox_id)
    _check_parent_cgroup(parent)
    v = version or cgroup_version(root)
    if v == 2:
        return [root / parent / sandbox_id]
    ctrls = V1_CONTROLLERS if controllers is None else tuple(controllers)
    return [root / c / parent / sandbox_id for c in ctrls if (root / c).is_dir()]


def _write_whole(path: Path, text: str) -> None:
    """A file whoever reads it sees whole or not at all (written aside, then renamed): the
    pid files, which the daemon (and the tests) may read while the jailer writes them."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise JailError(f"cannot write {value!r} to {path}: {e.strerror}") from None


def setup_cgroup(cfg: JailConfig, root: Path = CGROUP_ROOT) -> list[Path]:
    """Create the cgroup(s), write the limits and move this process in. Returns the dirs."""
    version = cfg.version_or_detect(root)
    parent = _check_parent_cgroup(cfg.parent_cgroup)
    by_ctrl: dict[str, list[tuple[str, str]]] = {}
    for fname, value in cfg.cgroups:
        ctrl = fname.split(".", 1)[0]
        by_ctrl.setdefault(ctrl, []).append((fname, value))
    made: list[Path] = []
    if version == 2:
        leaf = root / parent / cfg.id
        wanted = sorted(by_ctrl)
        # enable the controllers on the way down (the root and each parent level)
        level = root
        for part in parent.split("/"):
            _enable_v2(level, wanted)
            level = level / part
            level.mkdir(exist_ok=True)
        _enable_v2(level, wanted)
        leaf.mkdir()
        made.append(leaf)
        for fname, value in cfg.cgroups:
            _write(leaf / fname, value)
        _write(leaf / "cgroup.procs", str(os.getpid()))
        return made
    ctrls = sorted(set(by_ctrl) | {"pids", "memory", "cpu"})
    for ctrl in ctrls:
        base = root / ctrl
        if not base.is_dir():
            if ctrl in by_ctrl:
                raise JailError(f"cgroup v1 controller {ctrl!r} is not mounted at {base}")
            continue
        level = base
        for part in parent.split("/"):
            level = level / part
            if not level.exists():
                level.mkdir()
                if ctrl == "cpuset":
                    _inherit_cpuset(level)
        leaf = level / cfg.id
        leaf.mkdir()
        made.append(leaf)
        if ctrl == "cpuset":
            _inherit_cpuset(leaf)
        for fname, value in by_ctrl.get(ctrl, []):
            _write(leaf / fname, value)
    for leaf in made:
        _write(leaf / "cgroup.procs", str(os.getpid()))
    return made


def _enable_v2(level: Path, controllers: Sequence[str]) -> None:
    if not controllers:
        return
    avail = (level / "cgroup.controllers").read_text().split()
    missing = [c for c in controllers if c not in avail]
    if missing:
        raise JailError(f"cgroup v2 controllers {missing} not available at {level}")
    _write(level / "cgroup.subtree_control", " ".join("+" + c for c in controllers))


def _inherit_cpuset(d: Path) -> None:
    for f in ("cpuset.cpus", "cpuset.mems"):
        if not (d / f).read_text().strip():
            _write(d / f, (d.parent / f).read_text().strip())


def cgroup_pids(dirs: Iterable[Path]) -> set[int]:
    pids: set[int] = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
    return pids


def remove_cgroup(sandbox_id: str, parent: str = DEFAULT_PARENT_CGROUP,
                  root: Path = CGROUP_ROOT, timeout: float = 5.0) -> None:
    """SIGKILL everything in the jail's cgroup, then remove its directories."""
    dirs = [d for d in cgroup_dirs(sandbox_id, parent, root=root) if d.is_dir()]
    if not dirs:
        return
    kill_file = dirs[0] / "cgroup.kill"
    if kill_file.exists():
        with contextlib.suppress(OSError):
            kill_file.write_text("1")
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids(dirs)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise JailError(f"processes {sorted(pids)} in jail {sandbox_id} do not die")
        time.sleep(0.01)
    for d in dirs:
        for _ in range(100):  # rmdir can race with the last exit being accounted
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise JailError(f"cannot remove cgroup {d}: {e.strerror}") from None
                time.sleep(0.02)


def cleanup(sandbox_id: str, chroot_base: Path | str, exec_name: str | None = None,
            parent_cgroup: str = DEFAULT_PARENT_CGROUP) -> None:
    """Remove everything a jail made: kill its processes (via its cgroup), remove the cgroup
    and ``<base>/<exec-name>/<id>`` (every exec name when none is given). Idempotent."""
    check_id(sandbox_id)
    base = Path(os.path.normpath(str(chroot_base)))
    remove_cgroup(sandbox_id, parent_cgroup)
    names = [exec_name] if exec_name else (
        [p.name for p in base.iterdir()] if base.is_dir() else [])
    for name in names:
        exec_dir = base / name
        jail_dir = exec_dir / sandbox_id
        try:
            st = os.lstat(jail_dir)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(os.lstat(exec_dir).st_mode) or stat.S_ISLNK(st.st_mode):
            os.unlink(jail_dir)  # never follow a symlink out of the jail base
            continue
        shutil.rmtree(jail_dir)


# ---- the jail itself ------------------------------------------------------------------------

def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(e)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    _check(_libc.mount(src.encode() if src else None, target.encode(),
                       fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), f"mount {src} on {target}")


def _pivot_root(new_root: str) -> None:
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise JailError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(new_root)
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")


def _last_cap() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


def _drop_privileges(uid: int, gid: int, last_cap: int, pdeathsig: bool = True) -> None:
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0),
           "clearing ambient capabilities")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # clears the permitted and effective sets (no KEEP_CAPS)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")
    if pdeathsig:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "setting pdeathsig")
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid or os.getgroups():
        raise JailError("privileges were not dropped")


def make_tap(name: str, uid: int, gid: int) -> None:
    """A persistent tap ``name`` in the current network namespace that only uid/gid may
    attach to (no capability needed for them; the VMM has none)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(),
                                               IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETOWNER, uid)
        fcntl.ioctl(fd, TUNSETGROUP, gid)
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def _make_devices(cfg: JailConfig) -> None:
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k,nr_inodes=64")
    for name in cfg.devices:
        path, major, minor, owned = DEVICES[name]
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.mknod(path, (0o600 if owned else 0o666) | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(path, 0o600 if owned else 0o666)
        if owned:
            os.chown(path, cfg.uid, cfg.gid)


def _child(cfg: JailConfig, paths: JailPaths, parent_alive: int) -> None:
    """In the new pid namespace (as PID 1): mounts, pivot_root, devices, drop, exec.
    ``parent_alive``: the read end of a pipe whose write end only the parent holds."""
    last_cap = _last_cap()  # while the host's /proc is still visible
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare(mount, ipc, uts)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = str(paths.root)
    _mount(root, root, None, MS_BIND | MS_REC)  # pivot_root needs a mount point
    for d in cfg.writable_dirs:  # stay writable when / becomes read-only
        host = str(paths.host_path(d))
        _mount(host, host, None, MS_BIND)
        _mount(None, host, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for src, dst, ro in cfg.binds:
        target = str(paths.host_path(dst))
        _mount(src, target, None, MS_BIND)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC | (MS_RDONLY if ro else 0)
        _mount(None, target, None, flags)
    _pivot_root(root)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _make_devices(cfg)
    if cfg.mount_proc:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _drop_privileges(cfg.uid, cfg.gid, last_cap, pdeathsig=not cfg.detach)
    # pdeathsig is armed only now (a credential change clears it): if the parent died
    # before, its end of the pipe is closed and we must not outlive it.
    if select.select([parent_alive], [], [], 0)[0]:
        raise JailError("the jailer's parent process died during setup")
    os.execve(paths.exec_in_jail, [paths.exec_in_jail, *cfg.args], {})


def prepare(cfg: JailConfig) -> JailPaths:
    """Validate everything and build the chroot directory (the steps before any namespace)."""
    check_id(cfg.id)
    if cfg.uid <= 0 or cfg.gid <= 0:
        raise JailError("uid and gid must be positive (never root)")
    base = check_chroot_base(cfg.chroot_base)
    exe = str(cfg.exec_file)
    if not os.path.isabs(exe) or not os.path.isfile(exe):
        raise JailError(f"exec file {exe!r} must be an absolute path to an existing file")
    paths = jail_paths(cfg.id, exe, base, cfg.exec_dest)
    exec_dir = paths.jail_dir.parent
    for src, dst, _ro in cfg.binds:
        if not os.path.isabs(src) or not os.path.exists(src):
            raise JailError(f"bind source {src!r} must be an absolute existing path")
        _check_jail_path(dst, "bind destination")
    for d in cfg.writable_dirs:
        _check_jail_path(d, "writable dir")
    for name in cfg.devices:
        if name not in DEVICES:
            raise JailError(f"unknown device {name!r} (known: {', '.join(DEVICES)})")
    for fd in cfg.keep_fds:
        if fd <= 2:
            raise JailError(f"--keep-fd {fd}: only fds above 2")
        try:
            os.fstat(fd)
        except OSError:
            raise JailError(f"--keep-fd {fd}: not an open file descriptor") from None
    for k in cfg.rlimits:
        if k not in RLIMITS:
            raise JailError(f"unknown rlimit {k!r} (known: {', '.join(RLIMITS)})")
    for fname, _ in cfg.cgroups:
        if not re.fullmatch(r"[a-z]+\.[a-z_.]+", fname):
            raise JailError(f"bad cgroup file {fname!r}")
    if cfg.netns is not None and cfg.new_netns:
        raise JailError("--netns and --new-netns exclude each other")
    if cfg.tap is not None and not TAP_RE.fullmatch(cfg.tap):
        raise JailError(f"bad tap name {cfg.tap[:40]!r}: must match {TAP_RE.pattern}")
    if cfg.netns is not None and not os.path.exists(cfg.netns):
        raise JailError(f"network namespace {str(cfg.netns)!r} does not exist")
    try:
        st = os.lstat(exec_dir)
    except FileNotFoundError:
        os.mkdir(exec_dir, 0o755)
        st = os.lstat(exec_dir)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise JailError(f"refusing {exec_dir}: it is a symlink or not a directory")
    try:
        os.mkdir(paths.jail_dir, 0o755)
    except FileExistsError:
        raise JailError(f"jail {paths.jail_dir} already exists (stale? call cleanup first)"
                        ) from None
    try:
        os.mkdir(paths.root, 0o755)
        place_file(paths.root, exe, paths.exec_in_jail)
        for src, dst in cfg.files:
            place_file(paths.root, src, dst)
        for d in cfg.writable_dirs:
            made = _mkdirs_in(paths.root, d)
            os.chown(made, cfg.uid, cfg.gid)
            os.chmod(made, 0o700)
        for d in ("/dev", "/proc") if cfg.mount_proc else ("/dev",):
            _mkdirs_in(paths.root, d)
        for src, dst, _ro in cfg.binds:
            dst = _check_jail_path(dst, "bind destination")
            if os.path.isdir(src):
                _mkdirs_in(paths.root, dst)
            else:
                parent = _mkdirs_in(paths.root, os.path.dirname(dst))
                fd = os.open(parent / os.path.basename(dst),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                os.close(fd)
    except BaseException:
        shutil.rmtree(paths.jail_dir, ignore_errors=True)
        raise
    return paths


def run(cfg: JailConfig) -> int:
    """Jail and run the VMM; returns its exit status (128+signal if killed)."""
    paths = prepare(cfg)
    try:
        setup_cgroup(cfg)
        for name, value in cfg.rlimits.items():
            resource.setrlimit(RLIMITS[name], (value, value))
        if cfg.netns is not None:
            fd = os.open(cfg.netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), f"joining network namespace {cfg.netns}")
            finally:
                os.close(fd)
        elif cfg.new_netns:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(net)")
        if cfg.tap is not None:
            make_tap(cfg.tap, cfg.uid, cfg.gid)
        _check(_libc.unshare(CLONE_NEWPID), "unshare(pid)")
    except BaseException:
        with contextlib.suppress(JailError, OSError):
            cleanup(cfg.id, cfg.chroot_base, paths.jail_dir.parent.name, cfg.parent_cgroup)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    alive_r, alive_w = os.pipe()  # both close-on-exec
    exec_r, exec_w = os.pipe()  # the child's execve closes exec_w: EOF = the VMM runs
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            os.close(exec_r)
            _child(cfg, paths, alive_r)
        except BaseException as e:  # report and exit: the child never returns
            with contextlib.suppress(OSError):
                msg = f"jailer: {e}\n".encode(errors="replace")
                os.write(2, msg)
                os.write(exec_w, msg)
        os._exit(127)
    os.close(alive_r)
    os.close(exec_w)
    _write_whole(paths.jail_dir / PID_FILE, f"{pid}\n")
    if cfg.detach:
        # wait for the exec (or the child's error), then leave the VMM to the nearest
        # subreaper (cpuosd) instead of staying beside it as a supervisor process
        with os.fdopen(exec_r, "rb") as f:
            failed = f.read()
        os.close(alive_w)
        if failed:
            os.waitpid(pid, 0)
            return 127
        return 0
    os.close(exec_r)
    _write_whole(paths.jail_dir / JAILER_PID_FILE, f"{os.getpid()}\n")

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# ---- command line ---------------------------------------------------------------------------

def _file(s: str) -> tuple[str, str]:
    src, _, dst = s.partition(":")
    return src, dst or src


def _bind(s: str) -> tuple[str, str, bool]:
    parts = s.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise JailError(f"bad --bind {s!r}: expected SRC:DST[:ro|rw]")
    return parts[0], parts[1], len(parts) == 2 or parts[2] == "ro"


def _kv(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k:
        raise JailError(f"expected NAME=VALUE, got {s!r}")
    return k, v


def _rlimit(s: str) -> tuple[str, int]:
    k, v = _kv(s)
    try:
        return k, int(v)
    except ValueError:
        raise JailError(f"bad --rlimit {k}={v!r}: not an integer") from None


def _cgroup_version(s: str) -> int:
    if s not in ("1", "2"):
        raise JailError(f"bad --cgroup-version {s!r}: 1 or 2")
    return int(s)


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


@dataclass(frozen=True)
class Opt:
    """One JailConfig field on the command line. kind: ``one`` (--x=V), ``many`` (--x=V
    repeated, a list), ``pairs`` (--x=K=V repeated, a dict), ``csv`` (--x=A,B), ``flag``."""

    field: str
    flag: str
    kind: str
    decode: Callable[[str], Any] = str
    encode: Callable[[Any], str] = str
    help: str = ""


# The one table the writer (jailer_argv) and the parser (parse_args) are both made from.
OPTIONS: tuple[Opt, ...] = (
    Opt("id", "--id", "one"),
    Opt("exec_file", "--exec-file", "one", Path),
    Opt("uid", "--uid", "one", int),
    Opt("gid", "--gid", "one", int),
    Opt("chroot_base", "--chroot-base", "one", Path),
    Opt("parent_cgroup", "--parent-cgroup", "one"),
    Opt("files", "--file", "many", _file, lambda f: f"{f[0]}:{f[1]}", "SRC[:DST]"),
    Opt("binds", "--bind", "many", _bind,
        lambda b: f"{b[0]}:{b[1]}:{'ro' if b[2] else 'rw'}", "SRC:DST[:ro|rw]"),
    Opt("netns", "--netns", "one", Path),
    Opt("new_netns", "--new-netns", "flag",
        help="an empty network namespace of the VMM's own (instead of --netns)"),
    Opt("tap", "--tap", "one",
        help="make a persistent tap NAME owned by --uid/--gid in the VMM's namespace"),
    Opt("cgroup_version", "--cgroup-version", "one", _cgroup_version),
    Opt("cgroups", "--cgroup", "many", _kv, lambda kv: f"{kv[0]}={kv[1]}", "FILE=VALUE"),
    Opt("rlimits", "--rlimit", "pairs", _rlimit, lambda kv: f"{kv[0]}={kv[1]}", "NAME=VALUE"),
    Opt("devices", "--devices", "csv"),
    Opt("writable_dirs", "--writable-dirs", "csv"),
    Opt("mount_proc", "--mount-proc", "flag",
        help="mount a proc of the jail's pid namespace (for posture probes)"),
    Opt("exec_dest", "--exec-dest", "one",
        help="the VMM's path inside the jail (default /<exec-name>)"),
    Opt("keep_fds", "--keep-fd", "many", int, help="an open fd (> 2) the VMM inherits"),
    Opt("detach", "--detach", "flag",
        help="exit 0 once the VMM has been exec'd (the VMM is left to the nearest "
             "subreaper) instead of supervising it"),
)
REQUIRED = ("id", "exec_file", "uid", "gid", "chroot_base")


def config_argv(cfg: JailConfig, python: str | None = None) -> list[str]:
    """The argv that runs the VMM jailed with cfg (``python -I -m ...jailer``); every
    option as --opt=value, so a value starting with '-' is never taken for an option."""
    check_id(cfg.id)
    argv = [python or sys.executable, "-I", "-m", "cpuosd.backends.microvm.jailer"]
    for o in OPTIONS:
        v = getattr(cfg, o.field)
        if o.kind == "one":
            if v is not None:
                argv.append(f"{o.flag}={o.encode(v)}")
        elif o.kind == "many":
            argv += [f"{o.flag}={o.encode(x)}" for x in v]
        elif o.kind == "pairs":
            argv += [f"{o.flag}={o.encode(kv)}" for kv in v.items()]
        elif o.kind == "csv":
            argv.append(f"{o.flag}={','.join(v)}")
        elif v:
            argv.append(o.flag)
    return [*argv, "--", *cfg.args]


def jailer_argv(*, sandbox_id: str, exec_file: Path | str, uid: int, gid: int,
                chroot_base: Path | str, args: Sequence[str],
                files: Iterable[str | tuple[str, str]] = (),
                binds: Iterable[tuple[str, str, bool]] = (),
                netns: Path | str | None = None, new_netns: bool = False,
                tap: str | None = None, cgroups: Iterable[tuple[str, str]] = (),
                cgroup_version: int | None = None,
                parent_cgroup: str = DEFAULT_PARENT_CGROUP,
                rlimits: dict[str, int] | None = None,
                devices: Sequence[str] | None = None,
                writable_dirs: Sequence[str] | None = None,
                mount_proc: bool = False, exec_dest: str | None = None,
                keep_fds: Sequence[int] = (), detach: bool = False,
                python: str | None = None) -> list[str]:
    """config_argv of the JailConfig these make."""
    check_id(sandbox_id)
    cfg = JailConfig(
        id=sandbox_id, exec_file=Path(exec_file), uid=uid, gid=gid,
        chroot_base=Path(chroot_base), args=list(args),
        files=[(f, f) if isinstance(f, str) else (f[0], f[1]) for f in files],
        binds=list(binds), netns=Path(netns) if netns is not None else None,
        new_netns=new_netns, tap=tap,
        cgroups=list(cgroups), cgroup_version=cgroup_version, parent_cgroup=parent_cgroup,
        rlimits={**DEFAULT_RLIMITS, **(rlimits or {})},
        devices=tuple(devices) if devices is not None else DEFAULT_DEVICES,
        writable_dirs=tuple(writable_dirs) if writable_dirs is not None else ("/run",),
        mount_proc=mount_proc, exec_dest=exec_dest, keep_fds=tuple(keep_fds), detach=detach)
    return config_argv(cfg, python)


def parse_args(argv: Sequence[str]) -> JailConfig:
    ap = argparse.ArgumentParser(prog="python -m cpuosd.backends.microvm.jailer",
                                 description="Run a VMM jailed (Firecracker-jailer style).")
    for o in OPTIONS:
        dest = o.field
        if o.kind == "flag":
            ap.add_argument(o.flag, dest=dest, action="store_true", help=o.help)
        elif o.kind in ("many", "pairs"):
            ap.add_argument(o.flag, dest=dest, action="append", default=[], help=o.help)
        else:
            ap.add_argument(o.flag, dest=dest, required=o.field in REQUIRED, help=o.help)
    ap.add_argument("args", nargs="*")
    ns = ap.parse_args(list(argv))
    fields: dict[str, Any] = {"args": list(ns.args)}
    for o in OPTIONS:
        raw = getattr(ns, o.field)
        if o.kind == "flag":
            fields[o.field] = bool(raw)
        elif o.kind == "many":
            fields[o.field] = [o.decode(x) for x in raw]
        elif o.kind == "pairs":
            fields[o.field] = {**DEFAULT_RLIMITS, **dict(o.decode(x) for x in raw)}
        elif raw is None:
            continue  # the JailConfig default
        elif o.kind == "csv":
            fields[o.field] = _csv(raw)
        else:
            fields[o.field] = o.decode(raw)
    fields["keep_fds"] = tuple(fields["keep_fds"])
    return JailConfig(**fields)


def _kept_fds(args: Sequence[str]) -> set[int]:
    """The ``--keep-fd=N`` options (N > 2) before ``--``; read before argparse runs, since
    every other fd is closed first."""
    out: set[int] = set()
    for a in args:
        if a == "--":
            break
        if a.startswith("--keep-fd="):
            with contextlib.suppress(ValueError):
                fd = int(a.removeprefix("--keep-fd="))
                if fd > 2:
                    out.add(fd)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    # First, before anything can be inherited or leak: no fds but 0-2, no environment.
    args = sys.argv[1:] if argv is None else list(argv)
    keep = sorted(_kept_fds(args))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = min(max(x for x in (soft, hard, 1024) if x != resource.RLIM_INFINITY), 1 << 20)
    low = 3
    for fd in [*keep, top]:  # close_range(2) around the kept ones: cheap whatever the bound
        os.closerange(low, fd)
        low = fd + 1
    os.environ.clear()
    if os.geteuid() != 0:
        print("jailer: error: must run as root", file=sys.stderr)
        return 2
    try:
        cfg = parse_args(args)
        return run(cfg)
    except JailError as e:
        print(f"jailer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"jailer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
