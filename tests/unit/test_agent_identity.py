"""The agent's ``identity`` handling (apply_identity): what it applies, what it refuses.
The system calls are replaced: the test must not rename this host or set its clock."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from cpuos_agent import identity as A

MID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {"urandom": b""}
    monkeypatch.setattr(socket, "sethostname", lambda n: seen.__setitem__("hostname", n))
    monkeypatch.setattr(time, "clock_settime",
                        lambda clk, t: seen.__setitem__("clock", (clk, t)))
    monkeypatch.setattr(A, "MACHINE_ID_PATH", str(tmp_path / "machine-id"))
    real_open = os.open

    def fake_open(path: str, flags: int, *a: Any) -> int:
        if path == "/dev/urandom":  # a file stands in for it; the ioctls then fail
            return real_open(str(tmp_path / "urandom"), os.O_WRONLY | os.O_CREAT, 0o600)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", fake_open)
    seen["urandom_path"] = tmp_path / "urandom"
    return seen


def test_identity_is_applied(calls: dict[str, Any]) -> None:
    seed = bytes(range(64))
    applied = A.apply_identity({"t": "identity", "hostname": "sbx-abc123", "machine_id": MID,
                                "seed": seed.hex(), "time": time.time() + 3600})
    assert applied == ["hostname", "machine-id", "rng", "clock"]  # no rng-reseed: not a tty
    assert calls["hostname"] == "sbx-abc123"
    assert Path(A.MACHINE_ID_PATH).read_text() == MID + "\n"
    assert calls["urandom_path"].read_bytes() == seed
    assert abs(calls["clock"][1] - (time.time() + 3600)) < 5
    # the same again: nothing left to change but the randomness
    applied = A.apply_identity({"hostname": os.uname().nodename, "machine_id": MID,
                                "seed": seed.hex(), "time": time.time()})
    assert applied == ["rng"]


@pytest.mark.parametrize("bad", [
    {"hostname": "../etc"}, {"hostname": "UPPER"}, {"hostname": "a" * 64},
    {"hostname": 7}, {"machine_id": "xyz"}, {"machine_id": MID + "00"},
    {"seed": "00"}, {"seed": "zz" * 32}, {"seed": "00" * 300}, {"time": "now"},
])
def test_malformed_identity_is_ignored(calls: dict[str, Any], bad: dict[str, Any]) -> None:
    assert A.apply_identity({"t": "identity", **bad}) == []
    assert "hostname" not in calls and "clock" not in calls
    assert not Path(A.MACHINE_ID_PATH).exists()
