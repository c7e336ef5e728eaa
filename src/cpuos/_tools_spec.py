"""The tools' table: names, descriptions, JSON schemas of their arguments (OpenAI and
Anthropic shapes), the check of a call's arguments, and the model-shaped result. Shared by
``cpuos.tools`` (sync and async) and the MCP server (``cpuos mcp``)."""

from __future__ import annotations

import base64
import builtins
import json
from dataclasses import dataclass, field
from typing import Any

from ._errors import InvalidArgument

SANDBOX_ID = {"type": "string", "description": "the sandbox to use (default: the one "
              "created last; one is created on first use if there is none)"}


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


# name -> (description, JSON schema of the arguments)
TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "create_sandbox": (
        "Create a new isolated Linux sandbox (Debian, Python 3 with numpy, pandas and "
        "matplotlib; a persistent Python kernel). Later tools use it by default.",
        _obj({"template": {"type": "string", "description": "template name (default "
                           "python)"},
              "timeout": {"type": "string", "description": "its lifetime, e.g. '15m' "
                          "(default 15m)"},
              "network": {"type": "string", "enum": ["off", "on", "allowlist"],
                          "description": "egress policy (default: the daemon's)"}}, [])),
    "run_code": (
        "Run Python code in the sandbox's persistent Jupyter kernel: variables, imports and "
        "the working directory persist between calls. Returns stdout, stderr, the value of "
        "the last expression, the error with its traceback, and every matplotlib figure as "
        "an image (no savefig needed).",
        _obj({"code": {"type": "string", "description": "the Python cell to run"},
              "timeout": {"type": "number", "description": "seconds before the cell is "
                          "interrupted (default 60); its state is kept"},
              "sandbox_id": SANDBOX_ID}, ["code"])),
    "exec": (
        "Run a shell command (bash) in the sandbox and wait for it. Returns exit_code, "
        "stdout and stderr.",
        _obj({"command": {"type": "string", "description": "a bash command line"},
              "timeout": {"type": "number", "description": "seconds before it is killed "
                          "(default 120)"},
              "cwd": {"type": "string", "description": "working directory (default /work)"},
              "sandbox_id": SANDBOX_ID}, ["command"])),
    "write_file": (
        "Write a text file in the sandbox (parents are created; relative paths are under "
        "/work).",
        _obj({"path": {"type": "string"}, "content": {"type": "string"},
              "sandbox_id": SANDBOX_ID}, ["path", "content"])),
    "read_file": (
        "Read a file from the sandbox: text (cut to max_chars, head and tail), or a PNG or "
        "JPEG image as an image.",
        _obj({"path": {"type": "string"},
              "max_chars": {"type": "integer", "description": "default 20000"},
              "sandbox_id": SANDBOX_ID}, ["path"])),
    "list_files": (
        "List a directory in the sandbox: name, type and size of each entry.",
        _obj({"path": {"type": "string", "description": "default /work"},
              "sandbox_id": SANDBOX_ID}, [])),
    "expose_port": (
        "Give a URL at which a server listening on a port inside the sandbox can be "
        "reached (token-protected).",
        _obj({"port": {"type": "integer", "minimum": 1, "maximum": 65535},
              "sandbox_id": SANDBOX_ID}, ["port"])),
    "screenshot": (
        "Screenshot of the sandbox's web browser (a sandbox of the 'browser' template: "
        "create_sandbox with template 'browser'), as an image; with url, load that page "
        "first.",
        _obj({"url": {"type": "string", "description": "a page to load first"},
              "full_page": {"type": "boolean", "description": "the whole page, not only "
                            "the viewport"},
              "sandbox_id": SANDBOX_ID}, [])),
    "pause": (
        "Pause the sandbox: its memory, processes and files are saved and it stops costing "
        "CPU and memory; resume continues where it was.",
        _obj({"sandbox_id": SANDBOX_ID}, [])),
    "resume": (
        "Resume a paused sandbox.",
        _obj({"sandbox_id": {"type": "string"}}, ["sandbox_id"])),
    "kill": (
        "End the sandbox and delete everything in it.",
        _obj({"sandbox_id": SANDBOX_ID}, [])),
}
TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "number": (int, float),
                                            "integer": int, "boolean": bool}
MAX_LIST = 500
IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}


def openai_tools(names: builtins.list[str] | None = None) -> builtins.list[dict[str, Any]]:
    """The tools for OpenAI's function calling (``tools=`` of chat completions)."""
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": s}}
            for n, (d, s) in TOOLS.items() if names is None or n in names]


def anthropic_tools(names: builtins.list[str] | None = None) -> builtins.list[dict[str, Any]]:
    """The tools for Anthropic's Messages API (``tools=``)."""
    return [{"name": n, "description": d, "input_schema": s}
            for n, (d, s) in TOOLS.items() if names is None or n in names]


@dataclass
class ToolResult:
    """A tool's answer shaped for a model: ``data`` (JSON-able, long text already cut),
    ``images`` (PNG/JPEG bytes, to send as image content), ``is_error``."""

    data: dict[str, Any]
    images: builtins.list[tuple[str, bytes]] = field(default_factory=list)  # (mime, bytes)
    is_error: bool = False

    @property
    def text(self) -> str:
        return json.dumps(self.data, ensure_ascii=False)

    def anthropic_content(self) -> builtins.list[dict[str, Any]]:
        """Content blocks for a ``tool_result`` (text, then each image)."""
        out: builtins.list[dict[str, Any]] = [{"type": "text", "text": self.text}]
        for mime, b in self.images:
            out.append({"type": "image", "source": {"type": "base64", "media_type": mime,
                                                    "data": base64.b64encode(b).decode()}})
        return out

    def openai_content(self) -> builtins.list[dict[str, Any]]:
        """Content parts (text, then each image as a data URL) for a message."""
        out: builtins.list[dict[str, Any]] = [{"type": "text", "text": self.text}]
        for mime, b in self.images:
            url = f"data:{mime};base64,{base64.b64encode(b).decode()}"
            out.append({"type": "image_url", "image_url": {"url": url}})
        return out


def check_arguments(name: str, arguments: Any) -> dict[str, Any]:
    """A tool call's arguments (a dict or its JSON text), checked against its schema."""
    if name not in TOOLS:
        raise InvalidArgument(f"unknown tool {name!r}; the tools: {', '.join(TOOLS)}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as e:
            raise InvalidArgument(f"{name}: arguments are not JSON: {e}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"{name}: arguments must be an object")
    schema = TOOLS[name][1]
    props = schema["properties"]
    for k in schema["required"]:
        if k not in arguments:
            raise InvalidArgument(f"{name}: missing argument {k!r}")
    for k, v in arguments.items():
        if k not in props:
            raise InvalidArgument(f"{name}: unknown argument {k!r} (known: "
                                  f"{', '.join(props)})")
        want = TYPES[props[k]["type"]]
        if not isinstance(v, want) or (isinstance(v, bool) and props[k]["type"] != "boolean"):
            raise InvalidArgument(f"{name}: {k} must be a {props[k]['type']}")
        if "enum" in props[k] and v not in props[k]["enum"]:
            raise InvalidArgument(f"{name}: {k} must be one of {props[k]['enum']}")
    return arguments
