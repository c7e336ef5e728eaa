"""cpuos: disposable, isolated Linux sandboxes for AI agents.

    from cpuos import Sandbox
    sbx = Sandbox.create(template="python", timeout="15m")
    sbx.files.write("/work/main.py", code)
    run = sbx.exec("python /work/main.py", timeout="2m", on_stdout=print)

Each name below is imported when first used (PEP 562): ``import cpuos`` alone, or a module
of it such as ``cpuos._errors`` (the daemon's table of error codes), does not load httpx and
the client (~0.1 s of CPU).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# the public names, by the module that defines them (tests/unit/test_sdk_exports.py keeps
# this and the imports for type checkers below in step)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "._async.browser": ("AsyncBrowser",),
    "._async.sandbox": ("AsyncFiles", "AsyncNetwork", "AsyncSandbox"),
    "._async.commands": ("AsyncCommandHandle", "AsyncCommands"),
    "._async.pty": ("AsyncPty", "AsyncTerminal"),
    "._async.templates": ("AsyncTemplates",),
    "._async.workspace": ("AsyncWorkspace",),
    "._durations": ("parse_duration",),
    "._errors": (
        "AuthError", "Conflict", "CpuosError", "InvalidArgument", "LimitExceeded", "NoSpace",
        "NotFound", "PermissionDenied", "ServerError", "Timeout", "Unavailable",
    ),
    "._models": (
        "ApiKeyInfo", "CommandInfo", "ExecResult", "FileEvent", "FileEntry", "SandboxInfo",
        "TemplateInfo",
    ),
    "._sync.commands": ("CommandHandle", "Commands"),
    "._sync.pty": ("Pty", "Terminal"),
    "._sync.browser": ("Browser",),
    "._sync.sandbox": ("Files", "Sandbox", "SandboxNetwork"),
    "._sync.templates": ("Templates",),
    "._sync.workspace": ("Workspace",),
    "._async.interp": ("AsyncInterpreter",),
    "._code": ("CodeError", "CodeResult", "Result"),
    "._sync.interp": ("Interpreter",),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # (the same names, as X as X: re-exported for type checkers)
    from ._async.browser import AsyncBrowser as AsyncBrowser
    from ._async.sandbox import (
        AsyncFiles as AsyncFiles,
        AsyncNetwork as AsyncNetwork,
        AsyncSandbox as AsyncSandbox,
    )
    from ._async.commands import (
        AsyncCommandHandle as AsyncCommandHandle,
        AsyncCommands as AsyncCommands,
    )
    from ._async.pty import (
        AsyncPty as AsyncPty,
        AsyncTerminal as AsyncTerminal,
    )
    from ._async.templates import AsyncTemplates as AsyncTemplates
    from ._async.workspace import AsyncWorkspace as AsyncWorkspace
    from ._durations import parse_duration as parse_duration
    from ._errors import (
        AuthError as AuthError,
        Conflict as Conflict,
        CpuosError as CpuosError,
        InvalidArgument as InvalidArgument,
        LimitExceeded as LimitExceeded,
        NoSpace as NoSpace,
        NotFound as NotFound,
        PermissionDenied as PermissionDenied,
        ServerError as ServerError,
        Timeout as Timeout,
        Unavailable as Unavailable,
    )
    from ._models import (
        ApiKeyInfo as ApiKeyInfo,
        CommandInfo as CommandInfo,
        ExecResult as ExecResult,
        FileEvent as FileEvent,
        FileEntry as FileEntry,
        SandboxInfo as SandboxInfo,
        TemplateInfo as TemplateInfo,
    )
    from ._sync.commands import (
        CommandHandle as CommandHandle,
        Commands as Commands,
    )
    from ._sync.pty import (
        Pty as Pty,
        Terminal as Terminal,
    )
    from ._sync.browser import Browser as Browser
    from ._sync.sandbox import (
        Files as Files,
        Sandbox as Sandbox,
        SandboxNetwork as SandboxNetwork,
    )
    from ._sync.templates import Templates as Templates
    from ._sync.workspace import Workspace as Workspace
    from ._async.interp import AsyncInterpreter as AsyncInterpreter
    from ._code import (
        CodeError as CodeError,
        CodeResult as CodeResult,
        Result as Result,
    )
    from ._sync.interp import Interpreter as Interpreter

def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'cpuos' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value  # (the next lookup finds it without this function)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
