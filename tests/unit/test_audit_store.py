"""The audit store's hash chain, bounds and retention, and the trace sink's wire (a fake
Sentry on the real socket); the end-to-end tests are tests/e2e/test_audit.py."""

from __future__ import annotations

import json
import socket
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cpuosd.accounting import audit as audit_mod
from cpuosd.accounting import trace
from cpuosd.accounting.audit import AuditLog, verify_file
from cpuosd.events import SandboxEvent
from cpuosd.testing import wait_until

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


def test_session_config_names_the_socket(tmp_path: Path) -> None:
    cfg = trace.session_config(tmp_path / "trace.sock")
    sess = cfg["trace_session"]
    assert sess["name"] == "Default"
    assert sess["sinks"][0]["config"]["endpoint"] == str(tmp_path / "trace.sock")
    assert {p["name"] for p in sess["points"]} >= {"sentry/execve", "syscall/openat/exit"}
