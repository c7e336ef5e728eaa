"""Every operation has a way out: a DELETE of a sandbox still being created returns and
cancels the create; a kill stuck in runsc never holds up other sandboxes' deadlines.
A runsc wrapper (the real runsc, except that it hangs on request) injects the stuck calls."""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.daemon import (Daemon, e2e_unavailable, runsc_processes, wait_until,
                            wrapped_runsc_daemon)

pytestmark = pytest.mark.e2e
# s a kill waits for its teardown here (the default is 20): a stuck kill gives up sooner,
# and still long after the other sandbox's deadline kill is done (about 4 s)
KILL_TIMEOUT = 10


@pytest.fixture
def hang_daemon(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    hang = tmp_path / "hang"
    hang.mkdir()
    # hangs (in its own process, killable) when $hang/<subcommand> or $hang/<id> exists;
    # $hang/restore-midway: the real runsc restore, frozen once it has started its sandbox
    d = wrapped_runsc_daemon(tmp_path, f"""#!/bin/sh
for a in "$@"; do
  case "$a" in delete|restore|run) sub=$a ;; esac
done
if [ -n "$sub" ] && [ -e "{hang}/$sub" ]; then exec sleep 300; fi
if [ "$sub" = restore ] && [ -e "{hang}/restore-midway" ]; then
  {{real}} "$@" &
  r=$!
  until pgrep -P $r -f '^runsc-sandbox' >/dev/null || ! kill -0 $r; do sleep 0.02; done
  kill -STOP $r
  wait $r
  exit 1
fi
if [ "$sub" = delete ]; then for a in "$@"; do [ -e "{hang}/$a" ] && exec sleep 300; done; fi
exec {{real}} "$@"
""", CPUOS_KILL_TIMEOUT=str(KILL_TIMEOUT))
    d.start()
    try:
        yield d, hang
    finally:
        for f in hang.iterdir():
            f.unlink()
        left = d.teardown(False)
        assert not left, left


def _state(c: httpx.Client, sid: str) -> str:
    s = c.get(f"/sandboxes/{sid}").json()["state"]
    assert isinstance(s, str)
    return s


def _delete_while_creating(d: Daemon, started: Callable[[str], bool] = lambda sid: True
                           ) -> tuple[str, dict[str, Any]]:
    """A create in a thread; once its sandbox is in creating (and ``started`` says so of
    its id), a DELETE of it, which must return and end the create. The sandbox's id and
    the create's outcome ("r": its answer, or "e": its error)."""
    result: dict[str, Any] = {}

    def create() -> None:
        with d.client() as c:
            try:
                result["r"] = c.post("/sandboxes", json={"template": "python"}, timeout=120)
            except httpx.HTTPError as e:
                result["e"] = e

    t = threading.Thread(target=create)
    t.start()
    with d.client() as c:
        def creating() -> list[str]:
            return [s["id"] for s in c.get("/sandboxes").json()["sandboxes"]
                    if s["state"] == "creating"]
        wait_until(lambda: bool(creating()), "a sandbox in creating")
        sid = creating()[0]
        wait_until(lambda: started(sid), "the create to get as far as the test wants")
        r = c.delete(f"/sandboxes/{sid}", timeout=30)  # (httpx raises past the bound)
        assert r.status_code in (200, 204), r.text
        t.join(60)
        assert not t.is_alive()
        assert _state(c, sid) in ("killed", "error")
    return sid, result


def test_delete_cancels_a_create_stuck_in_runsc(hang_daemon: tuple[Daemon, Path]) -> None:
    d, hang = hang_daemon
    (hang / "restore").touch()
    (hang / "run").touch()
    _, result = _delete_while_creating(d)
    assert "r" not in result or result["r"].status_code >= 400


def _runsc_of(home: Path, sid: str) -> list[int]:
    """The runsc sandbox and gofer processes of sandbox ``sid`` (their argv names its
    bundle)."""
    bundle = str(home / "sandboxes" / sid / "bundle").encode()
    return [pid for pid, argv in runsc_processes()
            if argv[0] in (b"runsc-sandbox", b"runsc-gofer")
            and (bundle in argv or b"--bundle=" + bundle in argv)]


def test_delete_of_a_create_whose_runsc_started_its_sandbox(
        hang_daemon: tuple[Daemon, Path]) -> None:
    """runsc restore killed half-way (a DELETE cancels the create) after it had started the
    sandbox and gofer (sessions of their own, which killing runsc's process group misses)
    and before it wrote the container's state (so runsc delete cannot find them): the
    daemon ends them; nothing of the sandbox runs on."""
    d, hang = hang_daemon
    (hang / "restore-midway").touch()
    sid, _ = _delete_while_creating(d, lambda sid: bool(_runsc_of(d.home, sid)))
    wait_until(lambda: not _runsc_of(d.home, sid), "the sandbox's runsc processes to end", 30)
    assert sid not in d.runsc_containers()
    # nor its cgroups (runsc delete, which knew no such container, did not remove them)
    wait_until(lambda: not glob.glob(f"/sys/fs/cgroup/*/cpuos/{sid}"),
               "the sandbox's cgroups to be removed", 30)


def test_deadlines_kept_while_one_kill_is_stuck(hang_daemon: tuple[Daemon, Path]) -> None:
    d, hang = hang_daemon
    with d.client() as c:
        a = c.post("/sandboxes", json={"template": "python", "timeout": "10m"}).json()["id"]
        (hang / a).touch()  # runsc delete of a hangs
        assert c.post(f"/sandboxes/{a}/timeout", json={"timeout": 1}).status_code == 200
        wait_until(lambda: _state(c, a) == "killing", "the stuck kill to begin")
        b = c.post("/sandboxes", json={"template": "python", "timeout": 2}).json()["id"]
        wait_until(lambda: _state(c, b) == "killed", "b's deadline while a's kill hangs")
        assert _state(c, a) == "killing"
        # a DELETE of the stuck one returns too, and the kill ends with a reason
        r = c.delete(f"/sandboxes/{a}", timeout=60)
        assert r.status_code in (200, 204), r.text
        os.unlink(hang / a)
        wait_until(lambda: _state(c, a) in ("killed", "error"), "a's kill to give up", 90)
        wait_until(lambda: a not in d.runsc_containers(), "a's runsc container to go", 90)
