"""The lifecycle as data: the state table itself, and every (state, operation) pair through
the Manager — an operation the state does not accept answers 409 with the current state
and touches nothing; one it accepts gets past the check. (A fake backend: this is the
API-layer logic only; the transitions themselves run for real in tests/e2e.)"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from psycopg.adapt import PyFormat, Transformer

from cpuosd.backends.base import Backend
from cpuosd.config import Config, SandboxConfig
from cpuosd.errors import ApiError
from cpuosd.events import EventBus, SandboxEvent
from cpuosd.lifecycle import states
from cpuosd.lifecycle.manager import Manager
from cpuosd.lifecycle.states import State
from cpuosd.store import LIVE_STATES, RowSpec, SandboxRow, SqliteStore
from support.fakes import FakeBackend


def test_the_table_is_closed_and_every_live_state_can_end() -> None:
    assert set(states.TRANSITIONS) == set(states.STATES)
    for frm, tos in states.TRANSITIONS.items():
        assert tos <= set(states.STATES), frm
        assert frm not in tos, f"{frm} -> itself is no transition"
    assert states.TRANSITIONS[State.KILLED] == frozenset()
    for s in states.LIVE:  # DELETE works everywhere: each live state reaches the end
        seen, todo = {s}, [s]
        while todo:
            for nxt in states.TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert "killed" in seen, s
    assert set(states.LIVE) == set(LIVE_STATES)  # the store and the table agree
    assert set(states.OPS["delete"]) == set(states.STATES)
    with pytest.raises(states.InvalidTransition):
        states.check_transition("killed", "running")


def test_a_state_is_its_string_on_the_wire_and_in_the_store(tmp_path: Path) -> None:
    """State is a StrEnum: equal to (and hashed as) the strings the API, the events and the
    database always carried, so nothing outside the daemon sees a difference."""
    assert list(State) == ["creating", "pooled", "running", "pausing", "paused", "resuming",
                           "killing", "killed", "error"]
    wire: str = "running"
    assert State.RUNNING == wire and wire in {State.RUNNING} and State(wire) is State.RUNNING
    assert json.dumps({"state": State.PAUSED}) == '{"state": "paused"}'
    assert f"{State.KILLED}" == "killed"
    store = SqliteStore(tmp_path / "cpuos.db")
    try:
        row0 = SandboxRow(id="sbx-000000000001", workspace_id=store.create_workspace("w"),
                          template="python", backend="fake", state=State.PAUSED, reason=None,
                          created_at=1.0, started_at=None, ended_at=None, deadline=None,
                          spec=RowSpec(), metadata={})
        store.insert_sandbox(row0)
        assert store.transition(row0.id, (State.PAUSED,), State.RESUMING)
        with sqlite3.connect(tmp_path / "cpuos.db") as db:  # the text it always was
            assert db.execute("SELECT state, typeof(state) FROM sandboxes").fetchall() == [
                ("resuming", "text")]
        row = store.get_sandbox(row0.id)
        assert row is not None and type(row.state) is State and row.state is State.RESUMING
    finally:
        store.close()
    # psycopg dumps an Enum by its name, but a StrEnum as the string it is
    dumper = Transformer().get_dumper(State.RUNNING, PyFormat.AUTO)
    assert bytes(dumper.dump(State.RUNNING) or b"") == b"running"


@pytest.mark.parametrize("state", states.STATES)
def test_every_state_and_operation(tmp_path: Path, state: str) -> None:
    async def main() -> None:
        # the fake has no agent
        cfg = Config(home=tmp_path, sandbox=SandboxConfig(agent_connect_timeout=0.2))
        store = SqliteStore(cfg.db_path)
        fake = FakeBackend(checkpoint=True)
        backend: Backend = fake  # the fake must be a Backend (mypy checks tests/)
        events = EventBus()
        seen: list[SandboxEvent] = []
        events.subscribe(seen.append)
        mgr = Manager(cfg, store, backend, events)
        ws = store.create_workspace("w")
        info: dict[str, Any] = {"rootfs": "/nonexistent", "digest": "d"}
        row = mgr._new_row(ws, "python", info, 60, {}, {}, 2, 2048)
        store.update_sandbox(row.id, state=state)
        ops: dict[str, Any] = {
            "exec": lambda: mgr.running(ws, row.id, "exec"),
            "files": lambda: mgr.running(ws, row.id, "files"),
            "pause": lambda: mgr.snapshots.pause(ws, row.id),
            "resume": lambda: mgr.snapshots.resume(ws, row.id),
            "fork": lambda: mgr.snapshots.fork(ws, row.id, 1),
            "set_timeout": lambda: mgr.set_timeout(ws, row.id, 30),
        }
        for op, call in ops.items():
            before = list(fake.calls)
            try:
                r = call()
                if asyncio.iscoroutine(r):
                    await r
            except ApiError as e:
                accepted = state in states.OPS[op]
                if state == "pooled":  # a pooled sandbox is nobody's: not found
                    assert e.code == "not_found", (op, e)
                    continue
                if not accepted:
                    assert e.code == "conflict", (op, e)
                    assert e.details["state"] == state and e.details["operation"] == op
                    assert fake.calls == before, f"{op} touched the backend in {state}"
                    current = store.get_sandbox(row.id)
                    assert current is not None and current.state == state
                else:  # accepted: it got past the check (and failed later on the fake)
                    assert e.details.get("operation") != op or "attached" in e.message, e
                continue
            except Exception:
                assert state in states.OPS[op], f"{op} in {state} went past the check"
                continue
            assert state in states.OPS[op], f"{op} succeeded in {state}"
        # DELETE returns in every state, and ends what is live
        await asyncio.wait_for(mgr.kill(row.id), 30)
        end = store.get_sandbox(row.id)
        assert end is not None
        assert end.state == (state if state in states.ENDED else "killed")
        if state not in states.ENDED:
            want = ["killed"] if state == "killing" else ["killing", "killed"]
            assert [e.kind for e in seen[-len(want):]] == want
            assert all(e.sandbox == row.id and e.workspace == ws for e in seen)
        store.close()

    asyncio.run(main())
