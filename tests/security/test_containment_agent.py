"""Code inside a sandbox attacking the agent (issue 11, findings 5-8), each run as the
attack itself from inside a real sandbox through the real daemon:

5. FIFOs (and devices) where the agent reads, writes or walks do not wedge it;
6. signals from commands neither kill nor stop the agent (gVisor, unlike Linux, lets a
   process signal its pid namespace's init); its spawner, which they can signal, is
   replaced;
7. a timeout kills what a command started even when it double-forked, called setsid and
   cleared its environment (a cgroup per exec);
8. a file read that fails after its response began raises in the SDK, and a plain HTTP
   client sees an incomplete body, never a short one that looks whole.
"""

from __future__ import annotations

import contextlib
import secrets

import httpx
import pytest

from cpuos import CpuosError, InvalidArgument, Sandbox, ServerError
from cpuosd.testing import Daemon, wait_until

pytestmark = pytest.mark.e2e


def _ps(sbx: Sandbox) -> str:
    return sbx.exec(["ps", "-eo", "pid,ppid,ruid,stat,args"]).stdout


# ---- 5: FIFOs ------------------------------------------------------------------------------
# FIFOs at every name the agent used to pick for uploads (".<name>.cpuos-<stream id>.tmp",
# stream ids counted from 1), at the upload's own path, in a tree to be removed, behind a
# symlink, and where the agent keeps its machine-id (if the user may write there)
PLANT = r"""
set +e
cd /work
for i in $(seq 1 400); do mkfifo ".up.bin.cpuos-$i.tmp" ".target.bin.cpuos-$i.tmp"; done
mkfifo target.bin /tmp/fifo
ln -s /tmp/fifo /work/link-to-fifo
mkdir -p /tmp/tree/a/b && mkfifo /tmp/tree/f /tmp/tree/a/g /tmp/tree/a/b/h
for i in $(seq 1 64); do mkfifo "/run/cpuos/machine-id.$i" 2>/dev/null; done
echo planted
"""


def test_fifos_never_wedge_the_agent(sbx: Sandbox, tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = sbx.exec(PLANT)
    assert r.stdout.strip() == "planted", r.stderr
    # uploads: next to 800 FIFOs, and over a FIFO at the path itself
    sbx.files.write("/work/up.bin", b"a" * 1000)
    local = tmp_path / "target.bin"
    local.write_bytes(b"b" * (1 << 20))
    assert sbx.files.upload(local, "/work/target.bin").type == "file"
    assert sbx.files.read("/work/up.bin") == b"a" * 1000
    assert sbx.files.read("/work/target.bin") == b"b" * (1 << 20)
    # reading a FIFO, a symlink to one, or a device is refused at once, never waited on
    for path in ("/tmp/fifo", "/work/link-to-fifo", "/dev/zero", "/dev/tty"):
        with pytest.raises(CpuosError) as e:
            sbx.files.read(path)
        assert isinstance(e.value, InvalidArgument) or e.value.code == "not_found", (path, e)
    names = {e.name for e in sbx.files.list("/work")}
    assert {"up.bin", "target.bin", "link-to-fifo"} <= names
    sbx.files.remove("/tmp/tree")
    assert not sbx.files.exists("/tmp/tree")
    # a restore brings the identity (machine-id) back in: still answered
    nonce = secrets.token_hex(4)
    assert sbx.exec(f"echo {nonce}").stdout == nonce + "\n"
    assert sbx.info().state == "running"


# ---- 6: signals ----------------------------------------------------------------------------
SIGNALS = ["INT", "TERM", "HUP", "QUIT", "USR1", "USR2", "PIPE", "ALRM", "TSTP", "TTIN",
           "XCPU", "SEGV", "ABRT", "RTMIN", "KILL", "STOP"]


def test_signals_from_inside_do_not_reach_the_agent(sbx: Sandbox) -> None:
    # at PID 1, one by one, and at every process the user may signal
    script = "; ".join(f"kill -{s} 1 2>/dev/null; echo {s}=$?" for s in SIGNALS)
    r = sbx.exec(script)
    results = dict(line.split("=") for line in r.stdout.split())
    assert set(results) == set(SIGNALS), r.stdout
    assert all(v != "0" for v in results.values()), results  # every one refused
    for s in ("INT", "TERM", "STOP", "KILL"):
        with contextlib.suppress(CpuosError):  # it may take its own exec down
            sbx.exec(f"kill -{s} -1")
        assert sbx.exec("echo alive").stdout == "alive\n"
    assert sbx.info().state == "running"
    agent = sbx.exec(["ps", "-o", "stat=", "-p", "1"]).stdout.strip()
    assert agent and "T" not in agent, agent


def test_spawner_stopped_or_killed_from_inside_is_replaced(sbx: Sandbox) -> None:
    """The spawner (commands' uid, so they can signal it) stopped by a background process:
    the agent, its parent, hears of the stop and ends it, and the next exec gets a new
    one; killed under a running command: that command's exit still comes back (the agent
    reaps it) and the next exec gets a new spawner."""
    spawner = sbx.exec("echo $PPID").stdout.strip()
    sbx.exec(f"nohup sh -c 'sleep 0.2; kill -STOP {spawner}' >/dev/null 2>&1 &")

    def stopped_or_gone() -> bool:  # (the files API: no exec, which would start a new one)
        try:
            stat = sbx.files.read(f"/proc/{spawner}/stat").decode()
        except CpuosError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "Z")

    wait_until(stopped_or_gone, "the spawner to be stopped", timeout=30)
    assert sbx.exec("echo after-stop").stdout == "after-stop\n"
    r = sbx.exec("kill -KILL $PPID; echo survived; exit 3")
    assert (r.stdout, r.exit_code) == ("survived\n", 3)
    new = sbx.exec("echo $PPID").stdout.strip()
    assert new not in ("", spawner, "1")
    assert sbx.info().state == "running"


