"""The jailer's posture, Firecracker test_jail.py style: jail a probe (static busybox ``sh``)
instead of QEMU, have it report what it sees from inside, and diff that against the
expected posture. Plus the refusals: bad ids, symlinked or hard-linked destinations, bad
paths. Every test removes the jail, its cgroup and its processes.

Needs root (namespaces, cgroups, mknod) and busybox-static (a static binary needs nothing
else in the chroot).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuosd.backends.microvm import jailer

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
UID = 300_901
GID = 300_902



def _static_busybox() -> bool:
    try:
        return os.path.exists(BUSYBOX) and jailer.ldd_deps(BUSYBOX) == []
    except jailer.JailError:
        return False


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the jailer needs root"),
    pytest.mark.skipif(not _static_busybox(),
                       reason="needs a static busybox (apt-get install busybox-static)"),
]

_ids = itertools.count()

PROBE = r"""
B=/busybox
echo "pid=$$"
echo "ppid=$PPID"
echo "uid=$($B id -u)"
echo "gid=$($B id -g)"
echo "groups=$($B id -G)"
$B cat /proc/$$/status | while IFS=: read -r k v; do
  echo "status.$k=$(echo $v)"
done
for ns in mnt pid net ipc uts user cgroup; do echo "ns.$ns=$($B readlink /proc/$$/ns/$ns)"; done
echo "cwd=$($B pwd)"
echo "root=$($B ls -a / | $B tr '\n' ' ')"
echo "nofile=$(ulimit -n)"
echo "fsize=$(ulimit -f)"
echo "core=$(ulimit -c)"
[ -e /etc/hostname ] && echo "host_hostname=present" || echo "host_hostname=absent"
[ -e /usr ] && echo "host_usr=present" || echo "host_usr=absent"
echo "env=$($B env | $B grep -v -E '^(PWD|SHLVL|PATH)=' | $B tr '\n' ' ')"
echo "dev=$($B ls -ln /dev/kvm /dev/net/tun | $B awk '{print $1 $3 ":" $4}' | $B tr '\n' ' ')"
$B touch /rootfile 2>/dev/null && echo "root_writable=yes" || echo "root_writable=no"
$B touch /run/x 2>/dev/null && echo "run_writable=yes" || echo "run_writable=no"
$B sed 's/^/cgroup=/' /proc/$$/cgroup
echo "end=1"
exec $B sleep 60  # the test then looks at the open fds from the host
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    b = tmp_path / "jails"
    b.mkdir()
    return b.resolve()


@pytest.fixture
def jail_id(base: Path) -> Iterator[str]:
    sid = f"jt-{os.getpid()}-{next(_ids)}"
    yield sid
    jailer.cleanup(sid, base)
    assert not (base / "busybox" / sid).exists()
    assert not [d for d in jailer.cgroup_dirs(sid) if d.exists()], "cgroup left behind"


def argv(sid: str, base: Path, *args: str, **kw: object) -> list[str]:
    return jailer.jailer_argv(sandbox_id=sid, exec_file=BUSYBOX, uid=UID, gid=GID,
                              chroot_base=base, args=list(args), **kw)  # type: ignore[arg-type]


def run_jailed(sid: str, base: Path, *args: str, timeout: float = 20, **kw: object
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv(sid, base, *args, **kw), capture_output=True, text=True,
                          timeout=timeout, pass_fds=(), stdin=subprocess.DEVNULL)


def parse(out: str) -> dict[str, str]:
    d: dict[str, str] = {}
    for line in out.splitlines():
        k, sep, v = line.partition("=")
        if not sep:
            continue
        if k == "cgroup":
            d.setdefault("cgroups", "")
            d["cgroups"] += v + "\n"
        else:
            d[k] = v.strip()
    return d


def host_ns(name: str) -> str:
    return os.readlink(f"/proc/self/ns/{name}")


