"""examples/agent_loop.py runs against a real daemon: the scripted model's tool calls go
through cpuos.tools, and the results it is given back are model-shaped."""

from __future__ import annotations

import base64
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cpuos import Sandbox
from cpuos.tools import Tools
from support.daemon import Daemon

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_loop.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agent_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_example_agent_loop(daemon: Daemon) -> None:
    ex = _example()
    tools = Tools(timeout="5m", **daemon.sdk_kwargs())
    try:
        final, transcript = ex.run(tools, ex.ScriptedModel(ex.SCRIPT))
        sid = tools.current
    finally:
        tools.close()
    assert "mean" in final
    results: dict[str, dict[str, Any]] = {
        r["tool_use_id"]: r for m in transcript if m["role"] == "user"
        and isinstance(m["content"], list) for r in m["content"]}
    assert set(results) == {"c1", "c2", "c3", "c4", "c5"}
    data = {k: json.loads(r["content"][0]["text"]) for k, r in results.items()}
    assert data["c1"]["size"] == len("x,y\n") + sum(len(f"{i},{i * i}\n") for i in range(10))
    assert "mean" in data["c2"]["result"] and data["c2"]["error"] is None
    assert data["c3"]["result"] == "28.5" and data["c3"]["images"] == 1
    image = results["c3"]["content"][1]
    assert image["type"] == "image" and image["source"]["media_type"] == "image/png"
    assert base64.b64decode(image["source"]["data"])[:4] == b"\x89PNG"
    assert data["c4"]["exit_code"] == 0 and "11 data.csv" in data["c4"]["stdout"]
    assert results["c5"]["is_error"] and data["c5"]["error"].startswith("NameError")
    # the loop's sandbox is gone
    assert all(s.id != sid for s in Sandbox.list(**daemon.sdk_kwargs()))
