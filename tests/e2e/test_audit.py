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
from cpuosd.testing import Daemon, wait_until

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
        assert ["/bin/sh", "-c", "echo background"] in runtime_argvs(daemon, s.id)

        writes = {r["detail"]["path"]: r["detail"] for r in rows(daemon, s.id, kind="file_write")
                  if r["detail"].get("source") == "api"}
        assert writes["/work/small.txt"]["sha256"] == hashlib.sha256(b"hello").hexdigest()
        assert writes["/work/blob.bin"]["size"] == len(blob)
        assert writes["/work/blob.bin"]["sha256"] == hashlib.sha256(blob).hexdigest()
        assert all(w["ok"] for w in writes.values())
        changes = [(r["detail"].get("op"), r["detail"]["path"])
                   for r in rows(daemon, s.id, kind="file_write") if r["detail"].get("op")]
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
        argvs = runtime_argvs(daemon, s.id)
        i = argvs.index(["python3", "-c", 'import os; os.system("id")'])
        assert ["sh", "-c", 'python3 -c "import os; os.system(\\"id\\")"'] in argvs[:i]
        assert ["sh", "-c", "id"] in argvs[i:] and ["id"] in argvs[i:]
        detail = next(x["detail"] for x in rows(daemon, s.id, kind="command")
                      if x["detail"].get("argv") == ["id"])
        assert detail["uid"] == 1000 and detail["binary"] == "/usr/bin/id"
        assert detail["cwd"] == "/work" and detail["pid"] > 1

        s.exec("echo hi > /work/inside.txt; python3 -c \"open('rel.txt', 'a').write('x')\"",
               cwd="/tmp")
        paths = {x["detail"]["path"] for x in rows(daemon, s.id, kind="file_write")
                 if x["detail"].get("source") == "runtime"}
        assert {"/work/inside.txt", "/tmp/rel.txt"} <= paths

        # a pause and resume (the sandbox is restored: a new Sentry connects again)
        s.pause()
        s = Sandbox.connect(s.id, **daemon.sdk_kwargs())
        s.exec(["/bin/echo", "after-resume"])
        assert ["/bin/echo", "after-resume"] in runtime_argvs(daemon, s.id)
        # a fork: the clone has a trace session of its own
        forks = s.fork()
        forks[0].exec(["/bin/echo", "in-the-fork"])
        assert ["/bin/echo", "in-the-fork"] in runtime_argvs(daemon, forks[0].id)
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
        assert ["sh", "-c", "/bin/echo replaced-agent"] in runtime_argvs(daemon, s.id)

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
        assert ["/bin/echo", "before-restart"] in runtime_argvs(d, s.id)
        d.kill9()
        d.start()
        s = Sandbox.connect(s.id, **d.sdk_kwargs())
        wait_until(lambda: s.exec("true").exit_code == 0, "the sandbox reattached", 60)
        s.exec(["/bin/echo", "after-restart"])
        wait_rows(d, s.id, lambda x: x["detail"].get("argv") == ["/bin/echo", "after-restart"]
                  and x["detail"].get("source") == "runtime", "the exec after the restart",
                  kind="command")
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


FLOOD = """\
import os, time
t = time.time()
n = 0
while time.time() - t < 4:
    for _ in range(1000):
        os.close(os.open("/etc/hostname", os.O_RDONLY))
    n += 1000
print(n)
"""


def test_a_flood_inside_is_bounded_and_counted(daemon: Daemon) -> None:
    """Code inside that opens files as fast as it can: every open is a trace message; the
    daemon reads at most its rate, the Sentry drops the rest and counts them, the count
    reaches the log as a dropped row, and the daemon and the recording carry on."""
    s = Sandbox.create(template="python", timeout="5m", **daemon.sdk_kwargs())
    try:
        s.files.write("/work/flood.py", FLOOD)
        h = s.exec(["python3", "/work/flood.py"], background=True)
        with daemon.client() as c:  # the daemon answers meanwhile
            assert c.get("/health").json()["ok"]
        assert s.exec(["/bin/echo", "during-the-flood"]).exit_code == 0
        r = h.wait()
        assert r.exit_code == 0 and int(r.stdout) > 10_000, r
        s.exec(["/bin/echo", "after-the-flood"])  # (carries the Sentry's last count)
        found = wait_rows(daemon, s.id, lambda x: x["detail"].get("argv") == [
            "/bin/echo", "after-the-flood"] and x["detail"].get("source") == "runtime",
            "the exec after the flood", kind="command")
        assert found
        dropped = [x["detail"] for x in rows(daemon, s.id, kind="dropped")]
        assert dropped and sum(d["count"] for d in dropped) > 0, dropped
        assert len(dropped) <= 30  # at most one a second (the flood lasts 4 s)
    finally:
        s.kill()


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
