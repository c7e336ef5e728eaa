"""The spending cap's running total (Meter.month_cost, read every second for each capped
workspace) keeps what ended and reads only what is open or ended since: it must agree with
the full summary at every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpuosd.lifecycle.states import State
from cpuosd.accounting.usage import Meter, month_start
from cpuosd.events import SandboxEvent
from cpuosd.store import RowSpec, SandboxRow, SqliteStore


def test_month_cost_agrees_with_the_summary(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db")
    meter = Meter(store)
    ws = store.create_workspace("w")
    t = month_start(1_800_000_000.0) + 3600.0

    def ev(kind: str, sid: str, at: float, **fields: object) -> None:
        meter.on_event(SandboxEvent(kind, sid, ws, None, time=at, fields=dict(fields)))

    for i in range(3):
        store.insert_sandbox(SandboxRow(
            id=f"sbx-{i:012d}", workspace_id=ws, template="python", backend="fake",
            state=State.RUNNING, reason=None, created_at=t, started_at=t, ended_at=None,
            deadline=None, spec=RowSpec(vcpus=2, memory_mib=2048),
            metadata={}))
    # an interval from last month still open: only this month's part counts
    ev("running", "sbx-000000000000", t - 7200)
    steps = [("running", "sbx-000000000001", 10.0), ("paused", "sbx-000000000000", 20.0),
             ("running", "sbx-000000000002", 30.0), ("killed", "sbx-000000000001", 45.0),
             ("resuming", "sbx-000000000000", 60.0), ("running", "sbx-000000000000", 61.0),
             ("killed", "sbx-000000000002", 90.0)]
    for kind, sid, dt in steps:
        ev(kind, sid, t + dt, snapshot_bytes=1 << 30)
        for probe in (0.5, 3.0):
            now = t + dt + probe
            want = meter.summary(ws, month_start(now), now)["total"]["cost"]
            assert meter.month_cost(ws, now) == pytest.approx(want, rel=1e-6, abs=1e-9)
    store.close()
