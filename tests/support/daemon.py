"""A real cpuosd for tests and benchmarks: own $CPUOS_HOME (runsc root, SQLite, sandboxes),
shared template cache (CPUOS_TEMPLATES_DIR, default /var/lib/cpuos/templates).

Teardown kills every sandbox the daemon made, stops it by pid, deletes any runsc
container left in its root (and reports it), and keeps the daemon log of a failed
run under .cache/test-artifacts/.
"""

from __future__ import annotations

import contextlib
import glob
import json
import fcntl
import os
import random
import shutil
import sqlite3
import signal
import socket
import subprocess
import sys
import tempfile
import zlib
import time
import warnings
from pathlib import Path
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypedDict

import httpx
import psutil

from cpuosd.backends.base import SandboxSpec
from cpuosd.backends.runsc import RunscUnavailable, find_runsc
from cpuosd.config import Config

if TYPE_CHECKING:
    from cpuos import Sandbox

TEMPLATES = Path(os.environ.get("CPUOS_TEMPLATES_DIR", "/var/lib/cpuos/templates"))
# the template snapshot images every test daemon shares (CPUOS_TEMPLATE_IMAGES_DIR): one
# directory per test session, made by tests/conftest.py (pytest_configure, on xdist's
# controller: its workers inherit the variable) and deleted at its end; unset: each daemon's own
SHARED_IMAGES_ENV = "CPUOSTEST_TEMPLATE_IMAGES"
ARTIFACTS = Path.cwd() / ".cache" / "test-artifacts"


def e2e_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (runsc as root)"
    try:
        find_runsc()
    except RunscUnavailable as e:
        return f"no runsc: {e}"
    if not (TEMPLATES / "python.json").exists():
        return f"python template not built in {TEMPLATES} (cpuos template build python)"
    return None


class SdkKwargs(TypedDict):
    """What Sandbox.create/connect/resume/list take to reach this daemon."""

    api_url: str
    api_key: str


# One client for the helpers' polls of plain-http listeners on loopback (a daemon's /health
# while it starts, an API process's): httpx.get makes a client each call, and each client
# builds a TLS context (certifi's bundle), ~18 ms of CPU: 0.35 s of CPU per daemon start
# polled every 50 ms. Thread-safe; no keep-alive (a poll is a new connection, as before).
_POLL = httpx.Client(verify=False, limits=httpx.Limits(max_keepalive_connections=0))


def http_get(url: str, timeout: float = 2, **kw: object) -> httpx.Response:
    """GET url (http://, loopback) through the helpers' one client."""
    return _POLL.get(url, timeout=timeout, **kw)  # type: ignore[arg-type]


def oserror_after(sbx: Sandbox, step: str, upto: int, setup: str = "",
                  timeout: str = "2m") -> tuple[int, int]:
    """Run, inside ``sbx``, the Python statement ``step`` for n in range(upto) until it
    raises OSError (a limit met: EAGAIN, ENOSPC...): (n, errno) of that failure. ``setup``
    is Python run first. A loop that never fails is an AssertionError."""
    script = f"{setup}\nn = 0\ntry:\n    for n in range({upto}):\n        {step}\n" \
             "except OSError as e:\n    print(n, e.errno)\nelse:\n    print('no OSError')\n"
    sbx.files.write("/tmp/oserror_after.py", script)
    r = sbx.exec("python3 /tmp/oserror_after.py", timeout=timeout)
    out = r.stdout.split()
    assert r.exit_code == 0 and len(out) == 2 and out[0].isdigit(), (r.stdout, r.stderr)
    return int(out[0]), int(out[1])


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll cond (every 50 ms) until it holds; TimeoutError naming what after timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """wait_until in an event loop: poll cond (every 10 ms, the loop's other tasks running
    meanwhile) until it holds; TimeoutError naming what after timeout."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below path (e.g. a runsc root's null-netns a daemon left)."""
    prefix = str(path).rstrip("/") + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return [p for p in points if p.startswith(prefix) or p == str(path)]


