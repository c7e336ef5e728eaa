"""``cpuos mcp`` without the optional mcp package: one line saying so, exit 1."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from cpuos.cli.main import app


def test_mcp_without_the_sdk_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "cpuos.mcp_server", raising=False)
    monkeypatch.setitem(sys.modules, "mcp.server.lowlevel", None)  # import fails
    r = CliRunner().invoke(app, ["mcp"])
    assert r.exit_code == 1
    out = r.output.strip()
    assert out.startswith("error: unavailable:") and "cpuos[mcp]" in out and "\n" not in out
