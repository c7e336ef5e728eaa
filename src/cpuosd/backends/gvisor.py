"""gVisor backend: one runsc sandbox per cpuos sandbox, on the runsc the project builds
(systrap platform; see ``runsc.py`` for how the binary and platform are chosen).

Root filesystem: the template tree, shared and never written, under runsc's
``--overlay2=root:<dir>`` (a per-sandbox writable layer whose file store lives
in the sandbox's own host directory). The agent runs as PID 1 (real uid 0, the
sandbox user's effective uid; commands run as the user) and reaches the host through
``--host-uds=open`` on a socket in a per-sandbox directory bind-mounted at /run/cpuos.
No network (``--network=none``).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from .. import procs
from ..homedir import PRIVATE_UMASK
from ..errors import ApiError
from .base import Capabilities, SandboxSpec
from .runsc import Runsc

log = logging.getLogger("cpuosd.gvisor")
CGROUP_ROOT = Path("/sys/fs/cgroup")

SANDBOX_UID = 1000
SANDBOX_GID = 1000
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# 2: RLIMIT_NPROC and a pids cgroup limit; 3: the writable layer a size-limited file
SPEC_VERSION = 3


def overlay_flag(spec: SandboxSpec, runsc: Runsc) -> str:
    """The writable layer: a file of disk_mib in the sandbox's host directory (gVisor's
    "anonymous" overlay file store: created and unlinked there, memory-mapped by the sentry,
    carried by a checkpoint; past its size, ENOSPC inside), with an inode limit where the
    runsc has cpuos's patch; a sandbox made before disk limits existed keeps its layer in
    sandbox memory. A restore needs the flag its checkpoint was made with."""
    if not spec.disk_mib:
        return "--overlay2=root:memory"
    size = f"{spec.disk_mib}m"
    if runsc.overlay_inodes:
        size += f"/{disk_inodes(spec.disk_mib, spec.memory_mib)}"
    return f"--overlay2=root:dir={spec.dir},size={size}"


def disk_inodes(disk_mib: int, memory_mib: int) -> int:
    """Files (inodes) the writable layer may hold: one per 16 KiB of disk (ext4's default
    ratio), at most what the host cgroup's headroom above the sandbox's memory can carry
    (each costs the sentry ~3 KiB of its own memory, which the agent's OOM killer does not
    see): 32 per MiB of memory, and 32768 at least."""
    return min(disk_mib * 64, max(32768, memory_mib * 32))


def host_memory_limit_mib(memory_mib: int) -> int:
    """The sandbox cgroup's memory limit for a sandbox of ``memory_mib``: room for the
    sentry and gofer, and for an allocation the agent's OOM killer sees only after it.
    Past it the host kills the sentry, and the whole sandbox is lost: the room is the time
    the guard has to end a process growing fast (a Python loop filling 8 MiB buffers grows
    at ~1 GiB/s here; with 256 MiB of room a small sandbox was lost on a loaded host)."""
    return memory_mib + max(512, memory_mib // 4)


def host_pids_limit(pids: int) -> int:
    """The sandbox cgroup's pids.max for a sandbox of ``pids`` guest tasks."""
    return 4 * pids + 1024


# gVisor's own kernel filesystems (nothing of the host's): every sandbox's, and a template
# build step's (cpuosd.templates.stepbox)
KERNEL_MOUNTS: tuple[dict[str, Any], ...] = (
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
     "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
     "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
     "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs",
     "options": ["nosuid", "noexec", "nodev", "ro"]},
)