def held_flocks(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of the files process ``pid`` holds an flock on (/proc/locks)."""
    out = set()
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts:
                continue  # (a waiter)
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[4] == str(pid):
                major, minor, inode = parts[5].split(":")
                out.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
    return out


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def free_port() -> int:
    """A port on 127.0.0.1 for a test listener, chosen below the kernel's ephemeral range:
    a port the kernel picks (a daemon's own listeners on port 0, an outgoing connection)
    never lands on it between our choice and the listener's bind (a node of a test cluster
    once found its port taken by the node started just before it). Random, so test workers
    rarely pick the same one; checked free; the kernel's choice if none is found."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100) if low > 12000 else ():
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end has closed (or reset) the connection, without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


NET_SLOTS = 6400
NET_LOCKS = Path("/tmp/cpuos-test-net-slots")


def _claim_net_slot(start: int) -> tuple[int, int]:
    """A network slot (names, addresses, NFLOG group: ``Daemon.net_env``) no other live
    test daemon on this host holds, from ``start`` on: (slot, the fd of its lock, held until
    ``release_net_slot``). Daemons of other test runs share the host: a slot derived from
    the port alone collided now and then (NFLOG group busy: the daemon refused to start)."""
    NET_LOCKS.mkdir(mode=0o700, exist_ok=True)
    for i in range(NET_SLOTS):
        k = (start + i) % NET_SLOTS
        fd = os.open(NET_LOCKS / f"{k}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return k, fd
    raise RuntimeError("no free network slot for a test daemon")


def net_env_of(k: int) -> dict[str, str]:
    """The network environment (names, addresses, NFLOG group) of network slot ``k``."""
    return {"CPUOS_NET_ID": f"t{k:03x}"[-4:], "CPUOS_DEFAULT_NETWORK": "off",
            "CPUOS_NET_POOL": f"10.{100 + k // 64}.{(k % 64) * 4}.0/22",
            "CPUOS_NETNS_POOL": "1", "CPUOS_NFLOG_GROUP": str(1000 + k),
            "CPUOS_PREVIEW_PORT": "0"}


@contextmanager
def net_slot_env() -> Iterator[dict[str, str]]:
    """A network slot of the test's own (for a cpuosd.network.Network made in the test
    process), held until the block ends."""
    k, fd = _claim_net_slot(os.getpid() % NET_SLOTS)
    try:
        yield net_env_of(k)
    finally:
        os.close(fd)


class Daemon:
    """One cpuosd process, restartable (SIGKILL and start again on the same home)."""

    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.extra_env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.net_slot, self._net_lock = _claim_net_slot(self.port % NET_SLOTS)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "cpuosd.log"

    def start(self) -> None:
        """Start the daemon and wait for its /health; a port another process took meanwhile
        (two test workers' daemons picked the same one: ours cannot bind it, and /health
        answered from the other) is said by our process not listening on it: a new port,
        a new start (at most three)."""
        for _ in range(3):
            if self._start_once():
                return
            print(f"test daemon {self.home}: port {self.port} was another process's; "
                  "starting again on a new one", file=sys.stderr)
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        raise RuntimeError(f"test daemon {self.home}: no port of its own in three tries")

    def _listening(self) -> bool:
        """Is our process (not another) the one listening on our port?"""
        assert self.proc is not None
        try:
            conns = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                   for c in conns)

    def _start_once(self) -> bool:
        # (gVisor's: a microVM image names files of its maker's $CPUOS_HOME/microvm)
        shared = (os.environ.get(SHARED_IMAGES_ENV)
                  if self.extra_env.get("CPUOS_BACKEND", "gvisor") == "gvisor" else None)
        env = {**os.environ, "CPUOS_HOME": str(self.home), "CPUOS_TEMPLATES_DIR": str(TEMPLATES),
               "CPUOS_PORT": str(self.port), "CPUOS_BACKEND": "gvisor",
               **({"CPUOS_TEMPLATE_IMAGES_DIR": shared} if shared else {}),
               **self.net_env, **self.extra_env}
        env.pop("CPUOS_API_KEY", None)
        env.pop("CPUOS_API_URL", None)
        # (0600: $CPUOS_HOME holds nothing other users may read, cpuosd.homedir)
        with open(self.log, "ab", opener=lambda p, f: os.open(p, f, 0o600)) as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "cpuosd.main"], env=env,
                                         stdout=logf, stderr=logf, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cpuosd exited: {self.log.read_text()[-2000:]}")
            try:
                if http_get(self.url + "/health", timeout=1).status_code == 200:
                    if self._listening():
                        return True
                    # (ours cannot bind the port: it ends, or is ended)
                    try:
                        self.proc.wait(30)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
                    return False
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("cpuosd did not come up")

    @property
    def net_env(self) -> dict[str, str]:
        """Each test daemon owns its network names and addresses (daemons share the host),
        and its sandboxes have no way out unless a test gives them one (its own fake
        internet, CPUOS_UPLINK_NETNS): the network safety rule."""
        return net_env_of(self.net_slot)

    def network_leftovers(self) -> list[str]:
        """This daemon's namespaces, interfaces and nftables table still on the host."""
        tag = self.net_env["CPUOS_NET_ID"]
        out = [f"netns {n}" for n in os.listdir("/var/run/netns")
               if n.startswith(f"cpuos-{tag}-n")] if os.path.isdir("/var/run/netns") else []
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        out += [f"link {x}" for line in links.splitlines()
                if (x := line.split(":")[1].strip().split("@")[0]).startswith(f"cv{tag}n")]
        if subprocess.run(["nft", "list", "table", "inet", f"cpuos_{tag}"],
                          capture_output=True).returncode == 0:
            out.append(f"nft table cpuos_{tag}")
        return out

    def release_net_slot(self) -> None:
        if self._net_lock >= 0:
            os.close(self._net_lock)
            self._net_lock = -1

    def remove_network_leftovers(self) -> None:
        """What a daemon killed with SIGKILL (and not restarted) leaves of its network."""
        for item in self.network_leftovers():
            kind, name = item.split(" ", 1)
            argv = {"netns": ["ip", "netns", "del", name], "link": ["ip", "link", "del", name],
                    "nft": ["nft", "delete", "table", "inet", name.split()[-1]]}[kind]
            subprocess.run(argv, capture_output=True)

    @property
    def runsc(self) -> str:
        """The runsc binary this daemon runs (its CPUOS_RUNSC, else the daemon's choice)."""
        return self.extra_env.get("CPUOS_RUNSC") or find_runsc().path

    @property
    def runsc_root(self) -> Path:
        """The daemon's ``runsc --root``: its containers are named by sandbox id."""
        return Config(home=self.home).runsc_root

    @property
    def snapshots_dir(self) -> Path:
        """Where the daemon keeps snapshots (CPUOS_SNAPSHOTS_DIR, else $CPUOS_HOME/snapshots);
        a paused sandbox's image is ``<snapshots_dir>/<id>``."""
        return Path(self.extra_env.get("CPUOS_SNAPSHOTS_DIR")
                    or os.environ.get("CPUOS_SNAPSHOTS_DIR") or self.home / "snapshots")

    def agent_socket(self, sandbox_id: str) -> Path:
        """Where the daemon listens for the agent of sandbox_id (its SandboxSpec.sock_path)."""
        sdir = Config(home=self.home).sandboxes_dir / sandbox_id
        return SandboxSpec(id=sandbox_id, rootfs=Path("/"), dir=sdir, agent_dir=Path("/")).sock_path

    @property
    def template_images_dir(self) -> Path:
        """Where the daemon keeps template images (CPUOS_TEMPLATE_IMAGES_DIR: the session's
        shared one, else ``<snapshots_dir>/templates``)."""
        d = self.extra_env.get("CPUOS_TEMPLATE_IMAGES_DIR") or (
            os.environ.get(SHARED_IMAGES_ENV)
            if self.extra_env.get("CPUOS_BACKEND", "gvisor") == "gvisor" else None)
        return Path(d) if d else self.snapshots_dir / "templates"

    def template_image(self, template: str) -> tuple[Path, Path]:
        """(image dir, agent package dir) of the daemon's one snapshot of ``template`` (made on
        the first create from it): what restoring that image outside the daemon needs
        (bench/cases/snap_create.py). Images are ``<template>-<digest>-<agent copy>-<kind>...``
        in ``template_images_dir``, which other daemons may share: the daemon's is the one
        whose lock file (``<image>.lock``) it holds; the agent copies under
        ``$CPUOS_HOME/agent``."""
        assert self.proc is not None
        held = held_flocks(self.proc.pid)
        found = sorted(p for p in self.template_images_dir.glob(f"{template}-*")
                       if (p / "checkpoint.img").exists() and p.is_dir()
                       and _inode(p.with_name(p.name + ".lock")) in held)
        if len(found) != 1:
            raise RuntimeError(f"expected one {template} template snapshot, found {found}; "
                               f"see {self.log}")
        copies = [a for a in (self.home / "agent").iterdir() if f"-{a.name}-" in found[0].name]
        if len(copies) != 1:
            raise RuntimeError(f"no agent copy of {found[0].name} in {self.home / 'agent'}")
        return found[0], copies[0]

    @property
    def key(self) -> str:
        return (self.home / "admin.key").read_text().strip()

    def client(self, key: str | None = None) -> httpx.Client:
        # (verify=False: an http URL needs no TLS context, which costs ~18 ms of CPU to make)
        return httpx.Client(base_url=self.url, timeout=60, verify=False,
                            headers={"Authorization": f"Bearer {key or self.key}"})

    def sdk_kwargs(self, key: str | None = None) -> SdkKwargs:
        return {"api_url": self.url, "api_key": key or self.key}

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    STOP_GRACE = 60  # s: a clean stop on a loaded host (tests run on several workers)
    STOP_SLOW = 10  # s: a stop this slow has its stacks written to its log (dump_stacks)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                try:
                    self.proc.wait(self.STOP_SLOW)
                except subprocess.TimeoutExpired:
                    self.dump_stacks()  # (where a slow stop waits: its log, kept)
                    self.proc.wait(self.STOP_GRACE - self.STOP_SLOW)
            except subprocess.TimeoutExpired:
                # (said, so that what a SIGKILL leaves behind is not read as a leak)
                print(f"cpuosd {self.proc.pid} did not stop within {self.STOP_GRACE}s of "
                      "SIGTERM: SIGKILL (its threads' and tasks' stacks: its log)",
                      file=sys.stderr)
                self.dump_stacks()
                self.proc.kill()
                self.proc.wait()

    def dump_stacks(self, timeout: float = 5.0) -> bool:
        """The daemon's threads' and asyncio tasks' stacks into its log (cpuosd.diagnose:
        SIGUSR1, SIGUSR2); True once they are there (bounded)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        start = self.log.stat().st_size if self.log.exists() else 0
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

        def written() -> bool:
            with open(self.log, "rb") as f:
                f.seek(start)
                return b"--- end of tasks ---" in f.read()
        try:
            wait_until(written, "the daemon's stacks in its log", timeout)
        except TimeoutError:
            return False
        return True

    def _runsc_processes(self, commands: frozenset[bytes] | None = None) -> list[int]:
        """runsc processes of this daemon's root (its sandboxes' and gofers', the commands
        it ran), by pid; ``commands``: only runsc commands with one of these verbs."""
        flag = f"--root={self.runsc_root}".encode()
        return [pid for pid, argv in runsc_processes() if flag in argv
                and (commands is None or any(a in commands for a in argv[1:]))]

    def _until_gone(self, commands: frozenset[bytes] | None, timeout: float
                    ) -> list[tuple[int, str]]:
        """Wait (bounded) for the root's runsc processes (of ``commands``) to end; those
        still there are SIGKILLed: [(pid, name)] of them."""
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not self._runsc_processes(commands),
                       f"runsc processes of {self.runsc_root} to end", timeout)
        out = []
        for pid in self._runsc_processes(commands):
            argv = _cmdline(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            out.append((pid, b" ".join(argv[:1] + [a for a in argv if a in INFLIGHT]
                                       + [a for a in argv if a.startswith(b"sbx-")][-1:])
                        .decode(errors="replace")))
        return out

    def runsc_containers(self) -> list[str]:
        out = subprocess.run([self.runsc, "--root", str(self.runsc_root), "list",
                              "-format=json"], capture_output=True, check=True).stdout
        return [c["id"] for c in json.loads(out or b"null") or []]

    def describe(self, sid: str, lines: int = 12) -> str:
        """A sandbox left behind, as the daemon knew it: its row (state, reason, workspace,
        template) and the last lines of the daemon's log that name it (a leak shared by
        many tests says which one made it, and how it ended)."""
        what = [sid]
        try:
            db = sqlite3.connect(f"file:{self.home / 'cpuos.db'}?mode=ro", uri=True, timeout=5)
            try:
                r = db.execute("SELECT state, reason, workspace_id, template FROM sandboxes "
                               "WHERE id = ?", (sid,)).fetchone()
            finally:
                db.close()
            what.append("row: " + (f"state {r[0]}, reason {r[1]!r}, workspace {r[2]}, "
                                   f"template {r[3]}" if r else "none"))
        except sqlite3.Error as e:
            what.append(f"row: unreadable ({e})")
        try:
            named = [ln for ln in self.log.read_text(errors="replace").splitlines()
                     if sid in ln]
        except OSError:
            named = []
        what += [f"log: {ln[:300]}" for ln in named[-lines:]]
        return "\n  ".join(what)

    def _leftover_cgroups(self) -> list[str]:
        """The sandboxes of this daemon (its database's rows) whose gVisor cgroups
        (``cpuos/<id>`` under each controller) are still there once the daemon has stopped:
        removed (empty once their processes are gone), and named. Said, not failed on, as
        the runsc leftovers are."""
        try:
            db = sqlite3.connect(f"file:{self.home / 'cpuos.db'}?mode=ro", uri=True, timeout=5)
            try:
                ids = [r[0] for r in db.execute("SELECT id FROM sandboxes")]
            finally:
                db.close()
        except sqlite3.Error:
            return []
        left = []
        for sid in ids:
            dirs = glob.glob(f"/sys/fs/cgroup/*/cpuos/{sid}")
            if dirs:
                left.append(sid)
                for d in dirs:
                    with contextlib.suppress(OSError):
                        os.rmdir(d)
        return left

    def teardown(self, failed: bool) -> list[str]:
        """Kill all sandboxes, stop the daemon, remove leftovers; returns leftovers found.
        A slow one (SLOW_TEARDOWN s or more) says where its time went, as a warning: the
        test run's summary lists it (some took ~60 s in CI runs and never alone)."""
        phases: list[tuple[str, float]] = []
        t = time.monotonic()

        def phase(name: str) -> None:
            nonlocal t
            now = time.monotonic()
            phases.append((name, now - t))
            t = now

        if self.proc is not None and self.proc.poll() is None:
            try:
                with self.client() as c:
                    for s in c.get("/sandboxes").json()["sandboxes"]:
                        c.delete(f"/sandboxes/{s['id']}")
            except Exception:
                pass
        phase("deletes")
        self.stop()
        phase("stop")
        # a restore or run the daemon had under way when it stopped (its warm pool's) goes
        # on without it and makes its container after a look at runsc's root: wait for
        # those commands (bounded) before looking, or the sandbox outlives its home
        self._until_gone(INFLIGHT, 30)
        phase("runsc commands under way")
        left = self.runsc_containers() if self.runsc_root.exists() else []
        for cid in left:
            subprocess.run([self.runsc, "--root", str(self.runsc_root), "delete", "--force",
                            cid], capture_output=True)
        # what is left of the root's (not a container runsc listed, or not ending) is ended
        # and said on stderr, not failed on: seen once after test_concurrent_deletes_all_
        # return (a sandbox and its gofer still running 30 s after the deletes), a leak to
        # find (stop 35's note)
        for pid, name in self._until_gone(None, 10):
            sid = name.rpartition(" ")[2]
            print(f"teardown of {self.home}: runsc process {pid} ({name}) of its root was "
                  "still running: SIGKILLed" + (f"; {self.describe(sid)}"
                                               if sid.startswith("sbx-") else ""),
                  file=sys.stderr)
        phase("runsc leftovers")
        for sid in self._leftover_cgroups():
            print(f"teardown of {self.home}: the cgroups of {sid} were left (removed now); "
                  f"{self.describe(sid)}", file=sys.stderr)
        left = [self.describe(cid) for cid in left]  # (what the daemon knew of each)
        left += [f"mount {m}" for m in mounts_under(self.home)]
        for m in reversed(mounts_under(self.home)):
            subprocess.run(["umount", "--lazy", m], capture_output=True)
        self.remove_network_leftovers()
        self.release_net_slot()
        slow = sum(d for _, d in phases) >= SLOW_TEARDOWN
        kept = ARTIFACTS / f"cpuosd-{self.home.name}.log"
        if (failed or left or slow) and self.log.exists():
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log, kept)
        shutil.rmtree(self.home, ignore_errors=True)
        phase("the rest")
        if sum(d for _, d in phases) >= SLOW_TEARDOWN:
            warnings.warn("slow teardown of a test daemon: " + ", ".join(
                f"{name} {d:.1f} s" for name, d in phases)
                + (f"; its log: {kept}" if kept.exists() else ""), stacklevel=2)
        return left


