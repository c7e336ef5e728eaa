"""File watching: inotify inside the sandbox, coalesced, bounded; the file API's path
rules."""

from __future__ import annotations

import threading

import pytest

from cpuos import FileEvent, InvalidArgument, NotFound, Sandbox
from support.daemon import wait_until

pytestmark = pytest.mark.e2e


def test_watch_1000_files_final_state(sbx: Sandbox) -> None:
    sbx.exec("mkdir -p /work/w")
    events: list[FileEvent] = []
    lock = threading.Lock()

    def on_event(e: FileEvent) -> None:
        with lock:
            events.append(e)

    h = sbx.files.watch("/work/w", on_event)
    try:
        r = sbx.exec("for i in $(seq 1000); do echo $i > /work/w/f$i; done; "
                     "mkdir -p /work/w/sub/deep && echo x > /work/w/sub/deep/new.txt")
        assert r.ok, r
        want = {f"/work/w/f{i}" for i in range(1, 1001)} | {"/work/w/sub/deep/new.txt"}

        def present() -> set[str]:
            with lock:
                state: dict[str, str] = {}
                for e in events:
                    state[e.path] = e.type
                    if e.type == "rename" and e.from_path:
                        state[e.from_path] = "delete"
                overflow = any(e.type == "overflow" for e in events)
            assert not overflow, "events were lost (overflow)"
            return {p for p, t in state.items() if t in ("create", "modify", "rename")}

        wait_until(lambda: want <= present(), "an event for each of the 1000 files")
        sbx.exec("mv /work/w/f1 /work/w/g1; rm /work/w/f2; echo more >> /work/w/f3")
        wait_until(lambda: "/work/w/g1" in present() and "/work/w/f1" not in present()
                   and "/work/w/f2" not in present(), "rename and delete")
        with lock:
            ren = [e for e in events if e.type == "rename"]
        assert ren and ren[-1].from_path == "/work/w/f1" and ren[-1].path == "/work/w/g1"
    finally:
        h.stop()
    assert h.error is None, h.error


def test_watch_path_rules(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument):
        sbx.files.watch("/work/../etc", lambda e: None)
    with pytest.raises(NotFound):
        sbx.files.watch("/work/no-such-dir", lambda e: None)
    # outside /work: the same rules as reading a file there (allowed where readable)
    seen: list[FileEvent] = []
    h = sbx.files.watch("/tmp", seen.append, recursive=False)
    sbx.exec("touch /tmp/watched")
    wait_until(lambda: any(e.path == "/tmp/watched" for e in seen), "an event in /tmp")
    h.stop()
