"""CPUOS_BACKEND selection (gvisor | microvm | auto) with the KVM boot probe monkeypatched,
and the microVM backend's side of the Backend contract. No daemon, no root, no guest."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from cpuosd.backends.base import Backend, SandboxSpec
from cpuosd.backends.gvisor import GVisorBackend
from cpuosd.backends.microvm import probe, selection
from cpuosd.backends.microvm.jailer import JailError
from cpuosd.backends.microvm.backend import MicroVMBackend
from cpuosd.config import Config
from cpuosd.errors import ApiError


def _cfg(tmp_path: Path, backend: str) -> Config:
    return Config(home=tmp_path / "home", backend=backend)


@pytest.fixture
def probe_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.delenv("CPUOS_MICROVM_DIR", raising=False)
    return []


def _fake_probe(calls: list[dict[str, Any]], ok: bool, reason: str) -> Any:
    def fake(timeout: float = 5.0, **kw: Any) -> tuple[bool, str]:
        calls.append({"timeout": timeout, **kw})
        return ok, reason

    return fake


def test_auto_picks_microvm_when_the_probe_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_calls: list[dict[str, Any]],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(probe, "kvm_boot_probe",
                        _fake_probe(probe_calls, True, "guest booted in 0.30s"))
    cfg = _cfg(tmp_path, "auto")
    with caplog.at_level(logging.INFO, logger="cpuosd.backend"):
        b = selection.select_backend(cfg)
    assert isinstance(b, MicroVMBackend)
    assert b.capabilities.name == "microvm"
    assert len(probe_calls) == 1  # once, with its timeout
    assert probe_calls[0]["timeout"] == selection.PROBE_TIMEOUT
    assert probe_calls[0]["cache"] == cfg.home / "microvm"
    assert "backend: microvm" in caplog.text and "guest booted in 0.30s" in caplog.text


def test_auto_falls_back_to_gvisor_when_the_probe_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_calls: list[dict[str, Any]],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(probe, "kvm_boot_probe",
                        _fake_probe(probe_calls, False, "/dev/kvm cannot be opened: nope"))
    cfg = _cfg(tmp_path, "auto")
    with caplog.at_level(logging.INFO, logger="cpuosd.backend"):
        b = selection.select_backend(cfg)
    assert isinstance(b, GVisorBackend)
    assert b.capabilities.name == "gvisor"
    assert len(probe_calls) == 1
    assert "backend: gvisor" in caplog.text and "/dev/kvm cannot be opened" in caplog.text
    assert not (cfg.home / "microvm").exists()  # nothing made for the backend not chosen


def test_default_is_auto() -> None:
    assert Config().backend == "auto"
    assert Config.from_env({}).backend == "auto"
    assert Config.from_env({"CPUOS_BACKEND": "microvm"}).backend == "microvm"


def test_forced_microvm_on_a_failing_host_refuses_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        probe_calls: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(probe, "kvm_boot_probe", _fake_probe(
        probe_calls, False, "guest did not reach the probe marker within 5s\nserial: x"))
    with pytest.raises(selection.BackendUnavailable) as ei:
        selection.select_backend(_cfg(tmp_path, "microvm"))
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("CPUOS_BACKEND=microvm, but the KVM boot probe failed")
    assert "did not reach the probe marker" in msg


def test_forced_microvm_on_a_passing_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        probe_calls: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(probe, "kvm_boot_probe", _fake_probe(probe_calls, True, "ok"))
    assert isinstance(selection.select_backend(_cfg(tmp_path, "microvm")), MicroVMBackend)


def test_forced_gvisor_never_probes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        probe_calls: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(probe, "kvm_boot_probe", _fake_probe(probe_calls, True, "ok"))
    assert isinstance(selection.select_backend(_cfg(tmp_path, " GVisor ")), GVisorBackend)
    assert probe_calls == []


def test_unknown_choice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(selection.BackendUnavailable, match="not one of gvisor, microvm, auto"):
        selection.select_backend(_cfg(tmp_path, "firecracker"))


def test_a_crashing_probe_counts_as_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        probe_calls: list[dict[str, Any]]) -> None:
    def boom(*a: Any, **kw: Any) -> tuple[bool, str]:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(probe, "kvm_boot_probe", boom)
    assert isinstance(selection.select_backend(_cfg(tmp_path, "auto")), GVisorBackend)
    with pytest.raises(selection.BackendUnavailable, match="the probe itself failed"):
        selection.select_backend(_cfg(tmp_path, "microvm"))


def test_the_real_probe_fails_fast_without_artifacts(tmp_path: Path,
                                                     probe_calls: list[dict[str, Any]]) -> None:
    ok, reason, art = selection.run_probe(_cfg(tmp_path, "auto"), timeout=5)
    assert not ok and art is None
    assert reason  # /dev/kvm, QEMU or the artifacts: whichever is missing first


# ---- the microVM backend's side of the Backend contract ----------------------------------------

def test_microvm_backend_satisfies_the_contract(tmp_path: Path) -> None:
    b: Backend = MicroVMBackend(tmp_path / "home")  # (selection.py is where mypy checks it)
    assert b.capabilities.name == "microvm"
    assert b.capabilities.checkpoint is True
    spec = SandboxSpec(id="sbx-x", rootfs=tmp_path, dir=tmp_path / "s", agent_dir=tmp_path)

    async def body() -> None:
        with pytest.raises(ApiError) as ei:
            await b.checkpoint("sbx-x", tmp_path / "img")
        assert ei.value.code == "not_found"
        with pytest.raises(ApiError) as ei:  # no image there: a clear error, nothing started
            await b.restore(spec, tmp_path / "img")
        assert ei.value.code == "internal" and "unreadable" in ei.value.message
        with pytest.raises(JailError):  # never a path out of the jail base
            await b.restore(dataclasses.replace(spec, id="../x"), tmp_path / "img")
        assert await b.running() == {}
        await b.close()

    asyncio.run(body())
    assert b.memory_usage("sbx-nonexistent") is None
