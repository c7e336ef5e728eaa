"""The Python side of the shared test vectors (tests/vectors/, written by make_vectors.py;
sdk/js checks its decoder and duration parser against the same files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cpuos import _errors
from cpuos._durations import parse_duration
from cpuos_agent import protocol as P

VECTORS = Path(__file__).parent.parent / "vectors"
FRAMES = json.loads((VECTORS / "exec_frames.json").read_text())
DURATIONS = json.loads((VECTORS / "durations.json").read_text())


def _decode_all(data: bytes, step: int) -> tuple[list[tuple[P.Header, bytes]], int]:
    dec = P.FrameDecoder()
    out: list[tuple[P.Header, bytes]] = []
    for i in range(0, max(len(data), 1), step):
        out += dec.feed(data[i:i + step])
    return out, dec.pending


def test_limits_match() -> None:
    assert FRAMES["max_header"] == P.MAX_HEADER and FRAMES["max_payload"] == P.MAX_PAYLOAD


@pytest.mark.parametrize("v", FRAMES["valid"], ids=lambda v: v["name"])
def test_valid_frames(v: dict[str, Any]) -> None:
    data = bytes.fromhex(v["hex"])
    want = [(f["header"], bytes.fromhex(f["payload_hex"])) for f in v["frames"]]
    steps = {len(data) or 1, 1, 7, 4096} if len(data) < 20000 else {len(data), 4096, 65537}
    for step in steps:
        got, pending = _decode_all(data, step)
        assert got == want, step
        assert pending == v["pending"]
    if v["canonical"]:
        assert b"".join(P.encode(h, p) for h, p in want) == data


@pytest.mark.parametrize("v", FRAMES["errors"], ids=lambda v: v["name"])
def test_bad_frames_refused(v: dict[str, Any]) -> None:
    with pytest.raises(P.ProtocolError):
        P.FrameDecoder().feed(bytes.fromhex(v["hex"]))


@pytest.mark.parametrize("v", FRAMES["exec_streams"], ids=lambda v: v["name"])
def test_exec_streams(v: dict[str, Any]) -> None:
    """What the SDK's exec makes of a body: output per fd, the exit, or the error class."""
    frames, pending = _decode_all(bytes.fromhex(v["hex"]), 5)
    assert pending == 0
    out = {1: b"", 2: b""}
    exit_h: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    for h, payload in frames:
        if h["t"] == "out" and h.get("fd") in (1, 2):
            out[h["fd"]] += payload
        elif h["t"] == "exit":
            exit_h = h
        elif h["t"] == "error":
            error = h
    want = v["expect"]
    if "error" in want:
        code = error["code"] if error else "unavailable"  # no exit: the SDK's Unavailable
        exc = _errors.error_from(None, code, "x")
        assert exit_h is None and type(exc).__name__ == want["error"]["class"]
        assert exc.code == want["error"]["code"]
        return
    assert exit_h is not None and error is None
    assert exit_h["exit_code"] == want["exit_code"] and exit_h["signal"] == want["signal"]
    assert exit_h["timed_out"] == want["timed_out"]
    assert frames[0][0] == {"t": "started", "exec_id": want["exec_id"]}
    assert out[1] == bytes.fromhex(want["stdout_hex"])
    assert out[2] == bytes.fromhex(want["stderr_hex"])


@pytest.mark.parametrize("v", DURATIONS["ok"], ids=repr)
def test_durations(v: list[Any]) -> None:
    assert parse_duration(v[0]) == v[1]


@pytest.mark.parametrize("v", DURATIONS["bad"], ids=repr)
def test_bad_durations(v: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration(v)


SIZES = json.loads((VECTORS / "sizes.json").read_text())


@pytest.mark.parametrize("v", SIZES["ok"], ids=repr)
def test_sizes(v: list[Any]) -> None:
    assert P.parse_size_mib(v[0]) == v[1]


@pytest.mark.parametrize("v", SIZES["bad"], ids=repr)
def test_bad_sizes(v: Any) -> None:
    with pytest.raises(ValueError):
        P.parse_size_mib(v)