def oci_spec(spec: SandboxSpec) -> dict[str, Any]:
    env = {
        "PATH": BASE_PATH,
        "HOME": "/home/user",
        "USER": "user",
        "LANG": "C.UTF-8",
        "PYTHONPATH": "/opt/cpuos",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return {
        "ociVersion": "1.0.2",
        "process": {
            # The agent starts as real root and keeps real uid 0 (no command, all of whose
            # ids are SANDBOX_UID, may signal or ptrace it), working with the sandbox
            # user's effective ids (cpuos_agent.privs); commands are started by its
            # spawner under SANDBOX_UID. Its capabilities: CAP_SYS_ADMIN (hostname, its
            # exec cgroups), CAP_SETUID/CAP_SETGID (dropping to the user); none reach a
            # command (a uid change to non-root clears them).
            "user": {"uid": 0, "gid": 0},
            "args": ["/usr/bin/python3", "-s", "-m", "cpuos_agent"],
            "env": [f"{k}={v}" for k, v in {**env, "CPUOS_UID": str(SANDBOX_UID)}.items()],
            "cwd": "/",
            "terminal": False,
            "noNewPrivileges": True,
            "capabilities": {k: ["CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID"] for k in
                             ("bounding", "effective", "permitted")},
            # RLIMIT_NPROC: the sandbox's process (task) limit, enforced by gVisor on the
            # commands' uid (the agent, with CAP_SYS_ADMIN, is exempt): a fork past it
            # fails with EAGAIN inside, and the sandbox lives on
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536},
                        *([{"type": "RLIMIT_NPROC", "hard": spec.pids, "soft": spec.pids}]
                          if spec.pids else [])],
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            *KERNEL_MOUNTS,
            {"destination": "/opt/cpuos", "type": "bind", "source": str(spec.agent_dir),
             "options": ["rbind", "ro"]},
            {"destination": "/run/cpuos", "type": "bind", "source": str(spec.sock_dir),
             "options": ["rbind", "rw"]},
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
            + ([{"type": "network", "path": spec.netns}] if spec.netns else []),
            "resources": {
                # above the sandbox's own limit, which the agent's OOM killer holds it to
                # (cpuos_agent.memguard): this one is the backstop for the whole sandbox,
                # sentry included
                "memory": {"limit": host_memory_limit_mib(spec.memory_mib) << 20},
                "cpu": {"quota": 100000 * spec.vcpus, "period": 100000},
                # the host-side backstop: about two host tasks per guest process under
                # systrap; reaching it would end the sandbox, so it sits well above
                **({"pids": {"limit": host_pids_limit(spec.pids)}} if spec.pids else {}),
            },
            "cgroupsPath": f"/cpuos/{spec.id}",
        },
    }


def log_tail(raw: bytes, limit: int = 800) -> str:
    """The end of a runsc log: its JSON lines' messages, or the text as it is."""
    out = []
    for line in raw.decode(errors="replace").splitlines():
        try:
            msg = json.loads(line).get("msg")
        except (ValueError, AttributeError):
            msg = None
        out.append(str(msg) if msg is not None else line)
    return "\n".join(out).strip()[-limit:]


