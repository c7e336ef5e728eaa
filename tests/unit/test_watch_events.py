"""The agent's watch coalescing (cpuos_agent.watch): a file that existed, however briefly,
is reported made and then deleted; cpuos's own temporary name (an atomic write: made
beside, renamed over) never shows."""

from __future__ import annotations

import json
import os
from typing import Any

from cpuos_agent import watch as W


class Sent:
    """The conn side the watch uses to send its batches."""

    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []

    def send_data(self, sid: int, header: dict[str, Any], data: bytes) -> None:
        self.batches.append(json.loads(data))


def ev(wd: int, mask: int, name: str, cookie: int = 0) -> bytes:
    raw = os.fsencode(name) + b"\0"
    raw += b"\0" * (-len(raw) % 16)
    return W.EVENT.pack(wd, mask, cookie, len(raw)) + raw


def flushed(*records: bytes) -> list[tuple[str, str, str | None]]:
    sent = Sent()
    w = W.Watch(sent, 1, "/work/w", False, {})  # type: ignore[arg-type]
    w.wds[1] = "/work/w"
    w._events(b"".join(records))
    w._flush()
    return [(e["type"], e["path"], e.get("from")) for b in sent.batches for e in b]


def test_an_atomic_write_then_a_delete_is_a_create_and_a_delete() -> None:
    tmp = ".new.txt.cpuos-0123456789abcdef.tmp"
    got = flushed(ev(1, W.IN_CREATE, tmp), ev(1, W.IN_MODIFY, tmp),
                  ev(1, W.IN_CLOSE_WRITE, tmp), ev(1, W.IN_MOVED_FROM, tmp, cookie=7),
                  ev(1, W.IN_MOVED_TO, "new.txt", cookie=7), ev(1, W.IN_DELETE, "new.txt"))
    assert got == [("rename", "/work/w/new.txt", f"/work/w/{tmp}"),
                   ("delete", "/work/w/new.txt", None)]


def test_a_file_made_and_deleted_at_once_is_told_both_ways() -> None:
    got = flushed(ev(1, W.IN_CREATE, "f"), ev(1, W.IN_MODIFY, "f"), ev(1, W.IN_DELETE, "f"))
    assert got == [("create", "/work/w/f", None), ("delete", "/work/w/f", None)]


def test_repeated_changes_of_one_path_are_one_event() -> None:
    got = flushed(ev(1, W.IN_MODIFY, "g"), ev(1, W.IN_MODIFY, "g"),
                  ev(1, W.IN_CLOSE_WRITE, "g"))
    assert got == [("modify", "/work/w/g", None)]
