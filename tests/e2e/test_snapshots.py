"""Snapshots on real runsc: pause/resume, template snapshots, warm pool, fork."""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cpuos import Conflict, NoSpace, Sandbox
from cpuosd.testing import Daemon, new_daemon, wait_until

pytestmark = pytest.mark.e2e

# Holds 100 MiB and a counter; on SIGUSR1 bumps the counter and writes both to /work/status.
HOLDER = r"""
import hashlib, os, signal, time
data = bytearray(os.urandom(1 << 20) * 100)
digest = hashlib.sha256(data).hexdigest()
n = 0
def poke(*_):
    global n
    n += 1
    with open("/work/status.tmp", "w") as f:
        f.write(f"{n} {len(data)} {hashlib.sha256(data).hexdigest() == digest}")
    os.replace("/work/status.tmp", "/work/status")
signal.signal(signal.SIGUSR1, poke)
open("/work/holder.ready", "w").close()
while True:
    time.sleep(3600)
"""


def start_holder(sbx: Sandbox) -> None:
    sbx.files.write("/work/holder.py", HOLDER)
    sbx.exec("nohup python3 /work/holder.py >/work/holder.log 2>&1 &")
    for _ in range(200):
        if sbx.files.exists("/work/holder.ready"):
            return
        time.sleep(0.05)
    raise AssertionError("holder did not start: " + sbx.files.read_text("/work/holder.log"))


def poke(sbx: Sandbox) -> str:
    before = sbx.exec("cat /work/status 2>/dev/null").stdout
    assert sbx.exec("pkill -USR1 -f holder.py").exit_code == 0
    for _ in range(200):
        now = sbx.exec("cat /work/status 2>/dev/null").stdout
        if now and now != before:
            return now
        time.sleep(0.05)
    raise AssertionError("holder did not answer")