# ---- 7: the timeout ------------------------------------------------------------------------
ESCAPE = r"""
import os, sys, time
tag = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        # try to leave the exec's cgroup too, then loop forever with an empty environment
        os.execve("/bin/sh", ["sh", "-c",
                  "for f in /run/cpuos-exec/cgroup.procs /run/cpuos-exec/*/cgroup.procs; do "
                  "echo $$ > $f; done 2>/dev/null; while :; do : " + tag + "; sleep 0.1; done"],
                  {})
    os._exit(0)
time.sleep(600)
"""


def test_timeout_kills_double_forked_setsid_env_cleared_loop(sbx: Sandbox) -> None:
    tag = "escapee-" + secrets.token_hex(4)
    sbx.files.write("/tmp/escape.py", ESCAPE)
    r = sbx.exec(["python3", "/tmp/escape.py", tag], timeout="2s")
    assert r.timed_out and r.exit_code == 137
    wait_until(lambda: tag not in _ps(sbx), "the escaped loop to be gone", timeout=30)
    assert tag not in _ps(sbx)
    assert sbx.exec("echo usable").stdout == "usable\n"


# ---- 8: a read failing part-way ------------------------------------------------------------
# A 1 GiB file (a real first block, the rest a hole: it costs no memory) that is cut to
# nothing as soon as anyone reads from it (inotify IN_ACCESS): the agent has declared its
# size and sent its first chunks when the rest disappears.
SIZE = 1 << 30
SHRINK = r"""
import ctypes, os, sys
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(b"x" * 4096)
    f.truncate(1 << 30)
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
assert libc.inotify_add_watch(fd, path.encode(), 0x1) >= 0   # IN_ACCESS
open(path + ".ready", "w").close()
os.read(fd, 4096)
os.truncate(path, 0)
"""


def _arm(sbx: Sandbox, path: str) -> None:
    sbx.exec(f"rm -f {path} {path}.ready; nohup python3 /tmp/shrink.py {path} "
             ">/tmp/shrink.log 2>&1 &")
    wait_until(lambda: sbx.files.exists(path + ".ready"), f"{path} to be armed", timeout=60)


def test_read_failing_midstream_raises(daemon: Daemon, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/shrink.py", SHRINK)
    _arm(sbx, "/tmp/big")
    with pytest.raises(ServerError) as e:
        sbx.files.read("/tmp/big")
    assert "shrank" in e.value.message
    assert 0 < e.value.details["received"] < SIZE

    # a client that asks for plain bytes: a declared length never reached
    _arm(sbx, "/tmp/big2")
    with daemon.client() as c:
        with pytest.raises(httpx.RemoteProtocolError):
            c.get(f"/sandboxes/{sbx.id}/files", params={"path": "/tmp/big2"})
    # the sandbox is unharmed
    assert sbx.files.read("/etc/hostname").strip()
