"""The audit trail, end to end (real daemon, real runsc): every exec and file write through
the API is on record; what runs inside without the API (every execve, every file opened for
writing) is recorded from outside the sandbox by gVisor's runtime monitoring, also after a
pause, a resume and a fork, and also when code inside kills or replaces the agent; a row
edited in SQLite is reported by ``cpuos audit verify``."""

from __future__ import annotations

import hashlib
import json
import contextlib
import os
import queue
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from cpuos import Sandbox
from support.daemon import Daemon, wait_until

pytestmark = pytest.mark.e2e

NESTED = """sh -c 'python3 -c "import os; os.system(\\"id\\")"'"""


def rows(d: Daemon, sid: str, key: str | None = None, **params: Any) -> list[dict[str, Any]]:
    with d.client(key) as c:
        r = c.get(f"/sandboxes/{sid}/audit", params={"limit": 10000, **params})
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["rows"]
    return out


def wait_rows(d: Daemon, sid: str, match: Callable[[dict[str, Any]], bool], what: str,
              **params: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [r for r in rows(d, sid, **params) if match(r)]
        return bool(found)

    wait_until(seen, what, 60)
    return found


def runtime_argvs(d: Daemon, sid: str, **params: Any) -> list[list[str]]:
    return [r["detail"]["argv"] for r in rows(d, sid, kind="command", **params)
            if r["detail"].get("source") == "runtime"]


def wait_argvs(d: Daemon, sid: str, *wanted: list[str]) -> list[list[str]]:
    """The runtime points reach the audit a moment after the command ends (the Sentry sends
    them in batches, the daemon writes them in batches): wait until every argv wanted is
    on record; the argvs recorded from inside."""
    for w in wanted:
        wait_rows(d, sid, from_inside("argv", w), f"{w} recorded from inside", kind="command")
    return runtime_argvs(d, sid)


def from_inside(key: str, value: Any) -> Callable[[dict[str, Any]], bool]:
    """A row recorded from inside (runtime monitoring) whose detail has key = value."""
    return lambda x: x["detail"].get(key) == value and x["detail"].get("source") == "runtime"


def cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CPUOS_API_URL": d.url, "CPUOS_API_KEY": d.key}
    return subprocess.run([sys.executable, "-m", "cpuos.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_every_api_exec_and_file_write_is_in_the_log(daemon: Daemon) -> None:
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        results = [s.exec("echo $TOKEN | wc -c", env={"TOKEN": "v-secret-123"}, cwd="/tmp"),
                   s.exec(["/bin/sh", "-c", "exit 3"]),
                   s.exec("ls /work")]
        bg = s.exec(["/bin/sh", "-c", "echo background"], background=True, env={"BG": "1"})
        assert bg.wait().exit_code == 0
        blob = os.urandom(3 << 20)
        s.files.write("/work/small.txt", "hello")
        s.files.write("/work/blob.bin", blob)
        s.files.mkdir("/work/made")
        s.files.remove("/work/made")
        with daemon.client() as c:
            execs = c.get(f"/sandboxes/{s.id}/execs").json()["execs"]
        assert len(execs) == 3

        cmds = {r["detail"]["exec_id"]: r["detail"] for r in rows(daemon, s.id, kind="command")
                if r["detail"].get("source") == "api" and not r["detail"].get("background")}
        assert set(cmds) == {e["id"] for e in execs}
        by_cmd = {json.dumps(c.get("shell") or c.get("argv")): c for c in cmds.values()}
        first = by_cmd[json.dumps("echo $TOKEN | wc -c")]
        assert first["env"] == ["TOKEN"] and first["cwd"] == "/tmp"
        assert first["exit_code"] == 0 and first["duration"] > 0
        assert by_cmd[json.dumps(["/bin/sh", "-c", "exit 3"])]["exit_code"] == 3
        assert [r.exit_code for r in results] == [0, 3, 0]

        started = [r["detail"] for r in rows(daemon, s.id, kind="command")
                   if r["detail"].get("background")]  # a background command through the API
        assert [(x["argv"], x["pid"], x["env"]) for x in started] == [
            (["/bin/sh", "-c", "echo background"], bg.pid, ["BG"])]
        wait_argvs(daemon, s.id, ["/bin/sh", "-c", "echo background"])

        writes = {r["detail"]["path"]: r["detail"] for r in rows(daemon, s.id, kind="file_write")
                  if r["detail"].get("source") == "api"}
        assert writes["/work/small.txt"]["sha256"] == hashlib.sha256(b"hello").hexdigest()
        assert writes["/work/blob.bin"]["size"] == len(blob)
        assert writes["/work/blob.bin"]["sha256"] == hashlib.sha256(blob).hexdigest()
        assert all(w["ok"] for w in writes.values())
        changes = [(r["detail"].get("op"), r["detail"]["path"])
                   for r in rows(daemon, s.id, kind="file_write")
                   if r["detail"].get("op") and r["detail"].get("source") == "api"]
        assert changes == [("mkdir", "/work/made"), ("remove", "/work/made")]

        everything = rows(daemon, s.id)
        assert "v-secret-123" not in json.dumps(everything)  # env names, never values
        assert [r["seq"] for r in everything] == sorted(r["seq"] for r in everything)
        assert any(r["kind"] == "lifecycle" and r["detail"].get("to") == "running"
                   for r in everything)

        # the JSON-lines export and the CLI give the same rows
        with daemon.client() as c:
            export = [json.loads(x) for x in
                      c.get(f"/sandboxes/{s.id}/audit/export").text.splitlines()]
        assert [r["seq"] for r in export][:len(everything)] == [r["seq"] for r in everything]
        out = cli(daemon, "audit", s.id, "--json", "--kind", "file_write")
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert lines and {x["kind"] for x in lines} == {"file_write"}
        assert {"/work/small.txt", "/work/blob.bin"} <= {x["detail"]["path"] for x in lines}
        # filters: a kind that does not exist, and a time range
        with daemon.client() as c:
            bad = c.get(f"/sandboxes/{s.id}/audit", params={"kind": "nope"})
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_argument"
        assert rows(daemon, s.id, until=everything[0]["time"]) == []
        assert rows(daemon, s.id, after=everything[-1]["seq"], kind="lifecycle") == []

        # another workspace sees none of it
        with daemon.client() as c:
            other = c.post("/workspaces", json={"name": f"audit-{os.getpid()}-{time.time_ns()}"}
                           ).json()["key"]
        with daemon.client(other) as c:
            r = c.get(f"/sandboxes/{s.id}/audit")
            assert r.status_code == 404, r.text
            assert c.get(f"/sandboxes/{s.id}/audit/export").status_code == 404
    finally:
        s.kill()
    # after the kill, the rows stay, with the end of the sandbox
    assert rows(daemon, s.id, kind="lifecycle")[-1]["detail"]["to"] == "killed"
    v = cli(daemon, "audit", "verify")
    assert v.returncode == 0 and v.stdout.startswith("ok"), v.stdout + v.stderr


def test_processes_started_inside_are_recorded_with_their_argv(daemon: Daemon) -> None:
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    forks: list[Sandbox] = []
    try:
        r = s.exec(NESTED)
        assert r.exit_code == 0 and "uid=1000" in r.stdout
        argvs = wait_argvs(daemon, s.id, ["python3", "-c", 'import os; os.system("id")'],
                           ["id"])
        i = argvs.index(["python3", "-c", 'import os; os.system("id")'])
        assert ["sh", "-c", 'python3 -c "import os; os.system(\\"id\\")"'] in argvs[:i]
        assert ["sh", "-c", "id"] in argvs[i:] and ["id"] in argvs[i:]
        detail = next(x["detail"] for x in rows(daemon, s.id, kind="command")
                      if x["detail"].get("argv") == ["id"])
        assert detail["uid"] == 1000 and detail["binary"] == "/usr/bin/id"
        assert detail["cwd"] == "/work" and detail["pid"] > 1

        s.exec("echo hi > /work/inside.txt; python3 -c \"open('rel.txt', 'a').write('x')\"",
               cwd="/tmp")
        for path in ("/work/inside.txt", "/tmp/rel.txt"):
            wait_rows(daemon, s.id, from_inside("path", path),
                      f"the write to {path} recorded from inside", kind="file_write")

        # a pause and resume (the sandbox is restored: a new Sentry connects again)
        s.pause()
        s = Sandbox.connect(s.id, **daemon.sdk_kwargs())
        s.exec(["/bin/echo", "after-resume"])
        wait_argvs(daemon, s.id, ["/bin/echo", "after-resume"])
        # a fork: the clone has a trace session of its own
        forks = s.fork()
        forks[0].exec(["/bin/echo", "in-the-fork"])
        wait_argvs(daemon, forks[0].id, ["/bin/echo", "in-the-fork"])
        assert ["/bin/echo", "in-the-fork"] not in runtime_argvs(daemon, s.id)
    finally:
        for f in forks:
            f.kill()
        s.kill()


def test_killing_or_replacing_the_agent_does_not_stop_the_recording(daemon: Daemon) -> None:
    """Commands run as the sandbox's user, who may not signal the agent (real uid 0); the
    recording does not depend on it anyway: with the agent frozen (SIGSTOP, sent as root
    inside, as code that got the agent's privileges would), a process left running keeps
    being recorded, and so does one that stands in for the agent; killing the agent ends
    the sandbox, and that is on record too."""
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        s.exec("setsid nohup sh -c 'i=0; while [ $i -lt 600 ]; do /bin/echo tick-$i "
               ">/dev/null; i=$((i+1)); sleep 0.1; done' >/dev/null 2>&1 &")
        r = s.exec("kill -KILL 1 2; pkill -KILL -f cpuos_agent; echo done")
        assert "Operation not permitted" in r.stderr and s.exec("true").exit_code == 0

        def as_root(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([daemon.runsc, "--root", str(daemon.runsc_root), "exec",
                                   "--user", "0:0", s.id, *argv], capture_output=True,
                                  text=True, timeout=60)

        p = as_root("sh", "-c", "for p in $(pgrep -f '[c]puos_agent'); do kill -STOP $p; done;"
                    " grep State /proc/1/status")
        assert p.returncode == 0 and "stopped" in p.stdout, p.stdout + p.stderr
        frozen = time.time()
        p = as_root("python3", "-c", "import os; os.system('/bin/echo replaced-agent')")
        assert p.returncode == 0 and "replaced-agent" in p.stdout, p.stderr
        wait_rows(daemon, s.id, lambda x: (x["detail"].get("argv") or [""])[0] == "/bin/echo"
                  and x["time"] > frozen + 1 and x["detail"]["argv"][1].startswith("tick-"),
                  "ticks recorded while the agent is frozen", kind="command")
        wait_argvs(daemon, s.id, ["sh", "-c", "/bin/echo replaced-agent"])

        p = as_root("sh", "-c", "kill -KILL 1")
        ended = wait_rows(daemon, s.id, lambda x: x["detail"].get("to") in ("error", "killed"),
                          "the sandbox's end on record", kind="lifecycle")
        assert ended
    finally:
        s.kill()
    with daemon.client() as c:
        assert c.get("/audit/verify").json()["ok"]


def test_an_edited_row_is_reported_by_verify(fresh_daemon: Daemon) -> None:
    d = fresh_daemon
    s = Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs())
    try:
        s.exec(["/bin/echo", "the truth"])
        target = next(r for r in rows(d, s.id, kind="command")
                      if r["detail"].get("argv") == ["/bin/echo", "the truth"]
                      and r["detail"].get("source") == "api")
        assert cli(d, "audit", "verify").returncode == 0
        db = sqlite3.connect(d.home / "audit.db")
        with db:
            db.execute("UPDATE audit SET detail=? WHERE seq=?",
                       (json.dumps({**target["detail"], "argv": ["/bin/echo", "a lie"]},
                                   sort_keys=True, separators=(",", ":")), target["seq"]))
        db.close()
        out = cli(d, "audit", "verify")
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"seq {target['seq']}: its content does not match its hash" in out.stdout
        assert s.id in out.stdout and "BROKEN" in out.stdout
        host = subprocess.run([sys.executable, "-m", "cpuosd.main", "audit", "verify",
                               "--home", str(d.home), "--json"], capture_output=True,
                              text=True, timeout=60)
        assert host.returncode == 1
        assert [p["seq"] for p in json.loads(host.stdout)["problems"]] == [target["seq"]]
    finally:
        s.kill()


def test_a_restarted_daemon_records_what_runs_in_sandboxes_it_reattaches(
        fresh_daemon: Daemon) -> None:
    """The Sentry's sink socket died with the old daemon: the new one re-attaches a trace
    session (runsc trace create --force) to every running sandbox it adopts."""
    d = fresh_daemon
    s = Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs())
    try:
        s.exec(["/bin/echo", "before-restart"])
        wait_argvs(d, s.id, ["/bin/echo", "before-restart"])
        d.kill9()
        d.start()
        s = Sandbox.connect(s.id, **d.sdk_kwargs())
        wait_until(lambda: s.exec("true").exit_code == 0, "the sandbox reattached", 60)
        s.exec(["/bin/echo", "after-restart"])
        wait_argvs(d, s.id, ["/bin/echo", "after-restart"])
        with d.client() as c:
            assert c.get("/audit/verify").json()["ok"]
    finally:
        s.kill()


def test_cli_follow_prints_rows_as_they_come(daemon: Daemon) -> None:
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    env = {**os.environ, "CPUOS_API_URL": daemon.url, "CPUOS_API_KEY": daemon.key}
    p = subprocess.Popen([sys.executable, "-m", "cpuos.cli.main", "audit", s.id, "--follow",
                          "--json", "--kind", "command"], env=env, stdout=subprocess.PIPE,
                         text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert p.stdout is not None
    def read() -> None:
        for line in p.stdout or ():
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        s.exec(["/bin/echo", "followed"])
        deadline = time.monotonic() + 60
        seen: list[dict[str, Any]] = []
        while not any(x["detail"].get("source") == "api" for x in seen):
            left = deadline - time.monotonic()
            assert left > 0, f"no row of the exec followed: {seen}"
            with contextlib.suppress(queue.Empty):
                seen.append(json.loads(lines.get(timeout=left)))
        assert {x["kind"] for x in seen} == {"command"}
        assert ["/bin/echo", "followed"] in [x["detail"].get("argv") for x in seen]
        assert p.poll() is None  # still following
    finally:
        p.terminate()
        p.wait(10)
        s.kill()


# Every way to change a file that the runtime monitoring once missed (issue 25, finding 5),
# from inside, as the sandbox's user: openat2, mknod, truncate by path, link, symlink,
# rename(at2), unlink, mkdir/rmdir, an O_PATH fd reopened for writing through
# /proc/self/fd/N, and a relative name through a directory fd.
EVASIONS = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class How(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]
how = How(os.O_WRONLY | os.O_CREAT, 0o644, 0)
fd = libc.syscall(437, -100, b"/work/ev/o2.txt", ctypes.byref(how), ctypes.sizeof(how))
assert fd >= 0, ctypes.get_errno()
os.write(fd, b"written through openat2"); os.close(fd)
os.mknod("/work/ev/node", 0o600 | 0o100000)
with open("/work/ev/t.txt", "w") as f:
    f.write("hello")
os.truncate("/work/ev/t.txt", 1)
os.link("/work/ev/t.txt", "/work/ev/hard")
os.symlink("/etc/passwd", "/work/ev/sym")
os.rename("/work/ev/hard", "/work/ev/renamed")
assert libc.syscall(316, -100, b"/work/ev/renamed", -100, b"/work/ev/renamed2", 0) == 0
os.unlink("/work/ev/renamed2")
os.mkdir("/work/ev/d")
os.rmdir("/work/ev/d")
p = os.open("/work/ev/t.txt", os.O_PATH)
w = os.open(f"/proc/self/fd/{p}", os.O_WRONLY)
os.write(w, b"through /proc/self/fd"); os.close(w)
sub = os.open("/work/ev/sub", os.O_RDONLY | os.O_DIRECTORY)
os.close(os.open("rel.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=sub))
print("done")
"""


def runtime_changes(d: Daemon, sid: str) -> list[dict[str, Any]]:
    return [r["detail"] for r in rows(d, sid, kind="file_write")
            if r["detail"].get("source") == "runtime" and r["detail"]["uid"] == 1000]


def test_every_way_to_change_a_file_is_recorded(daemon: Daemon) -> None:
    """What the Sentry reports names the file changed, resolved in the Sentry: the file an
    fd refers to (not /proc/self/fd/N), a relative name joined to its directory fd's path."""
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        s.files.write("/work/ev.py", EVASIONS)
        r = s.exec("mkdir -p /work/ev/sub && python3 /work/ev.py")
        assert (r.exit_code, r.stdout.strip()) == (0, "done"), r.stderr
        want = {("open", "/work/ev/o2.txt"), ("mknod", "/work/ev/node"),
                ("open", "/work/ev/t.txt"), ("truncate", "/work/ev/t.txt"),
                ("link", "/work/ev/hard"), ("symlink", "/work/ev/sym"),
                ("rename", "/work/ev/renamed"), ("rename", "/work/ev/renamed2"),
                ("unlink", "/work/ev/renamed2"), ("mkdir", "/work/ev/d"),
                ("rmdir", "/work/ev/d"), ("open", "/work/ev/sub/rel.txt")}
        got: list[dict[str, Any]] = []

        def seen() -> bool:
            got[:] = runtime_changes(daemon, s.id)
            return want <= {(g["op"], g["path"]) for g in got}

        try:
            wait_until(seen, "every change on record", 30)
        except TimeoutError:
            raise AssertionError(f"missing: {want - {(g['op'], g['path']) for g in got}}; "
                                 f"rows: {got}") from None
        by = {(g["op"], g["path"]): g for g in got}
        assert by[("open", "/work/ev/o2.txt")]["syscall"] == "openat2"
        assert by[("link", "/work/ev/hard")]["from"] == "/work/ev/t.txt"
        assert by[("symlink", "/work/ev/sym")]["target"] == "/etc/passwd"
        assert by[("rename", "/work/ev/renamed")]["from"] == "/work/ev/hard"
        assert by[("rename", "/work/ev/renamed2")]["from"] == "/work/ev/renamed"
        reopened = [g for g in got if g.get("name", "").startswith("/proc/self/fd/")]
        assert [(g["op"], g["path"], g["flags"]) for g in reopened] == [
            ("open", "/work/ev/t.txt", ["O_WRONLY"])]
        assert all(not g["path"].startswith("/proc/") for g in got)
    finally:
        s.kill()


# Another thread changes what a rename's names mean while the main thread renames: it
# rewrites the destination string in memory ("name"), or moves the process's working
# directory between two directories ("cwd", the names being relative). What is recorded
# must be what the syscall used (the Sentry keeps the paths it copied in and the
# directories it resolved them from), not what the trace point would find afterwards.
RACE = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
mode, n = sys.argv[1], int(sys.argv[2])
for d in ("/work/race/d1", "/work/race/d2"):
    os.makedirs(d, exist_ok=True)
if mode == "name":
    names = [b"/work/race/y1\0", b"/work/race/y2\0"]
    buf = ctypes.create_string_buffer(64)
    buf.raw = names[0] + b"\0" * (64 - len(names[0]))
    src, dst = b"/work/race/x", buf
    outcomes = ["/work/race/y1", "/work/race/y2"]
else:
    os.chdir("/work/race/d1")
    src, dst = b"x", b"y"
    outcomes = ["/work/race/d1/y", "/work/race/d2/y"]
stop = False
def flip():
    i = 0
    while not stop:
        if mode == "name":
            ctypes.memmove(buf, names[i & 1], len(names[i & 1]))
        else:
            os.chdir(("/work/race/d1", "/work/race/d2")[i & 1])
        i += 1
threading.Thread(target=flip, daemon=True).start()
done = dict.fromkeys(outcomes, 0)
for _ in range(n):
    for d in ("/work/race", "/work/race/d1", "/work/race/d2"):
        open(f"{d}/x", "w").close()
    assert libc.rename(src, dst) == 0, ctypes.get_errno()
    for k in done:
        if os.path.exists(k):
            done[k] += 1
            os.unlink(k)
stop = True
print(" ".join(f"{k}={v}" for k, v in done.items()))
"""


@pytest.mark.parametrize("mode", ["name", "cwd"])
def test_what_changes_after_the_syscall_does_not_change_the_record(daemon: Daemon,
                                                                   mode: str) -> None:
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        s.files.write("/work/race.py", RACE)
        r = s.exec(["python3", "/work/race.py", mode, "300"], timeout="4m")
        assert r.exit_code == 0, r.stderr
        done = {k: int(v) for k, v in (x.split("=") for x in r.stdout.split())}
        assert sum(done.values()) == 300
        assert min(done.values()) > 0, done  # it really changed under the syscalls

        def renamed() -> dict[str, int]:
            out = dict.fromkeys(done, 0)
            for g in runtime_changes(daemon, s.id):
                if g["op"] == "rename" and g["path"] in out:
                    out[g["path"]] += int(g.get("count") or 1)
            return out

        wait_until(lambda: sum(renamed().values()) >= 300, "every rename on record "
                   "(repeats coalesced)", 60)
        assert renamed() == done
    finally:
        s.kill()


FLOOD = """\
import os, sys, time
t = time.time()
reads = writes = 0
while time.time() - t < float(sys.argv[1]):
    for _ in range(200):
        os.close(os.open("/etc/hostname", os.O_RDONLY))
        with open("/tmp/flood.txt", "w") as f:
            f.write("x")
    reads += 200
    writes += 200
print(reads, writes)
"""


def test_a_flood_cannot_push_out_what_follows(daemon: Daemon) -> None:
    """Code inside opening files as fast as it can for 3 s, for reading and for writing one
    file again and again: reads are never sent (filtered in the Sentry), the repeated write
    is coalesced (one row at once, then rows with a count: every write accounted for, in a
    few rows), nothing is dropped, the daemon answers meanwhile, and a write right after
    the flood is on record."""
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        s.files.write("/work/flood.py", FLOOD)
        h = s.exec(["python3", "/work/flood.py", "3"], background=True)
        with daemon.client() as c:  # the daemon answers meanwhile
            assert c.get("/health").json()["ok"]
        assert s.exec(["/bin/echo", "during-the-flood"]).exit_code == 0
        r = h.wait()
        assert r.exit_code == 0, r
        reads, writes = (int(x) for x in r.stdout.split())
        assert reads == writes > 1000, r.stdout
        assert s.exec("echo after > /work/after.txt").exit_code == 0
        wait_rows(daemon, s.id, from_inside("path", "/work/after.txt"),
                  "the write after the flood", kind="file_write")

        def flood_rows() -> list[dict[str, Any]]:
            return [x["detail"] for x in rows(daemon, s.id, kind="file_write")
                    if x["detail"].get("path") == "/tmp/flood.txt"]

        wait_until(lambda: sum(int(d.get("count") or 1) for d in flood_rows()) >= writes,
                   "every write of the flood accounted for", 60)
        flood = flood_rows()
        assert sum(int(d.get("count") or 1) for d in flood) == writes
        assert len(flood) <= 12, flood  # 3 s of it: the first, then a row a window at most
        assert not [x for x in rows(daemon, s.id) if x["detail"].get("path") == "/etc/hostname"]
        assert rows(daemon, s.id, kind="dropped") == []
    finally:
        s.kill()


DISTINCT = """\
import os, sys
os.makedirs("/work/many", exist_ok=True)
for i in range(int(sys.argv[1])):
    open(f"/work/many/f{i}", "w").close()
print("ok")
"""


@pytest.mark.parametrize("fresh_daemon", [{"CPUOS_AUDIT_SANDBOX_ROWS": "500"}],
                         indirect=True)
def test_a_sandbox_past_its_row_budget_is_counted_not_written(fresh_daemon: Daemon) -> None:
    """3,000 distinct files (nothing to coalesce) in a sandbox whose budget is 500 rows an
    hour: about 500 rows are written, the rest is counted in dropped rows that name the
    kind and the directory; lifecycle rows still come; the chain verifies."""
    d = fresh_daemon
    s = Sandbox.create(template="python", timeout="5m", **d.sdk_kwargs())
    try:
        s.files.write("/work/many.py", DISTINCT)
        assert s.exec(["python3", "/work/many.py", "3000"], timeout="4m").exit_code == 0
        wait_rows(d, s.id, lambda x: x["detail"].get("kinds", {}).get("file_write", 0) > 0,
                  "a dropped row for the budget", kind="dropped")
        made = [x for x in rows(d, s.id, kind="file_write")
                if x["detail"].get("path", "").startswith("/work/many/")]
        assert 0 < len(made) <= 500
        dropped = [x["detail"] for x in rows(d, s.id, kind="dropped")]
        assert all("row budget" in x["source"] for x in dropped), dropped
        assert any("/work/many" in x.get("directories", {}) for x in dropped)
    finally:
        s.kill()
    wait_rows(d, s.id, lambda x: x["detail"].get("to") == "killed", "the kill on record",
              kind="lifecycle")
    with d.client() as c:
        assert c.get("/audit/verify").json()["ok"]


def test_a_limit_hit_is_on_record(daemon: Daemon) -> None:
    """A command killed at the sandbox's memory limit: a ``limit`` row names it."""
    s = Sandbox.create(template="python", timeout="5m", memory="256MiB", **daemon.sdk_kwargs())
    try:
        r = s.exec("python3 -c 'x = []\nwhile True: x.append(bytearray(8 << 20))'",
                   timeout="120s")
        assert (r.exit_code, r.oom) == (137, True), r
        hit = wait_rows(daemon, s.id, lambda x: x["detail"].get("limit") == "memory",
                        "the limit row", kind="limit")
        assert hit[0]["detail"]["exit_code"] == 137 and hit[0]["detail"]["exec_id"]
    finally:
        s.kill()
