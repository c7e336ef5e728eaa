"""Which runsc the daemon runs, on which platform (cpuosd.backends.runsc)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from cpuosd.backends import runsc as R

REPO = Path(__file__).resolve().parents[2]

NEW_FLAGS = ("  -platform string\n    \tspecifies which platform to use: systrap (default), "
             "ptrace, kvm. (default \"systrap\")\n"
             "  -gofer-network-namespace value\n")
OLD_FLAGS = "  -platform string\n    \tspecifies which platform to use: ptrace (default), kvm\n"


def fake_runsc(path: Path, version: str, flags: str) -> Path:
    restore = "  -background\n" if "gofer-network" in flags else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n"
                    f"if [ \"$1\" = --version ]; then echo 'runsc version {version}'; "
                    "echo 'spec: 1.0.2'; exit 0; fi\n"
                    f"if [ \"$1\" = flags ]; then printf '%s' '{flags}'; exit 0; fi\n"
                    f"if [ \"$1\" = help ]; then printf '%s' '{restore}'; exit 0; fi\nexit 1\n")
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("CPUOS_RUNSC", "CPUOS_RUNSC_PLATFORM"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))


def test_pinned_version_is_the_one_the_build_script_builds() -> None:
    gomod = (REPO / "deps" / "runsc" / "go.mod").read_text()
    m = re.search(r"gvisor\.dev/gvisor (v\S+)", gomod)
    assert m is not None and m.group(1) == R.MODULE_VERSION
    script = (REPO / "scripts" / "build-runsc.sh").read_text()
    level = re.search(r"^patch_level=(\d+)$", script, re.M)
    assert level is not None and int(level.group(1)) == R.PATCH_LEVEL
    assert R.PINNED_VERSION == f"{R.MODULE_VERSION}+cpuos.{R.PATCH_LEVEL}"
    assert R.pinned_path(Path("/p")) == Path(f"/p/runsc-{R.PINNED_VERSION}/runsc")


def test_pinned_build_wins_over_path_on_systrap(tmp_path: Path) -> None:
    prefix = tmp_path / "lib"
    fake_runsc(R.pinned_path(prefix), R.PINNED_VERSION, NEW_FLAGS)
    fake_runsc(tmp_path / "bin" / "runsc", "release-20221219.0", OLD_FLAGS)
    r = R.find_runsc(prefix)
    assert (r.path, r.version, r.platform, r.source) == (
        str(R.pinned_path(prefix)), R.PINNED_VERSION, "systrap", "pinned")
    assert not r.is_fallback
    assert r.platforms == ("systrap", "ptrace", "kvm")
    assert r.gofer_flags() == ["--gofer-network-namespace=new"]
    assert r.background_restore
    assert r.overlay_inodes  # the patched build


def test_debian_fallback_warns_and_uses_ptrace(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    deb = fake_runsc(tmp_path / "bin" / "runsc", "release-20221219.0", OLD_FLAGS)
    with caplog.at_level(logging.WARNING, logger="cpuosd.runsc"):
        r = R.find_runsc(tmp_path / "lib")
    assert (r.path, r.platform, r.source) == (str(deb), "ptrace", "path")
    assert r.is_fallback
    assert r.gofer_flags() == [] and not r.background_restore  # not in Debian's 2022 build
    assert not r.overlay_inodes
    assert "not the pinned build" in caplog.text


def test_operator_choice_and_unknown_platform(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    other = fake_runsc(tmp_path / "x" / "runsc", "v1", NEW_FLAGS)
    fake_runsc(R.pinned_path(tmp_path / "lib"), R.PINNED_VERSION, NEW_FLAGS)
    monkeypatch.setenv("CPUOS_RUNSC", str(other))
    monkeypatch.setenv("CPUOS_RUNSC_PLATFORM", "ptrace")
    r = R.find_runsc(tmp_path / "lib")
    assert (r.path, r.platform, r.source) == (str(other), "ptrace", "env")
    monkeypatch.setenv("CPUOS_RUNSC_PLATFORM", "bogus")
    with pytest.raises(R.RunscUnavailable, match="no platform 'bogus'"):
        R.find_runsc(tmp_path / "lib")
    monkeypatch.setenv("CPUOS_RUNSC", str(tmp_path / "missing"))
    with pytest.raises(R.RunscUnavailable, match="not an executable"):
        R.find_runsc(tmp_path / "lib")


def test_nothing_installed_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(R.RunscUnavailable, match=r"build-runsc\.sh"):
        R.find_runsc(tmp_path / "lib")
