"""Files through the real daemon and agent: write and read (streamed both ways), list,
stat, mkdir, remove, directories as tar, and watching a directory for changes."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from cpuos import FileEvent, InvalidArgument, NotFound, Sandbox
from support.daemon import wait_until
from support.local import LocalDaemon

pytestmark = pytest.mark.component


def _dir(sbx: Sandbox, local: LocalDaemon, name: str) -> str:
    d = str(local.work / f"{sbx.id}-{name}")
    sbx.files.mkdir(d)
    return d


def test_write_read_list_stat_remove(sbx: Sandbox, local: LocalDaemon) -> None:
    d = _dir(sbx, local, "files")
    sbx.files.write(f"{d}/a.txt", "hello\n")
    data = os.urandom(9 << 20)  # several chunks each way
    entry = sbx.files.write(f"{d}/b.bin", data)
    assert entry.size == len(data)
    assert sbx.files.read_text(f"{d}/a.txt") == "hello\n"
    assert hashlib.sha256(sbx.files.read(f"{d}/b.bin")).digest() == \
        hashlib.sha256(data).digest()
    assert sbx.exec(f"cat {d}/a.txt").stdout == "hello\n"  # the same file the commands see
    names = {e.name: e for e in sbx.files.list(d)}
    assert set(names) == {"a.txt", "b.bin"} and names["b.bin"].size == len(data), names
    assert sbx.files.stat(f"{d}/a.txt").size == 6
    sbx.files.remove(f"{d}/a.txt")
    assert not sbx.files.exists(f"{d}/a.txt")
    with pytest.raises(NotFound):
        sbx.files.read(f"{d}/a.txt")


def test_directories_as_tar(sbx: Sandbox, local: LocalDaemon, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "one.txt").write_text("1")
    (src / "sub" / "two.txt").write_text("22")
    d = _dir(sbx, local, "tar")
    got = sbx.files.upload_dir(src, f"{d}/up")
    assert got["files"] == 2, got
    assert sbx.exec(f"cat {d}/up/sub/two.txt").stdout == "22"
    back = tmp_path / "back"
    sbx.files.download_dir(f"{d}/up", back)
    assert (back / "one.txt").read_text() == "1" and (back / "sub" / "two.txt").read_text() \
        == "22"


def test_watch_sees_changes(sbx: Sandbox, local: LocalDaemon) -> None:
    d = _dir(sbx, local, "watch")
    events: list[FileEvent] = []
    lock = threading.Lock()

    def on_event(e: FileEvent) -> None:
        with lock:
            events.append(e)

    def seen(kind: str, path: str) -> bool:
        with lock:
            return any(e.type == kind and e.path == path for e in events)

    h = sbx.files.watch(d, on_event)
    try:
        sbx.exec(f"mkdir {d}/sub && echo x > {d}/sub/new.txt && echo y > {d}/f")
        wait_until(lambda: seen("create", f"{d}/sub/new.txt") and seen("create", f"{d}/f"),
                   "create events, in a new subdirectory too", 10)
        sbx.exec(f"mv {d}/f {d}/g && rm {d}/sub/new.txt")
        wait_until(lambda: seen("rename", f"{d}/g") and seen("delete", f"{d}/sub/new.txt"),
                   "rename and delete events", 10)
    finally:
        h.stop()
    assert h.error is None, h.error


def test_file_path_rules(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument):
        sbx.files.read("/work/../etc/passwd")
    with pytest.raises(InvalidArgument):
        sbx.files.remove("/")
    with pytest.raises(InvalidArgument):
        sbx.files.watch("/tmp/../etc", lambda e: None)
    with pytest.raises(NotFound):
        sbx.files.watch("/no-such-dir-here", lambda e: None)


def test_read_limits_and_missing_paths(sbx: Sandbox, local: LocalDaemon) -> None:
    d = _dir(sbx, local, "limits")
    sbx.files.write(f"{d}/hundred", b"x" * 100)
    with pytest.raises(InvalidArgument) as e:
        sbx.files.read(f"{d}/hundred", max_bytes=10)
    assert e.value.code == "too_large", e.value
    assert sbx.files.read(f"{d}/hundred", max_bytes=100) == b"x" * 100
    with pytest.raises(NotFound):
        sbx.files.list(f"{d}/nowhere")
    with pytest.raises(NotFound):
        sbx.files.stat(f"{d}/nowhere")
