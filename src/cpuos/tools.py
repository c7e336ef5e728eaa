"""The sandbox as tools for a model: JSON schemas for OpenAI's and Anthropic's function
calling, and a dispatcher whose results are shaped for a model (long text cut to its head
and tail, figures as images). The same tools are served over MCP by ``cpuos mcp``.

    from cpuos import tools
    schemas = tools.openai()            # or tools.anthropic()
    r = tools.call("run_code", {"code": "import math; math.pi"})   # a sandbox on first use
    r.data        # {"error": None, "stdout": "", "stderr": "", "result": "3.14...", ...}
    r.images      # [("image/png", b"...")] for each figure
    tools.close() # kills the sandboxes it made

``Tools()`` / ``AsyncTools()`` hold their own sandboxes (and take ``api_url``,
``api_key``, ``template``, ``timeout``); the module-level ``call`` uses one shared
``Tools``.
"""

from __future__ import annotations

from typing import Any

from ._async.tools import AsyncTools
from ._sync.tools import Tools
from ._tools_spec import TOOLS, ToolResult, anthropic_tools, check_arguments, openai_tools

__all__ = ["TOOLS", "AsyncTools", "ToolResult", "Tools", "anthropic", "anthropic_tools",
           "call", "check_arguments", "close", "openai", "openai_tools"]

openai = openai_tools
anthropic = anthropic_tools
_default: Tools | None = None


def call(name: str, arguments: Any = None) -> ToolResult:
    """Run a tool on the shared ``Tools`` (made on first use, with the environment's
    daemon and key)."""
    global _default
    if _default is None:
        _default = Tools()
    return _default.call(name, arguments)


def close(kill: bool = True) -> None:
    """Kill (unless ``kill=False``) the shared ``Tools``' sandboxes."""
    global _default
    if _default is not None:
        _default.close(kill)
        _default = None