def test_posture(base: Path, jail_id: str) -> None:
    version = jailer.cgroup_version()
    limits = jailer.cgroup_limits(version, cpus=0.5, memory_bytes=256 << 20, pids=64)
    p = subprocess.Popen(argv(jail_id, base, "sh", "-c", PROBE, mount_proc=True,
                              cgroups=limits, cgroup_version=version,
                              rlimits={"nofile": 100, "fsize": 1 << 20}),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("end="):
            break
    else:
        pytest.fail(f"probe ended early: {p.wait()} {p.stderr.read()}")
    got = parse("".join(lines))
    vmm = int(jailer.jail_paths(jail_id, BUSYBOX, base).pid_file.read_text())
    got["fds"] = " ".join(sorted(os.listdir(f"/proc/{vmm}/fd"), key=int))
    expected = {
        "pid": "1",  # PID 1 of its own pid namespace
        "ppid": "0",  # its parent (the jailer) is outside that namespace
        "uid": str(UID),
        "gid": str(GID),
        "groups": str(GID),  # `id -G` prints the primary gid; the supplementary list is empty
        "status.Uid": f"{UID} {UID} {UID} {UID}",
        "status.Gid": f"{GID} {GID} {GID} {GID}",
        "status.Groups": "",
        "status.CapInh": "0000000000000000",
        "status.CapPrm": "0000000000000000",
        "status.CapEff": "0000000000000000",
        "status.CapBnd": "0000000000000000",
        "status.CapAmb": "0000000000000000",
        "status.NoNewPrivs": "1",
        "status.Seccomp": "0",  # QEMU installs its own (-sandbox on); the jailer adds none
        "cwd": "/",
        "root": ". .. busybox dev proc run",
        "fds": "0 1 2",
        "nofile": "100",
        "fsize": str((1 << 20) // 512),
        "core": "0",
        "host_hostname": "absent",
        "host_usr": "absent",
        "env": "",
        "dev": f"crw-------{UID}:{GID} crw-------{UID}:{GID}",
        "root_writable": "no",
        "run_writable": "yes",
        "ns.net": host_ns("net"),  # no --netns: the host's
        "ns.user": host_ns("user"),
    }
    diff = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    assert not diff, f"posture differs (got, expected): {diff}\nfull: {got}"
    for ns in ("mnt", "pid", "ipc", "uts"):
        assert got[f"ns.{ns}"] != host_ns(ns), f"{ns} namespace is the host's"
    cg = got["cgroups"]
    leaf = f"/{jailer.DEFAULT_PARENT_CGROUP}/{jail_id}"
    if version == 1:
        for ctrl in ("memory", "pids", "cpu"):
            assert any(line.split(":")[1].split(",").count(ctrl) and line.endswith(leaf)
                       for line in cg.splitlines()), f"not in {ctrl} cgroup {leaf}: {cg}"
        mem = Path("/sys/fs/cgroup/memory") / jailer.DEFAULT_PARENT_CGROUP / jail_id
        assert vmm in {int(x) for x in (mem / "cgroup.procs").read_text().split()}
        assert (mem / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
        pids = Path("/sys/fs/cgroup/pids") / jailer.DEFAULT_PARENT_CGROUP / jail_id
        assert (pids / "pids.max").read_text().strip() == "64"
    else:
        assert f"0::{leaf}" in cg
    jailer.cleanup(jail_id, base)
    p.wait(10)
    p.stdout.close()
    p.stderr.close()


def test_exit_status_is_the_vmms(base: Path, jail_id: str) -> None:
    r = run_jailed(jail_id, base, "sh", "-c", "exit 7")
    assert r.returncode == 7, r.stderr


def test_environment_is_cleared(base: Path, jail_id: str) -> None:
    env = {**os.environ, "SECRET_TOKEN": "x", "LD_PRELOAD": "/nonexistent.so"}
    r = subprocess.run(argv(jail_id, base, "env"), capture_output=True, text=True, env=env,
                       timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""


def test_inherited_fds_are_closed(base: Path, jail_id: str) -> None:
    rfd, wfd = os.pipe()
    try:
        p = subprocess.Popen(argv(jail_id, base, "sleep", "60"), pass_fds=(rfd, wfd),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    finally:
        os.close(rfd)
        os.close(wfd)
    vmm = _wait_vmm(jail_id, base)
    assert sorted(os.listdir(f"/proc/{vmm}/fd"), key=int) == ["0", "1", "2"]
    jailer.cleanup(jail_id, base)
    p.wait(10)


def test_kept_fd_is_the_only_one_inherited(base: Path, jail_id: str) -> None:
    """--keep-fd (a template's RAM memfd): that fd reaches the VMM, at the same number;
    every other inherited fd is still closed."""
    rfd, wfd = os.pipe()
    keep = os.memfd_create("cpuos-keep-test", 0)
    try:
        p = subprocess.Popen(argv(jail_id, base, "sleep", "60", keep_fds=(keep,)),
                             pass_fds=(rfd, wfd, keep), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        os.close(rfd)
        os.close(wfd)
    try:
        vmm = _wait_vmm(jail_id, base)
        assert sorted(os.listdir(f"/proc/{vmm}/fd"), key=int) == ["0", "1", "2", str(keep)]
        assert os.readlink(f"/proc/{vmm}/fd/{keep}") == "/memfd:cpuos-keep-test (deleted)"
    finally:
        os.close(keep)
        jailer.cleanup(jail_id, base)
        p.wait(10)


def test_detach_leaves_no_supervisor(base: Path, jail_id: str) -> None:
    """--detach (what the backend runs): the jailer exits 0 once the VMM has been exec'd;
    the VMM keeps running, jailed, with no jailer process beside it."""
    t0 = time.monotonic()
    with open(base.parent / "jailer.log", "w+b") as log:  # (the VMM keeps its stdio)
        rc = subprocess.run(argv(jail_id, base, "sleep", "60", detach=True),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            timeout=20).returncode
        assert rc == 0, log.read()
    assert time.monotonic() - t0 < 10
    vmm = _wait_vmm(jail_id, base)
    st = {k: v.strip() for k, _, v in (ln.partition(":") for ln in
                                        open(f"/proc/{vmm}/status").read().splitlines())}
    assert st["Uid"].split()[0] == str(UID) and st["CapEff"] == "0000000000000000"
    assert st["NSpid"].split()[-1] == "1"  # PID 1 of its own pid namespace
    ppid = int(st["PPid"])
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        assert b"jailer" not in f.read()
    jailer.cleanup(jail_id, base)
    for _ in range(100):
        if not os.path.exists(f"/proc/{vmm}/cmdline") or open(f"/proc/{vmm}/stat").read(
                ).rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the detached VMM did not die with its jail")


def test_detach_reports_a_failed_exec(base: Path, jail_id: str, tmp_path: Path) -> None:
    """The child's failure after the fork (here: an exec file that cannot be exec'd)
    reaches the detached jailer's status and stderr."""
    noexec = tmp_path / "not-executable"
    noexec.write_bytes(b"#!/bin/sh\n")
    noexec.chmod(0o644)
    r = subprocess.run(jailer.jailer_argv(sandbox_id=jail_id, exec_file=noexec, uid=UID,
                                          gid=GID, chroot_base=base, args=[], detach=True),
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 127
    assert "Permission denied" in r.stderr


def test_netns_is_joined(base: Path, jail_id: str, tmp_path: Path) -> None:
    # a netns held by a sleeping process of ours (no `ip netns`, no /run/netns entry)
    holder = subprocess.Popen(["unshare", "--net", "sleep", "30"])
    try:
        path = f"/proc/{holder.pid}/ns/net"
        for _ in range(100):
            if os.readlink(path) != host_ns("net"):
                break
            time.sleep(0.02)
        want = os.readlink(path)
        r = run_jailed(jail_id, base, "sh", "-c", "/busybox readlink /proc/$$/ns/net",
                       mount_proc=True, netns=path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want != host_ns("net")
    finally:
        holder.kill()
        holder.wait()


def test_new_netns_holds_only_its_tap(base: Path, jail_id: str) -> None:
    """--new-netns: an empty namespace of the VMM's own (not the host's), where --tap made
    one persistent tap; the tap goes with the namespace when the VMM ends."""
    r = run_jailed(jail_id, base, "sh", "-c",
                   "/busybox readlink /proc/$$/ns/net; /busybox cat /proc/net/dev",
                   mount_proc=True, new_netns=True, tap="tap0")
    assert r.returncode == 0, r.stderr
    ns, *dev = r.stdout.splitlines()
    assert ns.startswith("net:") and ns != host_ns("net")
    assert sorted(line.split(":")[0].strip() for line in dev[2:]) == ["lo", "tap0"]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert " tap0:" not in links  # not in the host's namespace, before or after


def test_netns_and_new_netns_are_refused_together(base: Path) -> None:
    sid = f"jt-bad-{os.getpid()}-{next(_ids)}"
    r = cli(*common(base, sid), "--netns=/proc/self/ns/net", "--new-netns", "--", "true")
    assert r.returncode == 2 and "exclude each other" in r.stderr, r.stderr
    assert not (base / "busybox" / sid).exists()


def test_cleanup_kills_and_removes_everything(base: Path, jail_id: str) -> None:
    p = subprocess.Popen(argv(jail_id, base, "sleep", "60"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    paths = jailer.jail_paths(jail_id, BUSYBOX, base)
    vmm = _wait_vmm(jail_id, base)
    assert os.path.exists(f"/proc/{vmm}")
    jailer.cleanup(jail_id, base)
    # the jailer (in the cgroup too) is killed, or reports its VMM's SIGKILL
    assert p.wait(10) in (-signal.SIGKILL, 128 + signal.SIGKILL)
    assert not os.path.exists(f"/proc/{vmm}") or _zombie(vmm)
    assert not paths.jail_dir.exists()
    assert not [d for d in jailer.cgroup_dirs(jail_id) if d.exists()]
    jailer.cleanup(jail_id, base)  # idempotent


def test_vmm_dies_with_its_jailer(base: Path, jail_id: str) -> None:
    p = subprocess.Popen(argv(jail_id, base, "sleep", "60"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    vmm = _wait_vmm(jail_id, base)
    p.kill()
    p.wait()
    for _ in range(200):
        if not os.path.exists(f"/proc/{vmm}") or _zombie(vmm):
            break
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{vmm}") or _zombie(vmm), "VMM outlived its jailer"


def _wait_vmm(sid: str, base: Path) -> int:
    """The jailed process's host pid, once it runs as the sandbox uid and has exec'd."""
    pid_file = jailer.jail_paths(sid, BUSYBOX, base).pid_file
    for _ in range(500):
        with contextlib.suppress(OSError, ValueError):
            vmm = int(pid_file.read_text())
            with open(f"/proc/{vmm}/status") as f:
                uid_ok = f"Uid:\t{UID}\t" in f.read()
            with open(f"/proc/{vmm}/cmdline", "rb") as f:
                cmdline = f.read()  # empty while the process is inside execve
                execed = bool(cmdline) and b"jailer" not in cmdline  # past the jailer's exec
            if uid_ok and execed:
                return vmm
        time.sleep(0.01)
    raise AssertionError("the jailed process did not start")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ---- refusals ---------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", "-m", "cpuosd.backends.microvm.jailer", *args],
                          capture_output=True, text=True, timeout=20)


def common(base: Path, sid: str) -> list[str]:
    return [f"--id={sid}", "--exec-file", BUSYBOX, "--uid", str(UID), "--gid", str(GID),
            "--chroot-base", str(base)]


@pytest.mark.parametrize("bad_id", ["../x", "A", "a/b", "x" * 65, "x\n", "", "a b", "a_b",
                                    "ä", "-" * 65])
def test_invalid_ids_are_refused(base: Path, bad_id: str) -> None:
    r = cli(*common(base, bad_id), "--", "true")
    assert r.returncode == 2
    assert "invalid jail id" in r.stderr
    assert list(base.iterdir()) == []
    with pytest.raises(jailer.JailError, match="invalid jail id"):
        jailer.jailer_argv(sandbox_id=bad_id, exec_file=BUSYBOX, uid=UID, gid=GID,
                           chroot_base=base, args=[])


def test_longest_valid_id_is_accepted(base: Path) -> None:
    sid = "a" * 64
    try:
        r = cli(*common(base, sid), "--", "true")
        assert r.returncode == 0, r.stderr
    finally:
        jailer.cleanup(sid, base)


def test_symlinked_exec_directory_is_refused(base: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "busybox").symlink_to(elsewhere)
    r = cli(*common(base, "jt-symlink"), "--", "true")
    assert r.returncode == 2
    assert "symlink" in r.stderr
    assert list(elsewhere.iterdir()) == []


def test_symlinked_and_hardlinked_destinations_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "busybox").symlink_to("/etc/passwd")
    with pytest.raises(jailer.JailError, match="refusing symlink destination"):
        jailer.place_file(root, BUSYBOX, "/busybox")
    other = tmp_path / "other"
    other.write_text("x")
    os.link(other, root / "hard")
    with pytest.raises(jailer.JailError, match="refusing hard-linked destination"):
        jailer.place_file(root, BUSYBOX, "/hard")
    (root / "lib").symlink_to("/usr/lib")
    with pytest.raises(jailer.JailError, match="symlink"):
        jailer.place_file(root, BUSYBOX, "/lib/x/busybox")
    assert (tmp_path / "other").read_text() == "x"
    with pytest.raises(jailer.JailError, match=re.escape("'..'")):
        jailer.place_file(root, BUSYBOX, "/a/../../busybox")


def test_existing_jail_is_refused(base: Path) -> None:
    (base / "busybox" / "jt-exists").mkdir(parents=True)
    r = cli(*common(base, "jt-exists"), "--", "true")
    assert r.returncode == 2
    assert "already exists" in r.stderr


@pytest.mark.parametrize("kind", ["relative", "missing", "file", "symlink"])
def test_bad_chroot_base_is_refused(tmp_path: Path, kind: str) -> None:
    real = tmp_path / "real"
    real.mkdir()
    if kind == "relative":
        b = "jails"
    elif kind == "missing":
        b = str(tmp_path / "missing")
    elif kind == "file":
        (tmp_path / "f").write_text("")
        b = str(tmp_path / "f")
    else:
        (tmp_path / "link").symlink_to(real)
        b = str(tmp_path / "link")
    r = cli("--id", "jt-base", "--exec-file", BUSYBOX, "--uid", str(UID), "--gid", str(GID),
            "--chroot-base", b, "--", "true")
    assert r.returncode == 2
    assert "chroot base" in r.stderr
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("args,msg", [
    (["--uid", "0"], "never root"),
    (["--exec-file", "relative/busybox"], "exec file"),
    (["--exec-file", "/nonexistent/busybox"], "exec file"),
    (["--file", "/etc/passwd:../../escape"], "absolute path inside the jail"),
    (["--file", "/nonexistent:/x"], "cannot be read"),
    (["--bind", "/etc:/x/../../y:ro"], "'..'"),
    (["--bind", "/nonexistent:/x:ro"], "bind source"),
    (["--netns", "/nonexistent/netns"], "network namespace"),
    (["--tap", "../tap"], "bad tap name"),
    (["--tap", "t" * 16], "bad tap name"),
    (["--cgroup", "../../x=1"], "bad cgroup file"),
    (["--rlimit", "bogus=1"], "unknown rlimit"),
    (["--devices", "kvm,sda"], "unknown device"),
    (["--keep-fd", "2"], "only fds above 2"),
    (["--keep-fd", "977"], "not an open file descriptor"),
])
def test_bad_arguments_are_refused(base: Path, args: list[str], msg: str) -> None:
    sid = f"jt-bad-{os.getpid()}-{next(_ids)}"
    opts = common(base, sid)
    for i in range(0, len(args), 2):  # override or add
        if args[i] in opts:
            opts[opts.index(args[i]) + 1] = args[i + 1]
        else:
            opts += args[i:i + 2]
    try:
        r = cli(*opts, "--", "true")
        assert r.returncode == 2, r.stderr
        assert msg in r.stderr
        assert not (base / "busybox" / sid).exists()
    finally:
        jailer.cleanup(sid, base)
