"""cpuos: disposable, isolated Linux sandboxes for AI agents.

    from cpuos import Sandbox
    sbx = Sandbox.create(template="python", timeout="15m")
    sbx.files.write("/work/main.py", code)
    run = sbx.exec("python /work/main.py", timeout="2m", on_stdout=print)
"""

from ._async.browser import AsyncBrowser
from ._async.sandbox import AsyncFiles, AsyncNetwork, AsyncSandbox
from ._async.commands import AsyncCommandHandle, AsyncCommands
from ._async.pty import AsyncPty, AsyncTerminal
from ._async.templates import AsyncTemplates
from ._async.workspace import AsyncWorkspace
from ._durations import parse_duration
from ._errors import (
    AuthError,
    Conflict,
    CpuosError,
    InvalidArgument,
    LimitExceeded,
    NoSpace,
    NotFound,
    PermissionDenied,
    ServerError,
    Timeout,
    Unavailable,
)
from ._models import (
    ApiKeyInfo,
    CommandInfo,
    ExecResult,
    FileEvent,
    FileEntry,
    SandboxInfo,
    TemplateInfo,
)
from ._sync.commands import CommandHandle, Commands
from ._sync.pty import Pty, Terminal
from ._sync.browser import Browser
from ._sync.sandbox import Files, Sandbox, SandboxNetwork
from ._sync.templates import Templates
from ._sync.workspace import Workspace

__version__ = "0.1.0"

__all__ = [
    "ApiKeyInfo",
    "AsyncBrowser",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncNetwork",
    "AsyncPty",
    "AsyncSandbox",
    "AsyncTemplates",
    "AsyncTerminal",
    "AsyncWorkspace",
    "AuthError",
    "Browser",
    "CommandHandle",
    "CommandInfo",
    "Commands",
    "Conflict",
    "CpuosError",
    "ExecResult",
    "FileEntry",
    "FileEvent",
    "Files",
    "InvalidArgument",
    "LimitExceeded",
    "NoSpace",
    "NotFound",
    "PermissionDenied",
    "Pty",
    "Sandbox",
    "SandboxInfo",
    "SandboxNetwork",
    "ServerError",
    "TemplateInfo",
    "Templates",
    "Terminal",
    "Timeout",
    "Unavailable",
    "Workspace",
    "parse_duration",
]

# the code interpreter (sbx.run_code)
from ._async.interp import AsyncInterpreter
from ._code import CodeError, CodeResult, Result
from ._sync.interp import Interpreter

__all__ += ["AsyncInterpreter", "CodeError", "CodeResult", "Interpreter", "Result"]
