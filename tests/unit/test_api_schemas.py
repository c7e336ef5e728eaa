"""The answers' schemas in /openapi.json (cpuosd.api.schemas, from which sdk/js's types are
generated) match what the routes really send."""

from __future__ import annotations

import time

from cpuosd.api.app import create_app
from cpuosd.api.sandboxes import sandbox_json
from cpuosd.api.schemas import ANSWERS, Sandbox
from cpuosd.lifecycle.exec_files import _clean_stat, _exit_frame
from cpuosd.api.schemas import ExecExitFrame, FileEntry
from cpuosd.store import RowSpec, SandboxRow


def _row(**kw: object) -> SandboxRow:
    now = time.time()
    d: dict[str, object] = dict(
        id="sbx-1", workspace_id="w", template="python", backend="gvisor", state="running",
        reason=None, created_at=now, started_at=now, ended_at=None, deadline=now + 60,
        spec=RowSpec(vcpus=2, memory_mib=512, pids=512, network={"mode": "off"}),
        metadata={"a": "b"})
    d.update(kw)
    return SandboxRow(**d)  # type: ignore[arg-type]


def test_sandbox_answer_has_exactly_the_documented_fields() -> None:
    for row in (_row(), _row(state="paused", paused_at=1.0, snapshot_bytes=5, spec=RowSpec())):
        j = sandbox_json(row)
        assert set(j) == set(Sandbox.model_fields)
        Sandbox.model_validate(j, strict=True)


def test_file_entry_and_exit_frame_match() -> None:
    e = _clean_stat({"name": "x", "type": "symlink", "size": 1, "mode": 0o644, "mtime": 1,
                     "target": "y"}, "/work/x")
    assert set(e) <= set(FileEntry.model_fields)
    FileEntry.model_validate(e, strict=True)
    x = _exit_frame({"exit_code": 137, "signal": 9, "timed_out": True}, 1.5)
    assert set(x) == set(ExecExitFrame.model_fields)
    ExecExitFrame.model_validate(x)


def test_every_documented_answer_is_a_route_and_in_the_document() -> None:
    doc = create_app().openapi()
    for (method, path), model in ANSWERS.items():
        op = doc["paths"][path][method]
        ok = [r for s, r in op["responses"].items() if s.startswith("2")]
        assert ok and all(r["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + model.__name__) for r in ok), (method, path)
        assert model.__name__ in doc["components"]["schemas"]


def test_usage_answer_matches() -> None:
    from cpuosd.accounting.usage import Meter
    from cpuosd.api.schemas import Usage
    from cpuosd.store import SqliteStore
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        store = SqliteStore(Path(d) / "db")
        meter = Meter(store)
        store.execute("INSERT INTO usage (workspace_id, sandbox_id, kind, start, end, vcpus, "
                      "memory_mib) VALUES ('w', 's', 'running', 0, 10, 2, 1024)")
        out = meter.summary("w", 0, 20)
        out["spending_cap"] = {"cap": None, "month_spent": 0.0, "reached": False}
        Usage.model_validate(out)
        assert out["total"]["vcpu_seconds"] == 20 and out["total"]["memory_gib_seconds"] == 10
        store.close()
