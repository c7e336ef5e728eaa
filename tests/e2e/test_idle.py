"""Issue 22, item 3: an idle sandbox pauses itself (``idle_timeout``) and any call that needs
the machine wakes it; info, list and metrics do not. A sandbox running a CPU-bound command,
or with a stream open to it, is not idle. A DELETE returns during an auto-pause or a wake,
and a client that leaves mid-wake leaves nothing half-made.

Timeouts are shortened through the API (``idle_timeout="2s"``). Where a test must show that
something is *not* paused, a control sandbox made after it with the same timeout is waited
for until it is paused: by then the daemon had looked at the other one past its timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cpuos import Conflict, InvalidArgument, Sandbox
from support.daemon import Daemon, e2e_unavailable, wait_until, wrapped_runsc_daemon

pytestmark = pytest.mark.e2e

IDLE = "2s"


def idle_paused(s: Sandbox) -> bool:
    i = s.info()
    return i.state == "paused" and i.reason == "idle"


def wait_idle_paused(s: Sandbox) -> None:
    wait_until(lambda: idle_paused(s), f"{s.id} paused for idleness", 120)


def lifecycle(d: Daemon, sid: str) -> list[dict[str, Any]]:
    with d.client() as c:
        rows = c.get(f"/sandboxes/{sid}/audit", params={"kind": "lifecycle"}).json()["rows"]
    return [r["detail"] for r in rows]


def test_idle_sandbox_pauses_and_only_machine_calls_wake_it(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    s = Sandbox.create(template="python", timeout="10m", idle_timeout=IDLE, **kw)
    try:
        assert s.info().idle_timeout == 2.0
        s.files.write("/work/kept.txt", "kept")
        wait_idle_paused(s)
        # what reads the record, not the machine, leaves it paused
        assert [i.state for i in Sandbox.list(**kw) if i.id == s.id] == ["paused"]
        m = s.metrics()
        assert m["state"] == "paused" and m["snapshot_bytes"] > 0
        s.usage()
        with daemon.client() as c:
            assert c.get(f"/sandboxes/{s.id}/connections").status_code == 200
            assert c.get(f"/sandboxes/{s.id}/ports").status_code == 200
            assert c.get("/metrics").status_code == 200
        assert idle_paused(s)
        # why: an idle event, then the pause with its reason, in the audit trail; the
        # paused time counted as idle in the usage
        trail = lifecycle(daemon, s.id)
        i = next(n for n, r in enumerate(trail) if r.get("event") == "idle")
        assert trail[i]["idle_timeout"] == 2.0 and trail[i]["idle_seconds"] >= 2.0
        assert {"from": "pausing", "to": "paused", "reason": "idle"}.items() \
            <= trail[i + 2].items()
        wait_until(lambda: s.usage()["idle_paused_seconds"] > 0, "idle paused time metered")
        # five calls at once: one resume, all served, the machine as it was
        got: dict[int, str] = {}

        def call(k: int) -> None:
            got[k] = s.exec(f"cat /work/kept.txt; echo {k}").stdout

        threads = [threading.Thread(target=call, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {k: f"kept{k}\n" for k in range(5)}
        assert s.info().state == "running" and s.info().reason is None
        trail = lifecycle(daemon, s.id)
        assert [r for r in trail if r.get("to") == "resuming"] == [
            {"from": "paused", "to": "resuming"}]
    finally:
        s.kill()


def _pty(s: Sandbox) -> None:
    t = s.pty.create(cmd=["/bin/echo", "tty"])
    assert b"tty" in t.wait().stdout_bytes


def _fork(s: Sandbox) -> None:
    for c in s.fork():
        assert c.exec("cat /work/a.txt").stdout == "a"
        c.kill()
        c.close()


def _tar(s: Sandbox, tmp: Path) -> None:
    assert s.files.download_dir("/work", tmp / "down") > 0
    assert (tmp / "down" / "a.txt").read_text() == "a"


def _watch(s: Sandbox) -> None:
    h = s.files.watch("/work", lambda e: None)
    h.stop()


def _code(s: Sandbox) -> None:
    assert s.run_code("6 * 7", timeout=120).text == "42"


CALLS: dict[str, Callable[..., Any]] = {
    "exec": lambda s, _: s.exec("true").exit_code == 0,
    "files.write": lambda s, _: s.files.write("/work/b.txt", "b"),
    "files.read": lambda s, _: s.files.read_text("/work/a.txt") == "a",
    "files.list": lambda s, _: s.files.list("/work"),
    "commands.start": lambda s, _: s.exec("true", background=True).wait(),
    "commands.list": lambda s, _: s.commands.list(),
    "pty": lambda s, _: _pty(s),
    "run_code": lambda s, _: _code(s),
    "fork": lambda s, _: _fork(s),
    "files.download_dir": _tar,
    "files.watch": lambda s, _: _watch(s),
}


@pytest.fixture(scope="module")
def asleep(daemon: Daemon) -> Iterator[dict[str, Sandbox]]:
    """A sandbox for each kind of call, a file written in each, then left alone until every
    one is paused for idleness: made together, they wait out the idle timeout once."""
    made: dict[str, Sandbox] = {}
    try:
        for kind in CALLS:
            made[kind] = Sandbox.create(template="python", timeout="10m", idle_timeout=IDLE,
                                        **daemon.sdk_kwargs())
            made[kind].files.write("/work/a.txt", "a")
        for s in made.values():
            wait_idle_paused(s)
        yield made
    finally:
        for s in made.values():
            s.kill()


@pytest.mark.parametrize("kind", list(CALLS))
def test_each_kind_of_call_resumes(asleep: dict[str, Sandbox], kind: str,
                                   tmp_path: Path) -> None:
    s = asleep[kind]
    try:
        assert idle_paused(s), kind  # (nothing woke it since)
        CALLS[kind](s, tmp_path)
        assert s.info().state == "running", kind
    finally:
        s.kill()


def test_a_preview_request_resumes(daemon: Daemon) -> None:
    s = Sandbox.create(template="python", timeout="10m", idle_timeout=IDLE,
                       **daemon.sdk_kwargs())
    try:
        s.exec("mkdir -p /work/site && echo hello > /work/site/index.html && "
               "cd /work/site && nohup python3 -m http.server 3000 >/dev/null 2>&1 &")
        with daemon.client() as c:
            p = c.post(f"/sandboxes/{s.id}/ports", json={"port": 3000}).json()
        tok = {"X-Cpuos-Token": p["token"]}
        wait_until(lambda: httpx.get(p["url"], headers=tok, timeout=30).status_code == 200,
                   "the server inside")
        wait_idle_paused(s)
        r = httpx.get(p["url"] + "index.html", headers=tok, timeout=60)
        assert r.status_code == 200 and r.text == "hello\n"
        assert s.info().state == "running"
    finally:
        s.kill()


def test_busy_cpu_and_open_streams_are_not_idle(daemon: Daemon) -> None:
    kw = daemon.sdk_kwargs()
    made: list[Sandbox] = []

    def new() -> Sandbox:
        made.append(Sandbox.create(template="python", timeout="10m", idle_timeout=IDLE,
                                   **kw))
        return made[-1]

    try:
        busy, follow, term, never = new(), new(), new(), new()
        spin = busy.exec("while :; do :; done", background=True)  # (nothing follows it)
        sleeper = follow.exec("sleep 600", background=True)
        followed = threading.Thread(target=lambda: sleeper.wait(), daemon=True)
        followed.start()  # its output stream stays open
        t = term.pty.create(on_data=lambda b: None)  # a terminal attached
        assert never.set_idle_timeout(0).idle_timeout == 0
        quiet = new()
        wait_idle_paused(quiet)  # the others were looked at past their timeout too
        for s in (busy, follow, term, never):
            assert s.info().state == "running", s.id
        # what kept them up ends: then they pause (the spin first: it burns a core)
        spin.kill()
        wait_idle_paused(busy)
        t.disconnect()
        wait_idle_paused(term)
        sleeper.kill()
        followed.join(60)
        wait_idle_paused(follow)
        assert never.info().state == "running"
        # a terminal reattached wakes its sandbox, the shell as it was
        t2 = term.pty.connect(t.pid)
        t2.send_input("echo again-$((6*7))\n")
        wait_until(lambda: b"again-42" in t2.output.value(), "the shell to answer")
        t2.kill()
    finally:
        for s in made:
            s.kill()


def test_workspace_default_and_bad_values(daemon: Daemon) -> None:
    with daemon.client() as c:
        w = c.post("/workspaces", json={"name": f"idle-{id(c)}"}).json()
        r = c.put(f"/workspaces/{w['id']}/settings", json={"default_idle_timeout": "2m"})
        assert r.status_code == 200 and r.json()["settings"]["default_idle_timeout"] == 120
        bad = c.put(f"/workspaces/{w['id']}/settings", json={"default_idle_timeout": "x"})
        assert bad.status_code == 422
    kw = daemon.sdk_kwargs(w["key"])
    a = Sandbox.create(template="python", **kw)
    b = Sandbox.create(template="python", idle_timeout=0, **kw)
    c_ = Sandbox.create(template="python", **daemon.sdk_kwargs())  # the daemon's: 10m
    try:
        assert (a.info().idle_timeout, b.info().idle_timeout, c_.info().idle_timeout) == (
            120.0, 0.0, 600.0)
        with pytest.raises(InvalidArgument):
            Sandbox.create(template="python", idle_timeout="soon", **kw)
        with pytest.raises(InvalidArgument):
            a.set_idle_timeout("-1s")
    finally:
        for s in (a, b, c_):
            s.kill()


# ---- bounds: a DELETE during an auto-pause or a wake; a client leaving mid-wake ----------
@pytest.fixture
def slow_daemon(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    hang = tmp_path / "hang"
    hang.mkdir()
    # runsc checkpoint hangs while $hang/checkpoint exists; restore waits while
    # $hang/restore exists (then goes on: the file's removal lets it)
    d = wrapped_runsc_daemon(tmp_path, f"""#!/bin/sh