# s: a daemon's teardown this long or longer says where its time went (a warning)
SLOW_TEARDOWN = 20.0

# runsc commands that make a container (what may outlive the daemon that ran them)
INFLIGHT = frozenset({b"restore", b"run", b"create", b"start"})


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def runsc_processes() -> list[tuple[int, list[bytes]]]:
    """(pid, argv) of every runsc process on the host (runsc, runsc-gofer, runsc-sandbox and
    its stubs: their comm is often just "exe", their argv[0] says what they are)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            argv = _cmdline(int(d))
            if argv and argv[0].split(b"/")[-1].startswith(b"runsc"):
                out.append((int(d), argv))
    return out


def wrapped_runsc_daemon(tmp_path: Path, script: str, **env: str) -> Daemon:
    """A daemon (pool off) whose runsc is ``script``, a shell script of the test's that
    stands in for the real runsc (``{real}`` in it is the real one's path): for injecting
    hangs and kills into runsc calls. Not started."""
    real = find_runsc()
    wrapper = tmp_path / "runsc"
    wrapper.write_text(script.replace("{real}", real.path))
    wrapper.chmod(0o755)
    return new_daemon(CPUOS_POOL_SIZE="0", CPUOS_RUNSC=str(wrapper),
                      CPUOS_RUNSC_PLATFORM=real.platform, **env)


# the microVM test daemons' default VM size (the template's, so what a clone gets): small,
# since under emulation touching guest memory is what costs (a clone writing 1.5 of 2 GiB
# took ~25 s of a core; a pause or fork moves the guest's whole RAM)
MICROVM_TEST_MIB = 896


def microvm_env(accel: str, artifacts: Path) -> dict[str, str]:
    """The environment of a test daemon on the microVM backend (no warm pool; an agent
    emulated by TCG may take minutes to say hello)."""
    return {"CPUOS_BACKEND": "microvm", "CPUOS_MICROVM_ACCEL": accel,
            "CPUOS_MICROVM_DIR": str(artifacts), "CPUOS_POOL_SIZE": "0",
            "CPUOS_AGENT_CONNECT_TIMEOUT": "240",
            "CPUOS_DEFAULT_MEMORY_MIB": str(MICROVM_TEST_MIB)}


def new_daemon(**env: str) -> Daemon:
    """A daemon with its own home; keyword arguments become its environment (CPUOS_*)."""
    home = Path(tempfile.mkdtemp(prefix="cpuos-t-", dir="/tmp"))
    return Daemon(home, env)


def png_size_and_colours(data: bytes) -> tuple[int, int, set[tuple[int, ...]]]:
    """A PNG's width, height and the set of its pixels' colours (8-bit RGB/RGBA, no
    interlace: what matplotlib's Agg writes), decoded with zlib alone."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, b"", b""
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            hdr = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = int.from_bytes(hdr[0:4], "big"), int.from_bytes(hdr[4:8], "big")
    depth, ctype, interlace = hdr[8], hdr[9], hdr[12]
    assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    prev = bytearray(stride)
    colours: set[tuple[int, ...]] = set()
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pr = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pr) & 255
        colours.update(tuple(line[i:i + 3]) for i in range(0, stride, bpp))
        prev = line
    return w, h, colours


BUSYBOX = Path("/usr/bin/busybox")
BUSYBOX_APPLETS = ("true", "false", "echo", "cat", "ls", "mkdir", "test", "pwd", "id", "ln",
                   "rm", "mknod", "mount", "nc", "kill", "sleep", "touch", "chown", "stat",
                   "grep", "wc", "chmod", "ps", "cp")


def busybox_unavailable() -> str | None:
    """Why a tiny busybox root cannot be made here (template step tests), or None."""
    if os.geteuid() != 0:
        return "needs root (runsc)"
    try:
        find_runsc()
    except RunscUnavailable as e:
        return f"no runsc: {e}"
    if not BUSYBOX.exists():
        return "needs busybox-static (apt-get install busybox-static)"
    r = subprocess.run(["ldd", str(BUSYBOX)], capture_output=True, text=True)
    if "not a dynamic executable" not in r.stdout + r.stderr:
        return f"{BUSYBOX} is not static (apt-get install busybox-static)"
    return None


def busybox_root(parent: Path) -> Path:
    """``parent/root``: busybox-static as /bin/sh with its applets, /tmp and /work."""
    r = parent / "root"
    (r / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, r / "bin" / "sh")
    for name in BUSYBOX_APPLETS:
        (r / "bin" / name).symlink_to("sh")
    (r / "tmp").mkdir()
    os.chmod(r / "tmp", 0o1777)
    (r / "work").mkdir()  # the base steps make it in a real build
    return r


def build_steps_left(root: Path) -> list[str]:
    """What template build steps over ``root`` left: mounts, runsc state directories next to
    it, processes naming its directory."""
    left = [f"mount {m}" for m in mounts_under(root)]
    left += [f"state {p.name}" for p in root.parent.iterdir() if p.name.startswith(".steps-")]
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left += [f"process {line.strip()}" for line in ps.splitlines()
             if str(root.parent) in line and "ps -ww" not in line]
    return left