class GVisorBackend:
    capabilities = Capabilities(name="gvisor", checkpoint=True, network=False, agent_key=True)

    def __init__(self, runsc: Runsc, root: Path) -> None:
        self.info = runsc
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # a checkpoint restores only into the runsc that made it, and the same OCI spec
        self.image_kind = (f"gvisor-s{SPEC_VERSION}-"
                           f"{hashlib.sha256(runsc.version.encode()).hexdigest()[:8]}")

    def runtime(self) -> dict[str, str]:
        return {"runsc": self.info.path, "runsc_version": self.info.version,
                "platform": self.info.platform, "runsc_source": self.info.source}

    def _global_flags(self) -> list[str]:
        return [self.info.path, "--root", str(self.root), f"--platform={self.info.platform}"]

    async def _run(self, *args: str, timeout: float = 30.0, log_path: Path | None = None
                   ) -> tuple[int, bytes, bytes]:
        """Run runsc through cpuosd.procs (output to files: a detached sandbox inherits
        runsc's stdio, so pipes would never reach EOF); a runsc that overruns is killed.
        Under the daemon's umask (077): its logs, state, sockets and checkpoint images
        (a paused sandbox's memory) are root's alone."""
        try:
            return await procs.run(args, timeout=timeout, log_path=log_path,
                                   umask=PRIVATE_UMASK)
        except TimeoutError:
            raise ApiError("timeout", f"runsc {' '.join(args[4:6])} did not finish within "
                           f"{timeout:.0f}s") from None

    def _bundle(self, spec: SandboxSpec) -> Path:
        bundle = spec.dir / "bundle"
        for d in (bundle, spec.sock_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(spec.sock_dir, 0o755)
        (bundle / "config.json").write_text(json.dumps(oci_spec(spec), indent=1))
        return bundle

    def _sandbox_flags(self, spec: SandboxSpec) -> list[str]:
        # --gofer-network-namespace=new: each gofer in an empty netns of its own (runsc's
        # default, one shared netns bind-mounted at <root>/null-netns, is never unmounted).
        # With a network namespace (cpuosd.network): gVisor's own netstack in it.
        net = "--network=sandbox" if spec.netns else "--network=none"
        trace = [f"--pod-init-config={spec.trace_config}"] if spec.trace_config else []
        return [*self._global_flags(), net, "--host-uds=open", overlay_flag(spec, self.info),
                *trace, *self.info.gofer_flags()]

    async def _run_detached(self, spec: SandboxSpec, *args: str, timeout: float
                            ) -> tuple[int, bytes, bytes]:
        """runsc run/restore: its stdio, which the sandbox's agent inherits as fds 0-2 (and
        code inside reaches through /proc/1/fd), is /dev/null, never a host file a sandbox
        could grow; runsc's own messages go to runsc.log (--log)."""
        log_path = spec.dir / "runsc.log"
        flags = [*self._sandbox_flags(spec), f"--log={log_path}"]
        try:
            return await procs.run([*flags, *args], timeout=timeout, log_path=log_path,
                                   null_stdio=True, umask=PRIVATE_UMASK)
        except BaseException as e:  # overran, or our caller was cancelled: runsc was killed
            self._end_strays(spec)
            if isinstance(e, TimeoutError):
                raise ApiError("timeout", f"runsc {args[0]} did not finish within "
                               f"{timeout:.0f}s") from None
            raise

    def _end_strays(self, spec: SandboxSpec) -> None:
        """What a runsc run/restore killed half-way had started: its sandbox and gofer run
        in sessions of their own (killing runsc's process group missed them), and before
        runsc has written the container's state ``runsc delete`` cannot find them: they
        would run on, ours (adopted orphans), with nobody to end them. Ended here: the
        orphans whose argv names this runsc root and this sandbox's bundle."""
        root = f"--root={self.root}".encode()
        bundle = str(spec.dir / "bundle").encode()

        def of_this_sandbox(argv: list[bytes]) -> bool:
            return (argv[0] in (b"runsc-sandbox", b"runsc-gofer") and root in argv
                    and (bundle in argv or b"--bundle=" + bundle in argv))

        pids = procs.kill_orphans(of_this_sandbox)
        if pids:
            log.warning("runsc was killed half-way through %s: ended what it had started "
                        "(pids %s)", spec.id, pids)

    async def start(self, spec: SandboxSpec) -> None:
        bundle = self._bundle(spec)
        rc, _, err = await self._run_detached(spec, "run", "--detach", "--bundle", str(bundle),
                                              spec.id, timeout=30)
        if rc != 0:
            await self.kill(spec.id)
            raise ApiError("internal", f"runsc failed to start the sandbox: {log_tail(err)}")

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        """Save the sandbox (memory, processes, writable layer) to image_dir. The sandbox
        stops, whether the checkpoint succeeded or not (runsc 2022-12); its container is
        left for ``kill`` to delete (the caller's teardown: for a pause, after it has
        answered)."""
        image_dir.mkdir(parents=True, exist_ok=True)
        rc, _, err = await self._run(*self._global_flags(), "checkpoint",
                                     f"--image-path={image_dir}", sandbox_id, timeout=120)
        if rc != 0:
            msg = err.decode(errors="replace").strip()
            line = next((x for x in msg.splitlines() if "checkpoint failed" in x), msg[-300:])
            code = "no_space" if "no space left" in msg else "internal"
            raise ApiError(code, f"runsc checkpoint failed: {line[:300]}")

    async def _delete_reaping(self, sandbox_id: str) -> bool:
        """runsc delete waits for the sandbox process (our adopted orphan) to be reaped:
        reap orphans while it waits (woken every 5 ms; each pass is one scan of our
        children, bounded by runsc delete's own timeout). False if runsc delete failed (the
        container may still be there)."""
        delete = asyncio.ensure_future(
            self._run(*self._global_flags(), "delete", "--force", sandbox_id))
        try:
            while not delete.done():
                await asyncio.to_thread(procs.reap_orphans)
                await asyncio.wait([delete], timeout=0.005)
        except BaseException:
            delete.cancel()
            raise
        rc, _, err = delete.result()
        if rc != 0 and b"not exist" not in err:
            log.warning("runsc delete %s: %s", sandbox_id, err.decode(errors="replace")[-300:])
            return False
        return True

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        bundle = self._bundle(spec)
        # --background: memory pages keep loading after restore returns (the sandbox runs
        # meanwhile); needs an uncompressed image, which is runsc's default now
        bg = ["--background"] if self.info.background_restore else []
        rc, _, err = await self._run_detached(
            spec, "restore", "--detach", *bg, f"--image-path={image_dir}", "--bundle",
            str(bundle), spec.id, timeout=120)
        if rc != 0:
            await self.kill(spec.id)
            raise ApiError("internal", f"runsc failed to restore the sandbox: {log_tail(err)}")

    # the OCI spec's layout: runsc restores an image only into a spec like its own
    # (rlimits, mounts, capabilities), so template images are per layout

    async def close(self) -> None:
        # a runsc without --gofer-network-namespace (Debian's) bind-mounts one shared gofer
        # netns at <root>/null-netns and never unmounts it; running gofers keep theirs
        null = self.root / "null-netns"
        if not self.info.gofer_netns and os.path.ismount(null):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.umount2(str(null).encode(), 2)  # MNT_DETACH

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """The sandbox cgroup's CPU time (v1 cpuacct, else v2 cpu.stat)."""
        try:
            with open(f"/sys/fs/cgroup/cpuacct/cpuos/{sandbox_id}/cpuacct.usage", "rb") as f:
                return int(f.read()) / 1e9
        except (OSError, ValueError):
            pass
        try:
            with open(f"/sys/fs/cgroup/cpuos/{sandbox_id}/cpu.stat", "rb") as f:
                for line in f:
                    k, _, v = line.partition(b" ")
                    if k == b"usage_usec":
                        return int(v) / 1e6
        except (OSError, ValueError):
            pass
        return None

    def stats(self, sandbox_id: str) -> dict[str, int | float]:
        """From the sandbox's cgroups (v1 here; v2 names too)."""
        out: dict[str, int | float] = {}
        v1, v2 = Path("/sys/fs/cgroup"), Path(f"/sys/fs/cgroup/cpuos/{sandbox_id}")

        def num(*paths: Path) -> int | None:
            for p in paths:
                try:
                    text = p.read_text().split()[0]
                except (OSError, IndexError):
                    continue
                if text.isdigit():
                    return int(text)
            return None

        ns = num(v1 / f"cpuacct/cpuos/{sandbox_id}/cpuacct.usage")
        if ns is not None:
            out["cpu_seconds"] = ns / 1e9
        else:
            try:
                for line in (v2 / "cpu.stat").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "usage_usec" and v.strip().isdigit():
                        out["cpu_seconds"] = int(v) / 1e6
            except OSError:
                pass
        for key, names in (
                ("memory_bytes", (v1 / f"memory/cpuos/{sandbox_id}/memory.usage_in_bytes",
                                  v2 / "memory.current")),
                ("memory_limit_bytes", (v1 / f"memory/cpuos/{sandbox_id}/memory.limit_in_bytes",
                                        v2 / "memory.max")),
                ("pids", (v1 / f"pids/cpuos/{sandbox_id}/pids.current", v2 / "pids.current"))):
            got = num(*names)
            if got is not None:
                out[key] = got
        used = self.disk_used(sandbox_id)
        if used is not None:
            out["disk_used_bytes"] = used
        return out

    @staticmethod
    def disk_used(sandbox_id: str) -> int | None:
        """Bytes the sandbox's writable layer holds on the host: the blocks of its overlay
        file store (an unlinked file the sentry keeps open), found among the fds of the
        processes in the sandbox's cgroup — the host's view, nothing the sandbox says."""
        procs_file = Path(f"/sys/fs/cgroup/pids/cpuos/{sandbox_id}/cgroup.procs")
        if not procs_file.exists():
            procs_file = Path(f"/sys/fs/cgroup/cpuos/{sandbox_id}/cgroup.procs")
        try:
            pids = procs_file.read_text().split()
        except OSError:
            return None
        for pid in pids[:64]:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds[:4096]:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if "/runsc-filestore-" in target and target.endswith("(deleted)"):
                        return os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
                except OSError:
                    continue
        return None

    @staticmethod
    def memory_watch(sandbox_id: str, threshold: int) -> int | None:
        """An eventfd the host kernel signals each time the sandbox's memory (its host
        cgroup's usage) crosses ``threshold`` bytes, either way (cgroup v1's memory
        thresholds: ``cgroup.event_control``); the caller owns it (closing it removes the
        watch). None where the host has no such notification (cgroup v2)."""
        base = Path(f"/sys/fs/cgroup/memory/cpuos/{sandbox_id}")
        try:
            usage = os.open(base / "memory.usage_in_bytes", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            with open(base / "cgroup.event_control", "w") as f:
                f.write(f"{efd} {usage} {int(threshold)}")
        except OSError:
            os.close(efd)
            return None
        finally:
            os.close(usage)
        return efd

    def memory_usage(self, sandbox_id: str) -> int | None:
        """Bytes the sandbox's cgroup holds (an upper bound of its checkpoint image)."""
        for p in (Path(f"/sys/fs/cgroup/memory/cpuos/{sandbox_id}/memory.usage_in_bytes"),
                  Path(f"/sys/fs/cgroup/cpuos/{sandbox_id}/memory.current")):
            try:
                return int(p.read_text())
            except (OSError, ValueError):
                continue
        return None

    async def kill(self, sandbox_id: str) -> None:
        if await self._delete_reaping(sandbox_id):
            await self._clear_cgroups(sandbox_id)

    async def _clear_cgroups(self, sandbox_id: str) -> None:
        """The sandbox's cgroups (``cpuos/<id>`` under each controller), once runsc delete
        has done its part. runsc removes them with a container it knows; of one it did not
        know (its runsc was killed before it wrote the container's state) they are left,
        with whatever of the sandbox still runs in them (a sandbox and gofer started by
        that runsc that ``_end_strays`` could not see as ours yet). What runs in them is
        killed (the cgroup says whose they are), then they are removed: 2 s at most."""
        if not sandbox_id or "/" in sandbox_id or sandbox_id in (".", ".."):
            return
        dirs = [d for d in (*CGROUP_ROOT.glob(f"*/cpuos/{sandbox_id}"),
                            CGROUP_ROOT / "cpuos" / sandbox_id) if d.is_dir()]
        if not dirs:
            return
        killed = _kill_members(sandbox_id, dirs)
        if killed:
            log.warning("%s: killed what runsc left running in its cgroups (pids %s)",
                        sandbox_id, killed)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        for d in dirs:
            while True:
                try:
                    os.rmdir(d)
                except FileNotFoundError:  # (a controller's other name for one removed)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or loop.time() > deadline:
                        log.warning("the cgroup %s of %s stays: %s", d, sandbox_id, e.strerror)
                        break
                    # (processes just killed: their exit, and our reaping of those ours)
                    await asyncio.to_thread(procs.reap_orphans)
                    await asyncio.sleep(0.02)
                else:
                    break

    async def running(self) -> dict[str, str]:
        rc, out, err = await self._run(*self._global_flags(), "list", "-format=json")
        if rc != 0:
            raise ApiError("internal", f"runsc list failed: {err.decode(errors='replace')[-300:]}")
        items = json.loads(out or b"null") or []
        out_states: dict[str, str] = {}
        for i in items:
            cid, status = str(i["id"]), str(i.get("status", ""))
            if status == "running" and not self._sandbox_alive(i.get("pid"), cid):
                # runsc reads its state file: after a checkpoint that outlived its caller
                # it still says running with no sandbox process left
                status = "stopped"
            out_states[cid] = status
        return out_states

    def _sandbox_alive(self, pid: object, cid: str) -> bool:
        """Is pid a live runsc sandbox process of this root and id (not only a pid read
        from runsc's state file, which may be stale or reused)?"""
        if not isinstance(pid, int) or pid <= 0:
            return False
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return (state != b"Z" and argv[:1] == [b"runsc-sandbox"] and cid.encode() in argv
                and f"--root={self.root}".encode() in argv)


def _kill_members(sandbox_id: str, dirs: list[Path]) -> list[int]:
    """SIGKILL every process in the sandbox's cgroups ``dirs``; their pids. Each is opened
    as a pidfd and its cgroup read again through that identity before it is signalled (a
    pid read from cgroup.procs may have exited and been reused meanwhile)."""
    pids: set[int] = set()
    for d in dirs:
        try:
            pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    mine = f"/cpuos/{sandbox_id}"
    killed = []
    for pid in sorted(pids):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                if not any(line.rstrip("\n").endswith(mine) for line in f):
                    continue
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue
        finally:
            os.close(fd)
    return killed
