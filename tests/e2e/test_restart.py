"""A daemon killed with SIGKILL and restarted reconciles SQLite with what really runs."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest

from cpuos import Sandbox

pytestmark = pytest.mark.e2e


def test_sigkill_restart_reconciles(fresh_daemon) -> None:  # type: ignore[no-untyped-def]
    d = fresh_daemon
    kw = d.sdk_kwargs()
    survivor = Sandbox.create(template="python", timeout="5m", **kw)
    vanished = Sandbox.create(template="python", timeout="5m", **kw)
    unrecorded = Sandbox.create(template="python", timeout="5m", **kw)
    survivor.files.write("/work/state.txt", "before-crash")
    survivor.exec("nohup sleep 600 >/dev/null 2>&1 &")

    d.kill9()
    # While the daemon is down: one sandbox dies behind its back, and one record is lost.
    subprocess.run(["runsc", "--root", str(d.home / "runsc"), "delete", "--force", vanished.id],
                   check=True, capture_output=True)
    db = sqlite3.connect(d.home / "cpuos.db")
    db.execute("DELETE FROM sandboxes WHERE id=?", (unrecorded.id,))
    db.commit()
    db.close()
    assert unrecorded.id in d.runsc_containers()

    d.start()
    # the surviving sandbox is reattached: its files and processes are intact
    r = survivor.exec("cat /work/state.txt; pgrep -f 'sleep 600' >/dev/null && echo proc-alive")
    assert r.stdout == "before-crash" + "proc-alive\n", r
    # the one that died is marked, not left pointing at nothing
    info = vanished.info()
    assert (info.state, info.reason) == ("error", "lost")
    # no runsc sandbox is left without a record
    assert d.runsc_containers() == [survivor.id]
    assert sorted(p.name for p in (d.home / "sandboxes").iterdir()) == [survivor.id]
    survivor.kill()
    assert d.runsc_containers() == []
    for s in (survivor, vanished, unrecorded):
        s.close()