for a in "$@"; do
  case "$a" in checkpoint|restore) sub=$a ;; esac
done
if [ "$sub" = checkpoint ] && [ -e "{hang}/checkpoint" ]; then exec sleep 300; fi
if [ "$sub" = restore ]; then while [ -e "{hang}/restore" ]; do sleep 0.1; done; fi
exec {{real}} "$@"
""")
    d.start()
    try:
        yield d, hang
    finally:
        for f in hang.iterdir():
            f.unlink()
        left = d.teardown(False)
        assert not left, left


def test_delete_during_an_auto_pause(slow_daemon: tuple[Daemon, Path]) -> None:
    d, hang = slow_daemon
    s = Sandbox.create(template="python", timeout="10m", idle_timeout="1s",
                       **d.sdk_kwargs())
    (hang / "checkpoint").touch()
    wait_until(lambda: s.info().state == "pausing", "the auto-pause to begin")
    with d.client() as c:
        r = c.delete(f"/sandboxes/{s.id}", timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "killed", r.text
    assert s.id not in d.runsc_containers()
    assert not (d.snapshots_dir / s.id).exists()


def test_a_wake_outlives_its_client_and_a_delete_ends_it(
        slow_daemon: tuple[Daemon, Path]) -> None:
    d, hang = slow_daemon
    kw = d.sdk_kwargs()
    s = Sandbox.create(template="python", timeout="10m", idle_timeout="1s", **kw)
    s.files.write("/work/a.txt", "a")
    wait_idle_paused(s)
    # a client that gives up while the resume it caused is under way
    (hang / "restore").touch()
    with d.client() as c:
        with pytest.raises(httpx.TimeoutException):
            c.post(f"/sandboxes/{s.id}/exec", json={"cmd": "true"}, timeout=1.5)
    assert s.info().state == "resuming"
    (hang / "restore").unlink()
    wait_until(lambda: s.info().state == "running", "the resume to finish")
    assert s.files.read_text("/work/a.txt") == "a"
    assert d.runsc_containers().count(s.id) == 1
    # a DELETE while a wake waits on runsc: it returns, the caller is told, nothing stays
    wait_idle_paused(s)
    (hang / "restore").touch()
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["r"] = s.exec("true")
        except Exception as e:
            out["e"] = e

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: s.info().state == "resuming", "the wake to begin")
    with d.client() as c:
        r = c.delete(f"/sandboxes/{s.id}", timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "killed", r.text
    caller.join(60)
    assert isinstance(out.get("e"), Conflict), out
    (hang / "restore").unlink()
    assert s.id not in d.runsc_containers()
    assert not (d.snapshots_dir / s.id).exists()
