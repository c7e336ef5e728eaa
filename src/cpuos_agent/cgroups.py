"""A cgroup per exec: what a command started, however it forks, setsids, double-forks or
clears its environment, stays in its exec's cgroup (a process cannot leave a cgroup
without write access to another one's ``cgroup.procs``, and this tree is root's), so a
timeout or a kill reaches every one of them.

The tree is mounted by the agent in root mode (``privs.py``) at ``CGROUP_DIR``, owned by
root, read-only for everyone else: cgroup v2 where the kernel has it (a microVM guest;
``cgroup.kill`` ends a cgroup at once), else a v1 hierarchy: ``pids`` (gVisor: its
``pids.max`` set to 0 stops all forking before the kill), else a named one.

Without root mode, or if no cgroup can be mounted, there is no tree (``setup`` returns
None) and exec falls back to a process-tree scan (``reaper.kill_tree``).

Memory: under gVisor (v1) a second hierarchy, ``memory``, is mounted at ``MEM_DIR`` with a
cgroup per exec beside its ``pids`` one; gVisor accounts memory per cgroup there, which
is what ``memguard`` reads to find the exec to end when the sandbox reaches its memory
limit. With v2 both are one tree.

Stdlib only: it runs inside every sandbox."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import signal
import threading
import time

from .privs import privileged

CGROUP_DIR = "/run/cpuos-exec"
MEM_DIR = "/run/cpuos-mem"
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
KILL_ROUNDS = 400  # x KILL_WAIT: how long a kill keeps at it (a process in D state...)
KILL_WAIT = 0.005
GC_INTERVAL = 1.0


class Cgroup:
    """One exec's cgroup: its path, and its ``cgroup.procs`` open for writing (opened once,
    with privilege; a write through it needs none)."""

    __slots__ = ("fd", "mem_fd", "mem_path", "path")

    def __init__(self, path: str, fd: int, mem_path: str | None = None,
                 mem_fd: int | None = None) -> None:
        self.path, self.fd = path, fd
        self.mem_path, self.mem_fd = mem_path, mem_fd


class Cgroups:
    def __init__(self, root: str, kind: str) -> None:
        self.root = root
        self.kind = kind  # "v2", "pids" or "named"
        self._n = itertools.count(1)
        self._lock = threading.Lock()
        self._leftover: set[str] = set()  # released while processes were still in them
        self._gc_at = 0.0
        self._spare: Cgroup | None = None
        with privileged():
            self._home = os.open(os.path.join(root, "cgroup.procs"),
                                 os.O_WRONLY | os.O_CLOEXEC)
        # the memory hierarchy's root (v1: its own mount; v2: this tree) and its
        # cgroup.procs (where the agent is)
        self.mem_root: str | None = root if kind == "v2" else None
        self._mem_home: int | None = None

    def _mount_memory(self, libc: ctypes.CDLL, flags: int, root: str = MEM_DIR) -> None:
        try:
            os.makedirs(root, mode=0o755, exist_ok=True)
            if libc.mount(b"cgroup", root.encode(), b"cgroup", flags, b"memory") != 0:
                return
            os.chmod(root, 0o755)
            self._mem_home = os.open(os.path.join(root, "cgroup.procs"),
                                     os.O_WRONLY | os.O_CLOEXEC)
            self.mem_root = root
        except OSError:
            self.mem_root = None

    @classmethod
    def setup(cls, root: str = CGROUP_DIR) -> Cgroups | None:
        """Mount the tree (the agent is still real root, single-threaded). None if no
        cgroup filesystem can be mounted here."""
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            os.makedirs(root, mode=0o755, exist_ok=True)
        except OSError:
            return None
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        kind = None
        for fstype, data, what in (("cgroup2", "", "v2"), ("cgroup", "pids", "pids"),
                                   ("cgroup", "none,name=cpuos", "named")):
            if libc.mount(b"cgroup", root.encode(), fstype.encode(), flags,
                          data.encode() or None) == 0:
                kind = what
                break
        if kind is None:
            return None
        try:
            # gVisor makes the root 0555, and root here has no DAC override: make it
            # writable by its owner (root) only
            os.chmod(root, 0o755)
            cgs = cls(root, kind)
        except OSError:
            return None
        if kind != "v2":
            cgs._mount_memory(libc, flags)
        return cgs

    # ---- one exec's cgroup ------------------------------------------------------------
    def take(self) -> Cgroup:
        """A new, empty cgroup for an exec (the spare one ``refill`` made, if any)."""
        with self._lock:
            cg, self._spare = self._spare, None
        return cg if cg is not None else self._make()

    def refill(self) -> None:
        """Make the next exec's cgroup ahead of time (off its critical path)."""
        with self._lock:
            if self._spare is not None:
                return
        cg = self._make()
        with self._lock:
            if self._spare is None:
                self._spare = cg
                return
        self.release(cg)  # another exec made one meanwhile

    def _make(self) -> Cgroup:
        self.gc()
        name = f"x{next(self._n)}"
        path = os.path.join(self.root, name)
        with privileged():
            os.mkdir(path, 0o755)
            try:
                fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                os.rmdir(path)
                raise
            mem_path, mem_fd = None, None
            if self._mem_home is not None and self.mem_root is not None:
                try:
                    mem_path = os.path.join(self.mem_root, name)
                    os.mkdir(mem_path, 0o755)
                    mem_fd = os.open(os.path.join(mem_path, "cgroup.procs"),
                                     os.O_WRONLY | os.O_CLOEXEC)
                except OSError:  # memory accounting is for the guard: go on without
                    if mem_path is not None:
                        self._rmdir(mem_path)
                    mem_path = None
            elif self.kind == "v2":
                mem_path = path
        return Cgroup(path, fd, mem_path, mem_fd)

    def enter(self, cg: Cgroup, pid: int) -> None:
        """Move process pid (all its threads) into cg."""
        os.write(cg.fd, str(pid).encode())
        if cg.mem_fd is not None:
            try:
                os.write(cg.mem_fd, str(pid).encode())
            except OSError:
                pass

    def leave(self, pid: int) -> None:
        """Move process pid back to the root of the tree (where the agent is)."""
        os.write(self._home, str(pid).encode())
        if self._mem_home is not None:
            try:
                os.write(self._mem_home, str(pid).encode())
            except OSError:
                pass

    # ---- memory -----------------------------------------------------------------------
    def memory_usage(self, cg: Cgroup | None = None) -> int | None:
        """Bytes charged to cg (None: to the whole sandbox, the hierarchy's root)."""
        base = self.mem_root if cg is None else cg.mem_path
        if base is None:
            return None
        name = "memory.current" if self.kind == "v2" else "memory.usage_in_bytes"
        if cg is None and self.kind == "v2":
            return _meminfo_used()
        try:  # (os.open/read: 3 system calls, where a text-mode open() makes 9)
            fd = os.open(os.path.join(base, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                return int(os.read(fd, 64).split()[0])
            finally:
                os.close(fd)
        except (OSError, ValueError, IndexError):
            return None

    def leftovers(self) -> list[Cgroup]:
        """The cgroups of execs that ended while processes they started still run
        (``nohup ... &``), as handles for ``memory_usage`` and ``kill`` (no fd)."""
        with self._lock:
            paths = list(self._leftover)
        out = []
        for p in paths:
            if os.path.dirname(p) != self.root:
                continue  # (the memory hierarchy's twin of one)
            name = os.path.basename(p)
            mem = (os.path.join(self.mem_root, name) if self.mem_root and self.kind != "v2"
                   else p if self.kind == "v2" else None)
            out.append(Cgroup(p, -1, mem))
        return out

    def oom_killed(self, cg: Cgroup) -> bool:
        """v2: the kernel's OOM killer ended a process of cg (memory.events)."""
        if self.kind != "v2" or cg.mem_path is None:
            return False
        try:
            with open(os.path.join(cg.mem_path, "memory.events")) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        return int(v) > 0
        except (OSError, ValueError):
            pass
        return False

    def procs(self, path: str) -> list[int]:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill(self, cg: Cgroup) -> None:
        """SIGKILL every process in the cgroup, also those forked meanwhile, until none is
        left (or KILL_ROUNDS passed)."""
        path = cg.path
        if self.kind == "v2":
            try:
                with privileged():
                    with open(os.path.join(path, "cgroup.kill"), "w") as f:
                        f.write("1")
            except OSError:
                pass
        elif self.kind == "pids":
            try:  # no more forks in there: what is listed is everything
                with privileged():
                    with open(os.path.join(path, "pids.max"), "w") as f:
                        f.write("0")
            except OSError:
                pass
        stopped: set[int] = set()
        for _ in range(KILL_ROUNDS):
            pids = self.procs(path)
            if not pids:
                return
            if self.kind == "named":
                # no way to stop forks: stop everything first (a stopped process cannot
                # fork), until a pass finds nobody new, then kill
                new = set(pids) - stopped
                if new:
                    for p in new:
                        _signal(p, signal.SIGSTOP)
                    stopped |= new
                    continue
            for p in pids:
                _signal(p, signal.SIGKILL)
            time.sleep(KILL_WAIT)

    def release(self, cg: Cgroup) -> None:
        """The exec is over: remove its cgroup, or keep it while processes it left running
        (background jobs) are still in there."""
        for fd in (cg.fd, cg.mem_fd):
            try:
                if fd is not None:
                    os.close(fd)
            except OSError:
                pass
        for path in {cg.path, cg.mem_path}:
            if path is not None and not self._rmdir(path):
                with self._lock:
                    self._leftover.add(path)

    def _rmdir(self, path: str) -> bool:
        try:
            with privileged():
                os.rmdir(path)
            return True
        except OSError as e:
            return e.errno == errno.ENOENT

    def has_leftovers(self) -> bool:
        """Ended execs' cgroups still hold processes (as of the last ``gc``)."""
        with self._lock:
            return bool(self._leftover)

    def gc(self) -> None:
        """Remove the ended execs' cgroups that emptied (at most every GC_INTERVAL)."""
        now = time.monotonic()
        with self._lock:
            if now - self._gc_at < GC_INTERVAL or not self._leftover:
                return
            self._gc_at = now
            todo = list(self._leftover)
        for p in todo:
            if self._rmdir(p):
                with self._lock:
                    self._leftover.discard(p)


def _meminfo_used() -> int | None:
    """MemTotal - MemAvailable of /proc/meminfo, in bytes."""
    vals: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("MemTotal", "MemAvailable"):
                    vals[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(vals) != 2:
        return None
    return vals["MemTotal"] - vals["MemAvailable"]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass
