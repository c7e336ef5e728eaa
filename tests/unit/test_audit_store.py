"""The audit store's hash chain, bounds and retention, and the trace sink's wire (a fake
Sentry on the real socket); the end-to-end tests are tests/e2e/test_audit.py."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cpuosd.accounting import audit as audit_mod
from cpuosd.accounting import trace
from cpuosd.accounting.audit import AuditLog, verify_file
from cpuosd.config import Config, ConfigError
from cpuosd.events import EventBus, SandboxEvent
from support.daemon import wait_until

pb: Any = trace.pb


@pytest.fixture
def log(tmp_path: Path) -> Iterator[AuditLog]:
    a = AuditLog(tmp_path / "audit.db", tmp_path / "audit.key", tmp_path / "audit.head")
    yield a
    a.close()


def fill(a: AuditLog, n: int, sandbox: str = "sbx-a") -> None:
    for i in range(n):
        a.record(sandbox, "command", {"argv": ["echo", str(i)]}, workspace="ws-1")
    assert a.flush()


def sql(tmp_path: Path, stmt: str, *args: Any) -> None:
    db = sqlite3.connect(tmp_path / "audit.db")
    with db:
        db.execute(stmt, args)
    db.close()


def test_chain_verifies_and_rows_read_back(log: AuditLog, tmp_path: Path) -> None:
    fill(log, 50)
    out = log.verify()
    assert out["ok"] and out["rows"] == 50 and out["head"]["seq"] == 50
    rows = log.query("sbx-a", ("command",), after=10, limit=5)
    assert [r["seq"] for r in rows] == [11, 12, 13, 14, 15]
    assert rows[0]["detail"] == {"argv": ["echo", "10"]}
    assert rows[1]["prev_hash"] == rows[0]["hash"]
    assert verify_file(tmp_path)["ok"]


def test_the_head_is_rewritten_in_place_and_made_anew_if_replaced(log: AuditLog,
                                                                  tmp_path: Path) -> None:
    """audit.head is one file rewritten after each batch (not a new file each time); if
    its path comes to name another file, the next batch writes a whole head there."""
    head = tmp_path / "audit.head"
    fill(log, 5)
    ino = head.stat().st_ino
    fill(log, 5)
    assert head.stat().st_ino == ino
    assert json.loads(head.read_text()) == log.verify()["head"] and log.verify()["ok"]
    stale = tmp_path / "stale"
    stale.write_text(json.dumps({"seq": 99, "hash": "0" * 64}))
    stale.replace(head)
    assert not log.verify()["ok"]  # (the head says seq 99: rows 11..99 look deleted)
    fill(log, 1)
    assert json.loads(head.read_text())["seq"] == 11 and log.verify()["ok"]
    assert verify_file(tmp_path)["ok"]


def test_an_edited_row_is_found(log: AuditLog, tmp_path: Path) -> None:
    fill(log, 20)
    sql(tmp_path, "UPDATE audit SET detail=? WHERE seq=7", json.dumps({"argv": ["innocent"]}))
    out = log.verify()
    assert not out["ok"]
    assert [p["seq"] for p in out["problems"]] == [7]
    assert out["problems"][0]["sandbox"] == "sbx-a"
    assert not verify_file(tmp_path)["ok"]


def test_a_rehashed_edit_is_found_without_the_key(log: AuditLog, tmp_path: Path) -> None:
    """Whoever edits the database cannot recompute the chain: hashes are HMACs."""
    import hashlib

    fill(log, 5)
    db = sqlite3.connect(tmp_path / "audit.db")
    row = db.execute("SELECT * FROM audit WHERE seq=5").fetchone()
    fake = hashlib.sha256(b"forged").hexdigest()
    with db:
        db.execute("UPDATE audit SET detail='{}', hash=? WHERE seq=5", (fake,))
    db.close()
    assert row is not None
    out = log.verify()
    assert not out["ok"] and out["problems"][0]["seq"] == 5


def test_deleted_rows_are_found_in_the_middle_and_at_the_end(log: AuditLog,
                                                             tmp_path: Path) -> None:
    fill(log, 30)
    sql(tmp_path, "DELETE FROM audit WHERE seq=12")
    problems = log.verify()["problems"]
    assert any("12..12 are missing" in p["problem"] for p in problems)
    sql(tmp_path, "INSERT INTO audit SELECT 12, time, workspace, sandbox, kind, detail, "
        "prev_hash, hash FROM audit WHERE seq=11")  # put back a copy of another row
    assert not log.verify()["ok"]
    sql(tmp_path, "DELETE FROM audit WHERE seq >= 12")  # ... then cut the tail
    out = log.verify()
    assert not out["ok"]
    assert any("the newest" in p["problem"] for p in out["problems"])


def test_retention_prunes_the_front_and_the_chain_still_verifies(log: AuditLog,
                                                                 tmp_path: Path) -> None:
    for i in range(10):
        log.record("sbx-a", "lifecycle", {"i": i}, workspace="ws-1", t=1000.0 + i)
    fill(log, 5)
    assert log.prune(1005.5) == 6
    out = log.verify()
    assert out["ok"] and out["rows"] == 9, out
    sql(tmp_path, "UPDATE audit_anchor SET seq=seq+1")  # claiming more was pruned
    assert not log.verify()["ok"]


def test_a_full_queue_drops_and_counts(log: AuditLog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_mod, "MAX_PENDING_PER_SANDBOX", 100)
    with log._dblock:  # the writer blocks on its next write
        kept = sum(log.record("sbx-flood", "command", {"i": i}) for i in range(1000))
        assert log.record("sbx-other", "command", {"i": 0})  # others are not starved
    assert log.flush(owed=True)
    assert kept <= 100 + audit_mod.BATCH  # (the writer may hold one batch of them)
    rows = log.query("sbx-flood", limit=10000)
    dropped = [r for r in rows if r["kind"] == "dropped"]
    assert sum(r["detail"]["count"] for r in dropped) == 1000 - kept
    assert len(rows) - len(dropped) == kept
    assert log.verify()["ok"]


def test_events_become_rows(log: AuditLog) -> None:
    log.on_event(SandboxEvent("running", "sbx-e", "ws-1", "creating", fields={"reason": None}))
    log.on_event(SandboxEvent("network", "sbx-e", "ws-1", "running", fields={"network": {
        "mode": "allowlist", "secrets": {"TOKEN": {"placeholder": "x", "value": "s3cret"}}}}))
    log.on_event(SandboxEvent("pooled", "sbx-p", "", "creating"))
    assert log.flush()
    rows = log.query("sbx-e")
    assert [r["kind"] for r in rows] == ["lifecycle", "lifecycle"]
    assert rows[0]["detail"]["to"] == "running" and rows[0]["workspace"] == "ws-1"
    assert "s3cret" not in json.dumps(rows)
    assert log.query("sbx-p") == []


def test_settling_the_bus_waits_for_the_audit_writer(log: AuditLog,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """EventBus.settle (a node handing a sandbox to the shared store) returns once the
    audit's writer has written what it was given, and says False when it did not in time."""
    bus = EventBus()
    remove = bus.subscribe(log.on_event, settle=log.flush)
    held, write = threading.Event(), log._write

    def slow_write(batch: list[audit_mod.Pending]) -> None:
        held.wait(30)
        write(batch)

    monkeypatch.setattr(log, "_write", slow_write)
    bus.emit(SandboxEvent("paused", "sbx-s", "ws-1", "pausing", fields={"reason": "requested"}))
    assert asyncio.run(bus.settle(0.2)) is False  # (the writer is held)
    held.set()
    assert asyncio.run(bus.settle()) is True
    db = sqlite3.connect(log.db_path)
    try:  # (in the database itself, not through a reader that flushes first)
        got = db.execute("SELECT kind, detail FROM audit WHERE sandbox = 'sbx-s'").fetchall()
    finally:
        db.close()
    assert [(k, json.loads(d)["to"]) for k, d in got] == [("lifecycle", "paused")]
    remove()
    held.clear()
    bus.emit(SandboxEvent("running", "sbx-s", "ws-1", "paused"))
    assert asyncio.run(bus.settle(0.2)) is True  # (no settler left)
    held.set()


def test_a_failed_write_is_tried_again_and_loses_nothing(
        log: AuditLog, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database that fails a write (Postgres restarting, a lock timeout): the rows are
    written once it answers again, once each and in order; a flush waits for them."""
    monkeypatch.setattr(audit_mod, "RETRY_FIRST", 0.01)
    failures, write = [2], log._write

    def flaky(batch: list[audit_mod.Pending]) -> None:
        if failures[0]:
            failures[0] -= 1
            raise OSError("the database is restarting")
        write(batch)

    monkeypatch.setattr(log, "_write", flaky)
    for i in range(5):
        log.record("sbx-f", "command", {"argv": ["echo", str(i)]}, workspace="ws-1")
    assert log.flush()
    assert failures == [0]
    rows = log.query("sbx-f")
    assert [r["detail"]["argv"][1] for r in rows] == ["0", "1", "2", "3", "4"]
    assert log.verify()["ok"]


def test_closing_with_a_database_that_fails_ends(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """close() is bounded whatever the database does: what cannot be written is lost, said."""
    monkeypatch.setattr(audit_mod, "RETRY_FIRST", 0.01)
    a = AuditLog(tmp_path / "audit.db", tmp_path / "audit.key")

    def broken(batch: list[audit_mod.Pending]) -> None:
        raise OSError("gone")

    monkeypatch.setattr(a, "_write", broken)
    a.record("sbx-c", "lifecycle", {"to": "killed"}, workspace="ws-1")
    assert not a.flush(timeout=0.3)
    monkeypatch.setattr(audit_mod.AuditLog, "flush",
                        lambda self, timeout=10.0, owed=False: False)  # (close's own wait)
    a.close()
    assert not a._thread.is_alive()


def test_long_details_are_cut() -> None:
    text = audit_mod.encode_detail({"argv": ["x" * 100_000] * 1000})
    assert len(text) <= audit_mod.MAX_DETAIL


# ---- the trace sink ----------------------------------------------------------------------
def sentry(path: Path) -> socket.socket:
    """What runsc does: connect, handshake (cpuosd.accounting.trace.Sink answers)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(path))
    s.send(pb.Handshake(version=1).SerializeToString())
    assert pb.Handshake.FromString(s.recv(1024)).version >= 1
    return s


def message(mtype: int, msg: Any, dropped: int = 0) -> bytes:
    body: bytes = msg.SerializeToString()
    return struct.pack("<HHI", 8, mtype, dropped) + body


def execve(argv: list[str], pid: int = 5) -> Any:
    return pb.ExecveInfo(argv=argv, binary_path="/usr/bin/" + argv[0], env=["SECRET=x"],
                         context_data=pb.ContextData(thread_group_id=pid, cwd="/work"))


def opened(path: str, flags: int, result: int = 3, fd_path: str = "") -> Any:
    return pb.Open(pathname=path, flags=flags, fd=-100, fd_path=fd_path,
                   exit=pb.Exit(result=result),
                   context_data=pb.ContextData(thread_group_id=7, cwd="/work/sub"))


def test_sink_records_execs_and_writes(log: AuditLog, tmp_path: Path) -> None:
    sink = trace.Sink("sbx-t", tmp_path / "trace.sock", log)
    try:
        s = sentry(tmp_path / "trace.sock")
        s.send(message(trace.MSG_EXEC, execve(["id", "-u"])))
        s.send(message(trace.MSG_OPEN, opened("out.txt", 0o1101)))  # O_WRONLY|O_CREAT|O_TRUNC
        s.send(message(trace.MSG_OPEN, opened("/etc/passwd", 0)))  # a read: not kept
        s.send(message(trace.MSG_OPEN, opened("/work/no", 0o1, result=-13)))  # failed
        s.send(message(trace.MSG_OPEN, opened("/dev/null", 0o1)))  # a device: not kept
        s.send(b"\x08\x00")  # malformed: counted
        s.send(message(trace.MSG_EXEC, execve(["true"]), dropped=3))  # the Sentry lost 3
        s.close()
        wait_until(lambda: log.flush() and len(log.query("sbx-t")) >= 5, "trace rows")
    finally:
        sink.close()
    assert log.flush()
    rows = log.query("sbx-t")
    cmds = [r["detail"] for r in rows if r["kind"] == "command"]
    assert [c["argv"] for c in cmds] == [["id", "-u"], ["true"]]
    assert cmds[0]["env"] == ["SECRET"] and cmds[0]["pid"] == 5  # names, not values
    writes = [r["detail"] for r in rows if r["kind"] == "file_write"]
    assert [(w["path"], w["flags"]) for w in writes] == [
        ("/work/sub/out.txt", ["O_WRONLY", "O_CREAT", "O_TRUNC"])]
    dropped = sorted(r["detail"]["count"] for r in rows if r["kind"] == "dropped")
    assert dropped == [1, 3]
    assert sink.connections == 1


def test_sink_bounds_a_flood(log: AuditLog, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of messages: the reader reads at most RATE a second, so the socket's buffer
    fills and the sender (like the Sentry) drops and counts the rest, which the next message
    that gets through reports; every message is then a row or counted in a dropped row."""
    monkeypatch.setattr(trace, "BURST", 50.0)
    monkeypatch.setattr(trace, "RATE", 500.0)
    sink = trace.Sink("sbx-f", tmp_path / "trace.sock", log)
    try:
        s = sentry(tmp_path / "trace.sock")
        s.setblocking(False)
        lost = 0
        for i in range(3000):
            try:
                s.send(message(trace.MSG_EXEC, execve(["true", str(i)]), dropped=lost))
            except BlockingIOError:
                lost += 1
        assert lost > 0  # the flood outran the reader
        s.setblocking(True)
        s.send(message(trace.MSG_EXEC, execve(["true", "last"]), dropped=lost))
        s.close()

        def accounted() -> bool:
            log.flush()
            rows = log.query("sbx-f", limit=10000)
            kept = sum(r["kind"] == "command" for r in rows)
            counted = sum(r["detail"]["count"] for r in rows if r["kind"] == "dropped")
            return bool(kept + counted == 3001)

        wait_until(accounted, "every message kept or counted as dropped")
    finally:
        sink.close(wait=5)
    rows = log.query("sbx-f", limit=10000)
    cmds = [r for r in rows if r["kind"] == "command"]
    assert cmds[-1]["detail"]["argv"] == ["true", "last"] and len(cmds) < 3000
    assert sum(r["kind"] == "dropped" for r in rows) <= 10  # one a second at most


def test_a_busy_sandbox_s_points_wait_until_it_quiets_or_the_audit_is_read(
        log: AuditLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox sending much (here: any message counts as much) is read at most every
    READ_EVERY and its messages kept unparsed (parsing them while it works slows it); an
    audit query (AuditLog.catch_up: Traced.drain) parses them first; and once the sandbox
    quiets down (the next look finds nothing) they are parsed without one."""
    monkeypatch.setattr(trace, "BUSY_BYTES", 1)
    monkeypatch.setattr(trace, "READ_EVERY", 3600.0)  # (no next look in this test's time)
    monkeypatch.setattr(trace, "DEFER_MAX", 3600.0)

    def batch(*argvs: list[str]) -> bytes:
        recs = [message(trace.MSG_EXEC, execve(a)) for a in argvs]
        return struct.pack("<HHI", 8, trace.MSG_BATCH, 0) + b"".join(
            struct.pack("<I", len(r)) + r for r in recs)

    def argvs(sid: str) -> list[list[str]]:
        return [r["detail"]["argv"] for r in log.query(sid) if r["kind"] == "command"]

    sink = trace.Sink("sbx-d", tmp_path / "trace.sock", log)

    def drain(timeout: float) -> bool:
        return trace.hub().call_wait(sink.drain, timeout)

    try:
        s = sentry(tmp_path / "trace.sock")
        s.send(batch(["make", "1"], ["make", "2"]))
        wait_until(lambda: sink.wakeups >= 1, "the batch read")
        assert log.flush() and argvs("sbx-d") == [] and sink.messages == 0  # kept, unparsed
        log.drain = drain
        assert log.catch_up()
        assert argvs("sbx-d") == [["make", "1"], ["make", "2"]]  # the query parsed it first
    finally:
        sink.close(wait=5)
    # a session that ends (the sandbox paused or killed) parses what it kept, and what the
    # socket still held, first
    sink = trace.Sink("sbx-k", tmp_path / "trace3.sock", log)
    try:
        s = sentry(tmp_path / "trace3.sock")
        s.send(batch(["make", "4"]))
        wait_until(lambda: sink.wakeups >= 1, "the batch read")
        s.send(batch(["make", "5"]))
        s.close()  # (the Sentry gone: the last read meets the socket's end)
    finally:
        sink.close(wait=5)
    assert log.flush() and argvs("sbx-k") == [["make", "4"], ["make", "5"]]
    assert sink._done.is_set()  # the session ended whole: its listener closed
    # busy, then quiet: READ_EVERY later the sink looks again, finds nothing, parses the rest
    monkeypatch.setattr(trace, "READ_EVERY", 0.05)
    sink = trace.Sink("sbx-e", tmp_path / "trace2.sock", log)
    try:
        s = sentry(tmp_path / "trace2.sock")
        s.send(batch(["make", "3"]))
        wait_until(lambda: log.flush() and argvs("sbx-e") == [["make", "3"]],
                   "parsed once quiet")
        assert sink.wakeups >= 2  # (the read that kept it, the look that found nothing)
    finally:
        sink.close(wait=5)


def test_a_few_points_in_quick_succession_are_parsed_at_once(
        log: AuditLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two small batches within BUSY_GAP (a command starting another) are not a busy
    sandbox: each is parsed as it comes, with no audit query and no later look (so a
    command's runtime rows come before the API's row, written when it ends)."""
    monkeypatch.setattr(trace, "READ_EVERY", 3600.0)  # (a deferred batch: never parsed here)
    monkeypatch.setattr(trace, "DEFER_MAX", 3600.0)
    sink = trace.Sink("sbx-q", tmp_path / "trace.sock", log)

    def rows() -> list[list[str]]:
        log.flush()
        return [r["detail"]["argv"] for r in log.query("sbx-q") if r["kind"] == "command"]

    try:
        s = sentry(tmp_path / "trace.sock")
        s.send(message(trace.MSG_EXEC, execve(["sh", "-c", "x"])))
        wait_until(lambda: rows() == [["sh", "-c", "x"]], "the first parsed")
        s.send(message(trace.MSG_EXEC, execve(["x"])))  # (well within BUSY_GAP of the first)
        wait_until(lambda: rows() == [["sh", "-c", "x"], ["x"]], "the second parsed", 10)
    finally:
        sink.close(wait=5)


def test_session_config_names_the_socket(tmp_path: Path) -> None:
    cfg = trace.session_config(tmp_path / "trace.sock")
    sess = cfg["trace_session"]
    assert sess["name"] == "Default"
    assert sess["sinks"][0]["config"]["endpoint"] == str(tmp_path / "trace.sock")
    assert {p["name"] for p in sess["points"]} >= {"sentry/execve", "syscall/openat/exit"}


# ---- bounds on growth (issue 25, finding 6) ----------------------------------------------
def bounded(tmp_path: Path, **kw: Any) -> AuditLog:
    limits = audit_mod.Limits(**{"coalesce": 0.0, **kw})
    return AuditLog(tmp_path / "audit.db", tmp_path / "audit.key", tmp_path / "audit.head",
                    limits=limits)


def test_repeats_are_one_row_then_one_with_a_count(tmp_path: Path) -> None:
    """A runtime write repeated, preview connections from one peer, refused attempts: the
    first is a row at once, the repeats one row with their count when the window ends;
    API rows and allowed connections are never coalesced."""
    a = bounded(tmp_path, coalesce=60.0)
    try:
        w = {"source": "runtime", "op": "open", "path": "/tmp/x", "flags": ["O_WRONLY"],
             "uid": 1000}
        for i in range(1000):
            assert a.record("sbx-c", "file_write", {**w, "pid": i, "time_ns": i},
                            workspace="ws-1")
        a.record("sbx-c", "file_write", {**w, "count": 50}, workspace="ws-1")  # from the Sentry
        for _ in range(300):
            a.on_event(SandboxEvent("port", "sbx-c", "ws-1", None,
                                    fields={"port": 3000, "action": "connect",
                                            "peer": "203.0.113.9"}))
        for _ in range(3):
            a.record("sbx-c", "command", {"source": "api", "argv": ["true"]}, workspace="ws-1")
            a.record("sbx-c", "connection", {"dst": "1.2.3.4", "port": 443,
                                             "verdict": "allowed"}, workspace="ws-1")
        assert a.flush()
        before = a.query("sbx-c", limit=10000)
        assert [r["kind"] for r in before] == ["file_write", "port", *["command",
                                                                        "connection"] * 3]
        assert a.pending_repeats() == 2
        assert a.flush(owed=True)
        rows = a.query("sbx-c", limit=10000)
        repeats = {r["kind"]: r["detail"] for r in rows[len(before):]}
        assert repeats["file_write"]["count"] == 999 + 50
        assert repeats["port"]["count"] == 299 and repeats["port"]["peer"] == "203.0.113.9"
        assert a.verify()["ok"]
    finally:
        a.close()


def test_the_coalescing_key_ignores_only_what_varies_between_repeats() -> None:
    """Two points are the same row but for their times, pids, fds and counts; any other
    field (a path, a flag, the process) makes them two; a detail with a nested value (a
    connection's policy, a list of lists) still has a key, equal for equal details."""
    key = audit_mod.coalesce_key
    w = {"source": "runtime", "op": "open", "path": "/tmp/x", "flags": ["O_WRONLY"],
         "uid": 1000, "process": "sh"}
    k = key("sbx-c", "file_write", {**w, "pid": 1, "ppid": 0, "fd": 3, "time_ns": 1})
    assert k is not None and hash(k) is not None
    assert key("sbx-c", "file_write", {**w, "pid": 9, "ppid": 8, "fd": 7, "time_ns": 2,
                                       "count": 40}) == k
    for change in ({"path": "/tmp/y"}, {"flags": ["O_WRONLY", "O_CREAT"]},
                   {"process": "bash"}, {"uid": 0}):
        assert key("sbx-c", "file_write", {**w, **change}) != k, change
    assert key("sbx-d", "file_write", w) != k
    nested = {"source": "runtime", "argv": [["a"], ["b"]], "opts": {"x": [1]}}
    kn = key("sbx-c", "command", nested)
    assert kn is not None and kn == key("sbx-c", "command", {**nested, "pid": 5})
    assert kn != key("sbx-c", "command", {**nested, "opts": {"x": [2]}})
    assert key("sbx-c", "command", {"source": "api", "argv": ["true"]}) is None


def test_a_repeat_past_its_window_before_the_row_is_made_keeps_the_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeat that comes after its window ended but before the writer made the row of the
    repeats counted so far joins them (it used to start a new window and their count was
    lost): every repeat is accounted for."""
    clock = [1000.0]
    monkeypatch.setattr("cpuosd.accounting.audit.time.monotonic", lambda: clock[0])
    a = bounded(tmp_path, coalesce=5.0)
    try:
        w = {"source": "runtime", "op": "open", "path": "/tmp/x", "uid": 1000}
        for _ in range(10):
            assert a.record("sbx-w", "file_write", w, workspace="ws-1")
        clock[0] += 5.5  # the window ended; the writer has not looked yet
        for _ in range(10):
            assert a.record("sbx-w", "file_write", w, workspace="ws-1")
        assert a.flush(owed=True)
        rows = a.query("sbx-w", limit=100)
        assert sum(int(r["detail"].get("count") or 1) for r in rows) == 20, rows
        assert len(rows) == 2
    finally:
        a.close()


def test_windows_end_in_the_order_they_started(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer makes a repeats' row when its window ends, one window at a time in the
    order they started (it looks only at the oldest), and a row whose window ended without
    repeats starts a new window when it comes again."""
    clock = [1000.0]
    monkeypatch.setattr("cpuosd.accounting.audit.time.monotonic", lambda: clock[0])
    a = bounded(tmp_path, coalesce=5.0)

    def w(path: str) -> dict[str, Any]:
        return {"source": "runtime", "op": "open", "path": path, "uid": 1000}

    def counts() -> dict[str, int]:
        return {r["detail"]["path"]: r["detail"]["count"]
                for r in a.query("sbx-o", limit=100) if "count" in r["detail"]}
    try:
        for _ in range(3):
            a.record("sbx-o", "file_write", w("/a"), workspace="ws-1")
        a.record("sbx-o", "file_write", w("/c"), workspace="ws-1")
        clock[0] += 2
        for _ in range(4):
            a.record("sbx-o", "file_write", w("/b"), workspace="ws-1")
        clock[0] += 3.5  # /a's and /c's windows ended, not /b's
        wait_until(lambda: counts() == {"/a": 2}, "the row of /a's repeats", timeout=10)
        assert a.pending_repeats() == 1
        a.record("sbx-o", "file_write", w("/c"), workspace="ws-1")  # a new window: a row
        a.record("sbx-o", "file_write", w("/c"), workspace="ws-1")  # ... and a repeat
        clock[0] += 2  # /b's ended
        wait_until(lambda: counts() == {"/a": 2, "/b": 3}, "the row of /b's", timeout=10)
        assert a.pending_repeats() == 1  # /c's second window
        assert a.flush(owed=True)
        assert counts() == {"/a": 2, "/b": 3, "/c": 1}
        assert len(a.query("sbx-o", limit=100)) == 7 and a.verify()["ok"]
    finally:
        a.close()


def test_row_budgets_per_sandbox_and_workspace(tmp_path: Path) -> None:
    """Past its budget a sandbox's rows are counted, by kind and directory, in one dropped
    row; the workspace's budget holds its sandboxes together; lifecycle rows always go."""
    a = bounded(tmp_path, sandbox_rows=100, workspace_rows=150)
    try:
        for i in range(400):
            a.record("sbx-1", "file_write", {"source": "runtime", "path": f"/work/a/{i}"},
                     workspace="ws-b")
        for i in range(400):
            a.record("sbx-2", "command", {"source": "api", "argv": [str(i)]}, workspace="ws-b")
        a.record("sbx-2", "lifecycle", {"to": "killed"}, workspace="ws-b")
        a.record("sbx-3", "command", {"argv": ["x"]}, workspace="ws-other")
        assert a.flush(owed=True)
        one, two = a.query("sbx-1", limit=1000), a.query("sbx-2", limit=1000)
        assert sum(r["kind"] == "file_write" for r in one) == 100
        d1 = [r["detail"] for r in one if r["kind"] == "dropped"]
        assert len(d1) == 1 and d1[0]["count"] == 300
        assert d1[0]["kinds"] == {"file_write": 300} and d1[0]["directories"] == {
            "/work/a": 300}
        assert "sandbox's row budget" in d1[0]["source"]
        assert sum(r["kind"] == "command" for r in two) == 50  # 150 for the workspace
        d2 = [r["detail"] for r in two if r["kind"] == "dropped"]
        assert d2[0]["count"] == 350 and "workspace's row budget" in d2[0]["source"]
        assert any(r["kind"] == "lifecycle" for r in two)
        assert len(a.query("sbx-3")) == 1
        assert a.held_total == 650 and a.verify()["ok"]
    finally:
        a.close()


def test_low_disk_space_holds_back_all_but_lifecycle(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    free = [10 << 30]

    class Usage:
        def __init__(self) -> None:
            self.free = free[0]

    monkeypatch.setattr("cpuosd.accounting.audit.shutil.disk_usage", lambda _p: Usage())
    monkeypatch.setattr(audit_mod, "SPACE_CHECK", 0.0)
    a = bounded(tmp_path, min_free=1 << 30)
    try:
        a.record("sbx-d", "command", {"argv": ["before"]}, workspace="ws-1")
        assert a.flush()
        free[0] = 100 << 20
        wait_until(lambda: a._low_space, "the writer to see the disk almost full", 10)
        assert not a.record("sbx-d", "command", {"argv": ["while full"]}, workspace="ws-1")
        assert a.record("sbx-d", "lifecycle", {"to": "paused"}, workspace="ws-1")
        free[0] = 10 << 30
        wait_until(lambda: not a._low_space, "the writer to see space again", 10)
        assert a.flush(owed=True)
        kinds = [(r["kind"], r["detail"].get("argv"), r["detail"].get("source"))
                 for r in a.query("sbx-d")]
        assert ("command", ["while full"], None) not in kinds
        assert ("lifecycle", None, None) in kinds
        assert any(k == "dropped" and "disk" in str(s) for k, _, s in kinds)
    finally:
        a.close()


def test_limits_from_the_environment() -> None:
    cfg = Config.from_env({}).audit
    lim = audit_mod.Limits.of(cfg)
    assert (lim.sandbox_rows, lim.workspace_rows, lim.min_free) == (20_000, 200_000, 1 << 30)
    assert cfg.retention == 30 * 86400
    cfg = Config.from_env({"CPUOS_AUDIT_RETENTION": "forever", "CPUOS_AUDIT_SANDBOX_ROWS": "0",
                           "CPUOS_AUDIT_MIN_FREE": "2GiB"}).audit
    assert cfg.retention is None
    lim = audit_mod.Limits.of(cfg)
    assert lim.sandbox_rows is None and lim.min_free == 2 << 30
    with pytest.raises(ConfigError, match="CPUOS_AUDIT_WORKSPACE_ROWS"):
        Config.from_env({"CPUOS_AUDIT_WORKSPACE_ROWS": "lots"})


# ---- cpuos's points (runsc patch level 2) --------------------------------------------------
def fs_point(sysno: int, path: str, other: str = "", flags: int = 0, uid: int = 1000) -> Any:
    return pb.Open(sysno=sysno, fd=-100, fd_path=path, pathname=other, flags=flags,
                   exit=pb.Exit(result=0),
                   context_data=pb.ContextData(thread_group_id=9, credentials=pb.Credentials(
                       real_uid=uid, effective_uid=uid)))


def test_decode_of_cpuos_points() -> None:
    def dec(m: Any, count: int = 1) -> Any:
        got = trace.decode(trace.MSG_OPEN, m.SerializeToString(), count)
        return got and (got[0], {k: v for k, v in got[1].items()
                                 if k not in ("pid", "ppid", "uid", "euid", "time_ns")})

    assert dec(fs_point(82, "/work/b", "/work/a")) == (
        "file_write", {"source": "runtime", "op": "rename", "path": "/work/b", "from": "/work/a"})
    assert dec(fs_point(316, "/work/b", "/work/a", flags=2))[1]["exchange"] is True
    assert dec(fs_point(263, "/work/d", flags=0x200))[1]["op"] == "rmdir"
    assert dec(fs_point(88, "/work/l", "/etc/shadow"))[1]["target"] == "/etc/shadow"
    assert dec(fs_point(265, "/work/l", "/work/f"), count=7)[1]["count"] == 7
    # the agent's own exec cgroups are not the user's doing
    assert dec(fs_point(83, "/run/cpuos-exec/x5", uid=0)) is None
    assert dec(fs_point(83, "/run/cpuos-exec/x5", uid=1000)) is not None
    # an open: the Sentry's resolved path, and how the process named it
    o = pb.Open(sysno=257, fd=5, fd_path="/work/real.txt", pathname="/proc/self/fd/3",
                flags=0o1, exit=pb.Exit(result=4), context_data=pb.ContextData())
    d = dec(o)[1]
    assert (d["op"], d["path"], d["name"]) == ("open", "/work/real.txt", "/proc/self/fd/3")


def test_sink_reads_the_count_in_the_longer_header(log: AuditLog, tmp_path: Path) -> None:
    sink = trace.Sink("sbx-n", tmp_path / "trace.sock", log)
    try:
        s = sentry(tmp_path / "trace.sock")
        body = execve(["true"]).SerializeToString()
        s.send(struct.pack("<HHII", 12, trace.MSG_EXEC, 0, 41) + body)
        s.close()
        wait_until(lambda: log.flush() and len(log.query("sbx-n")) >= 1, "the row")
    finally:
        sink.close()
    assert log.query("sbx-n")[0]["detail"]["count"] == 41


def test_session_config_with_and_without_cpuos_points(tmp_path: Path) -> None:
    new = trace.session_config(tmp_path / "t.sock")["trace_session"]
    names = {p["name"] for p in new["points"]}
    assert {"syscall/openat2/exit", "syscall/renameat2/exit", "syscall/unlinkat/exit",
            "syscall/truncate/exit", "syscall/linkat/exit"} <= names
    assert new["sinks"][0]["config"]["cpuos_coalesce"] == trace.COALESCE
    opens = [p for p in new["points"] if p["name"] == "syscall/openat/exit"]
    assert opens[0]["optional_fields"] == ["cpuos_writes"]
    assert all("cwd" not in p["context_fields"] for p in new["points"]
               if p["name"] != "sentry/execve")
    old = trace.session_config(tmp_path / "t.sock", cpuos_points=False)["trace_session"]
    assert {p["name"] for p in old["points"]} == {"sentry/execve", "syscall/open/exit",
                                                  "syscall/openat/exit", "syscall/creat/exit"}
    assert "cpuos_coalesce" not in old["sinks"][0]["config"]


def test_a_flood_from_outside_does_not_use_up_the_budget_of_what_runs_inside(
        tmp_path: Path) -> None:
    """Connections to a public preview port from many peers (anyone can make them) hit the
    network rows' budget, never the one of the commands and file writes inside."""
    a = bounded(tmp_path, sandbox_rows=100, workspace_rows=1000)
    try:
        for i in range(500):
            a.on_event(SandboxEvent("port", "sbx-p", "ws-p", None, fields={
                "port": 80, "action": "connect", "peer": f"198.51.100.{i % 250}.{i}"}))
        for i in range(50):
            assert a.record("sbx-p", "file_write", {"source": "runtime", "path": f"/w/{i}"},
                            workspace="ws-p")
        assert a.flush(owed=True)
        rows = a.query("sbx-p", limit=10000)
        assert sum(r["kind"] == "port" for r in rows) == 100
        assert sum(r["kind"] == "file_write" for r in rows) == 50
        dropped = [r["detail"] for r in rows if r["kind"] == "dropped"]
        assert [d["kinds"] for d in dropped] == [{"port": 400}]
    finally:
        a.close()


def test_sink_reads_batches_of_records(log: AuditLog, tmp_path: Path) -> None:
    """cpuos's sink sends batches: one message of records (u32 length, header, point); the
    Sentry's drop count may come slightly out of order inside one: only a rise counts."""
    sink = trace.Sink("sbx-b", tmp_path / "trace.sock", log)
    try:
        s = sentry(tmp_path / "trace.sock")
        recs = [message(trace.MSG_EXEC, execve(["echo", str(i)]), dropped=d)
                for i, d in enumerate((0, 2, 1, 2))]
        repeat = execve(["true"]).SerializeToString()
        recs.append(struct.pack("<HHII", 12, trace.MSG_EXEC, 2, 9) + repeat)
        body = b"".join(struct.pack("<I", len(r)) + r for r in recs)
        s.send(struct.pack("<HHI", 8, trace.MSG_BATCH, 3) + body)
        s.send(struct.pack("<HHI", 8, trace.MSG_BATCH, 3) + struct.pack("<I", 999) + b"x")
        s.close()
        wait_until(lambda: log.flush() and len(log.query("sbx-b")) >= 6, "the rows")
    finally:
        sink.close(wait=5)
    rows = log.query("sbx-b")
    cmds = [r["detail"] for r in rows if r["kind"] == "command"]
    assert [c["argv"] for c in cmds] == [["echo", "0"], ["echo", "1"], ["echo", "2"],
                                         ["echo", "3"], ["true"]]
    assert cmds[-1]["count"] == 9 and sink.points == 13
    dropped = sorted((r["detail"]["source"], r["detail"]["count"]) for r in rows
                     if r["kind"] == "dropped")
    assert dropped == [("gVisor's sink (the socket's buffer was full)", 3),
                       ("malformed or too large", 1)]