def test_pause_resume_three_times_keeps_memory_processes_files(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    sbx = Sandbox.create(template="python", timeout="10m", **kw)
    try:
        start_holder(sbx)
        assert poke(sbx) == f"1 {100 << 20} True"
        identity = sbx.exec("hostname; cat /etc/machine-id").stdout
        for i in range(1, 4):
            sbx.files.write(f"/work/before-pause-{i}.txt", f"round {i}")
            sid = sbx.pause()
            info = sbx.info()
            assert info.state == "paused" and info.snapshot_bytes and info.snapshot_bytes > 0
            # no process left while paused (the stopped container is deleted once the
            # pause has answered)
            wait_until(lambda sid=sid: sid not in daemon.runsc_containers(),  # type: ignore[misc]
                       "the container's removal", 30)
            with pytest.raises(Conflict):
                sbx.exec("true")
            sbx.close()
            sbx = Sandbox.resume(sid, **kw)
            assert sbx.info().state == "running"
            assert poke(sbx) == f"{i + 1} {100 << 20} True"
            assert sbx.exec("hostname; cat /etc/machine-id").stdout == identity
            for j in range(1, i + 1):
                assert sbx.files.read_text(f"/work/before-pause-{j}.txt") == f"round {j}"
    finally:
        sbx.kill()
        sbx.close()


def test_connect_auto_resumes_and_kill_removes_snapshot(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    sbx = Sandbox.create(template="python", timeout="5m", **kw)
    sbx.files.write("note.txt", "kept")
    sid = sbx.pause()
    sbx.close()
    snap = daemon.home / "snapshots" / sid
    assert (snap / "checkpoint.img").exists()
    again = Sandbox.connect(sid, **kw)
    assert again.files.read_text("note.txt") == "kept"
    again.pause()
    again.close()
    still = Sandbox.connect(sid, auto_resume=False, **kw)
    assert still.info().state == "paused"
    still.kill()
    still.close()
    assert not snap.exists()
    assert Sandbox.connect(sid, auto_resume=False, **kw).info().state == "killed"


def test_auto_pause_at_deadline(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    sbx = Sandbox.create(template="python", timeout=2, on_timeout="pause", **kw)
    try:
        sbx.files.write("x.txt", "survives the deadline")
        for _ in range(100):
            if sbx.info().state == "paused":
                break
            time.sleep(0.1)
        assert sbx.info().state == "paused"
        back = Sandbox.resume(sbx.id, **kw)
        assert back.files.read_text("x.txt") == "survives the deadline"
        back.close()
    finally:
        sbx.kill()
        sbx.close()


def test_clones_share_no_writable_state_or_randomness(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    a = Sandbox.create(template="python", timeout="5m", **kw)
    b = Sandbox.create(template="python", timeout="5m", **kw)
    try:
        a.files.write("/work/only-a.txt", "a")
        a.exec("echo a > /tmp/t; echo a >> /home/user/.bashrc")
        assert not b.files.exists("/work/only-a.txt")
        assert b.exec("cat /tmp/t").exit_code != 0
        assert "echo a" not in b.exec("cat /home/user/.bashrc").stdout
        cmd = ("head -c 16 /dev/urandom | od -An -tx1; "
               "python3 -c 'import random; print(random.random())'")
        ra, rb = a.exec(cmd).stdout, b.exec(cmd).stdout
        assert ra and rb and ra != rb
        assert ra.splitlines()[0] != rb.splitlines()[0]
        # each clone has its own identity: kernel hostname and machine-id
        ida = a.exec("hostname; cat /etc/machine-id").stdout.split()
        idb = b.exec("hostname; cat /etc/machine-id").stdout.split()
        assert ida[0] == a.id and idb[0] == b.id
        assert len(ida[1]) == 32 and ida[1] != idb[1]
        # its name and localhost resolve locally (/etc/hosts), whatever its network
        for x in (a, b):
            r = x.exec("getent hosts localhost $(hostname)")
            assert r.exit_code == 0 and f"127.0.1.1       {x.id}" in r.stdout, r
        # and the clock is the host's, not the snapshot's
        assert abs(float(a.exec("date +%s.%N").stdout) - time.time()) < 5
    finally:
        for s in (a, b):
            s.kill()
            s.close()


def test_fork_copies_memory_and_files(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    src = Sandbox.create(template="python", timeout="5m", **kw)
    clones: list[Sandbox] = []
    try:
        start_holder(src)
        poke(src)
        src.files.write("/work/shared.txt", "from the source")
        clones = src.fork(2)
        assert len({c.id for c in clones} | {src.id}) == 3
        for s in (src, *clones):
            assert s.exec("hostname").stdout.strip() == s.id
            assert s.files.read_text("/work/shared.txt") == "from the source"
            assert poke(s) == f"2 {100 << 20} True"  # same memory: the counter was 1
        clones[0].files.write("/work/shared.txt", "changed in clone 0")
        assert src.files.read_text("/work/shared.txt") == "from the source"
        assert clones[1].files.read_text("/work/shared.txt") == "from the source"
    finally:
        for s in (src, *clones):
            s.kill()
            s.close()


@pytest.mark.parametrize("fresh_daemon", [{"CPUOS_POOL_SIZE": "2"}], indirect=True)
def test_pool_never_hands_out_a_sandbox_twice(fresh_daemon: Daemon) -> None:
    kw = fresh_daemon.sdk_kwargs()
    for _ in range(300):  # the pool fills in the background after start
        if len(fresh_daemon.runsc_containers()) >= 2:
            break
        time.sleep(0.1)
    got: list[Sandbox] = []
    lock = threading.Lock()

    def make() -> None:
        s = Sandbox.create(template="python", timeout="5m", **kw)
        with lock:
            got.append(s)

    threads = [threading.Thread(target=make) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        ids = [s.id for s in got]
        assert len(ids) == 6 and len(set(ids)) == 6
        for i, s in enumerate(got):
            s.files.write("/work/owner.txt", str(i))
        for i, s in enumerate(got):
            assert s.files.read_text("/work/owner.txt") == str(i)
        listed = {s.id for s in Sandbox.list(**kw)}
        assert listed == set(ids)  # pooled sandboxes are nobody's until handed out
    finally:
        for s in got:
            s.kill()
            s.close()


def test_sigkill_while_paused_then_resume(fresh_daemon: Daemon) -> None:
    d = fresh_daemon
    sbx = Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs())
    start_holder(sbx)
    poke(sbx)
    sbx.files.write("/work/f.txt", "intact")
    sid = sbx.pause()
    sbx.close()
    d.kill9()
    d.start()
    back = Sandbox.resume(sid, **d.sdk_kwargs())
    assert back.files.read_text("/work/f.txt") == "intact"
    assert poke(back) == f"2 {100 << 20} True"
    back.kill()
    back.close()


@pytest.mark.parametrize("delay", [0.05, 0.4, 1.0])
def test_sigkill_during_pause_never_loses_the_sandbox(fresh_daemon: Daemon,
                                                     delay: float) -> None:
    d = fresh_daemon
    kw = d.sdk_kwargs()
    sbx = Sandbox.create(template="python", timeout="5m", **kw)
    start_holder(sbx)
    sbx.files.write("/work/f.txt", "intact")
    t = threading.Thread(target=lambda: _ignore_errors(sbx.pause))
    t.start()
    time.sleep(delay)
    d.kill9()
    t.join()
    sbx.close()
    time.sleep(1.5)  # let a runsc checkpoint that outlived the daemon finish
    d.start()
    info = None
    for _ in range(100):
        info = Sandbox.connect(sbx.id, auto_resume=False, **kw).info()
        if info.state in ("running", "paused"):
            break
        time.sleep(0.1)
    assert info is not None and info.state in ("running", "paused"), info
    if info.state == "running":  # and it still has a deadline the reaper will honour
        assert info.deadline is not None and info.timeout_remaining
    back = Sandbox.connect(sbx.id, **kw)  # resumes a paused one
    for _ in range(50):  # a reattached agent may take a moment to reconnect
        try:
            assert back.files.read_text("/work/f.txt") == "intact"
            break
        except Exception:
            time.sleep(0.1)
    else:
        raise AssertionError("sandbox not usable after restart")
    assert poke(back).split()[1:] == [str(100 << 20), "True"]
    back.kill()
    back.close()


def _ignore_errors(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except Exception:
        pass


def test_pause_with_full_snapshot_dir_fails_cleanly() -> None:
    from cpuosd.testing import e2e_unavailable

    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    small = Path(tempfile.mkdtemp(prefix="cpuos-snapfull-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(small)], check=True)
    d = new_daemon(CPUOS_SNAPSHOTS_DIR=str(small), CPUOS_POOL_SIZE="0",
                   CPUOS_TEMPLATE_SNAPSHOTS="0")
    try:
        d.start()
        sbx = Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs())
        start_holder(sbx)
        with pytest.raises(NoSpace) as e:
            sbx.pause()
        assert "space" in e.value.message
        assert sbx.info().state == "running"
        assert poke(sbx).endswith("True")
        assert list(small.iterdir()) == []
        sbx.kill()
        sbx.close()
    finally:
        d.teardown(False)
        subprocess.run(["umount", str(small)], check=False)
        small.rmdir()
