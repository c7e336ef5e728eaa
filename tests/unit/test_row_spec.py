"""The stored sandbox spec (store.base.RowSpec): what it writes is what the dict-based code
wrote, byte for byte, and a row written by older code (fewer keys) or newer code (keys this
version does not know) loads and is written back without loss."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import FrozenInstanceError, replace
from pathlib import Path
from typing import Any

import pytest

from cpuosd.api.sandboxes import sandbox_json
from cpuosd.config import Config
from cpuosd.lifecycle.common import _base_env
from cpuosd.lifecycle.manager import Manager
from cpuosd.store import RowSpec, SqliteStore
from support.fakes import FakeBackend

# a spec as the dict-based daemon wrote it (Manager._new_row, then _boot's agent key, an
# exposed port, the E2B facts, wake_on_request): every key, in the order it wrote them
OLD_SPEC: dict[str, Any] = {
    "rootfs": "/var/lib/cpuos/templates/python-0123456789abcdef/rootfs",
    "template_digest": "0123456789abcdef", "vcpus": 2, "memory_mib": 512, "pids": 1024,
    "disk_mib": 4096, "hostname": "sandbox", "env": {"A": "1"}, "timeout": 300.0,
    "machine_id": "ab" * 16, "template_env": {"LANG": "C.UTF-8"}, "workdir": None,
    "network": {"mode": "on", "allow": []}, "idle_timeout": 0.0, "agent_key": "cd" * 32,
    "ports": {"8080": {"token": "t", "created_at": 1.0, "public": False}},
    "e2b": {"alias": "x", "public": False}, "wake_on_request": False,
}


def test_the_old_shape_round_trips_byte_for_byte() -> None:
    text = json.dumps(OLD_SPEC)
    spec = RowSpec.from_json(json.loads(text))
    assert json.dumps(spec.to_json()) == text
    assert (spec.vcpus, spec.memory_mib, spec.agent_key, spec.wake_on_request) == (
        2, 512, "cd" * 32, False)
    assert spec.extra == {}
    # before a late key is set it is not written (as the dict never had it)
    early = {k: v for k, v in OLD_SPEC.items()
             if k not in ("agent_key", "ports", "e2b", "wake_on_request")}
    assert json.dumps(RowSpec.from_json(early).to_json()) == json.dumps(early)
    with pytest.raises(FrozenInstanceError):
        spec.vcpus = 4  # type: ignore[misc]
    assert replace(spec, vcpus=4).vcpus == 4 and spec.vcpus == 2


def _insert_raw(db: Path, ws: str, sid: str, spec_text: str) -> None:
    """A row as an older daemon left it: the spec column's text as it wrote it."""
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO sandboxes (id, workspace_id, template, backend, state, reason, "
                  "created_at, started_at, ended_at, deadline, spec, metadata, on_timeout) "
                  "VALUES (?, ?, 'python', 'gvisor', 'paused', NULL, 1.0, 1.0, NULL, NULL, ?, "
                  "'{}', 'kill')", (sid, ws, spec_text))


def test_rows_of_older_and_newer_daemons_load(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cpuos.db")
    try:
        ws = store.create_workspace("w")
        # an early row: no digest, pids, disk, timeout, template env, workdir, network,
        # idle timeout (keys added later), nor any late key
        early = {"rootfs": "/r", "vcpus": 1, "memory_mib": 256, "hostname": "sandbox",
                 "env": {"B": "2"}, "machine_id": "ef" * 16}
        _insert_raw(tmp_path / "cpuos.db", ws, "sbx-000000000001", json.dumps(early))
        row = store.get_sandbox("sbx-000000000001")
        assert row is not None
        s = row.spec
        assert (s.rootfs, s.vcpus, s.memory_mib, s.env) == ("/r", 1, 256, {"B": "2"})
        assert (s.pids, s.disk_mib, s.timeout, s.workdir, s.network, s.agent_key) == (
            None, None, None, None, None, None)
        assert s.idle_timeout == 0.0 and s.template_env == {} and s.wake_on_request is None
        # what reads it: the API's answer and a command's environment
        j = sandbox_json(row)
        assert (j["vcpus"], j["memory_mib"], j["pids"], j["network"], j["idle_timeout"]) == (
            1, 256, None, None, 0.0)
        assert _base_env(row)["B"] == "2"
        # a newer daemon's key is kept through a change written by this one
        newer = {**OLD_SPEC, "gpu": {"count": 1}}
        _insert_raw(tmp_path / "cpuos.db", ws, "sbx-000000000002", json.dumps(newer))
        row2 = store.get_sandbox("sbx-000000000002")
        assert row2 is not None and row2.spec.extra == {"gpu": {"count": 1}}
        store.update_sandbox(row2.id, spec=replace(row2.spec, idle_timeout=30.0))
        with sqlite3.connect(tmp_path / "cpuos.db") as c:
            (text,) = c.execute("SELECT spec FROM sandboxes WHERE id=?", (row2.id,)).fetchone()
        assert text == json.dumps({**newer, "idle_timeout": 30.0})
    finally:
        store.close()


def test_a_new_row_is_written_as_the_dict_based_code_wrote_it(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = Config(home=tmp_path)
        store = SqliteStore(cfg.db_path)
        mgr = Manager(cfg, store, FakeBackend())
        ws = store.create_workspace("w")
        info: dict[str, Any] = {"rootfs": "/r", "digest": "d", "env": {"X": "y"},
                                "workdir": "/app"}
        row = mgr._new_row(ws, "python", info, 60.0, {}, {"A": "1"}, 2, 512,
                           idle_timeout=5.0)
        # the literal of Manager._new_row before the spec was a dataclass
        old = {"rootfs": info["rootfs"], "template_digest": info["digest"], "vcpus": 2,
               "memory_mib": 512, "pids": cfg.sandbox.default_pids,
               "disk_mib": cfg.sandbox.default_disk_mib,
               "hostname": "sandbox", "env": {"A": "1"},
               "timeout": 60.0, "machine_id": row.spec.machine_id,
               "template_env": info.get("env") or {}, "workdir": info.get("workdir"),
               "network": mgr.default_network, "idle_timeout": 5.0}
        with sqlite3.connect(cfg.db_path) as c:
            (text,) = c.execute("SELECT spec FROM sandboxes WHERE id=?", (row.id,)).fetchone()
        assert text == json.dumps(old)
        store.close()

    asyncio.run(main())
