"""What the API takes: every request body (and the path query) of every route, validated
here before a route runs (a 422 naming the field otherwise). What it answers is described
in ``schemas``."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cpuos_agent.protocol import parse_duration

from .. import browser as cdp
from ..lifecycle.interpreter import LANGUAGE_RE
from ..paths import ID_RE

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_IDLE_TIMEOUT = 24 * 3600.0
MAX_BUFFER = 64 << 20  # bytes of a background command's output kept, at most
MAX_CODE = 1_000_000  # characters of one code cell
MAX_BROWSER_TIMEOUT = 600.0

PathQ = Annotated[str, Query(description="path inside the sandbox (relative: to /work)")]


# ---- shared checks ----------------------------------------------------------------------
def duration(v: Any, what: str) -> float:
    try:
        return parse_duration(v, what)
    except ValueError as e:
        raise ValueError(str(e)) from None


def idle_duration(v: Any, what: str = "idle_timeout") -> float:
    """An idle timeout: a duration, or 0 (``0``, ``"0"``, ``"0s"``): never."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
        return 0.0
    if isinstance(v, str) and v.strip().lower() in ("0", "0s", "0m", "never"):
        return 0.0
    secs = duration(v, what)
    if secs > MAX_IDLE_TIMEOUT:
        raise ValueError(f"{what}: at most {MAX_IDLE_TIMEOUT:.0f}s (or 0: never)")
    return secs


def check_env(v: dict[str, str]) -> dict[str, str]:
    if len(v) > 256:
        raise ValueError("at most 256 environment variables")
    for k, val in v.items():
        if not ENV_KEY.fullmatch(k):
            raise ValueError(f"bad environment variable name {k[:80]!r}")
        if "\x00" in val or len(val) > 32768:
            raise ValueError(f"bad value for environment variable {k}")
    return v


def check_cmd(v: str | list[str]) -> str | list[str]:
    """A shell command line, or an argv of 1..4096 strings; no NUL byte anywhere."""
    if isinstance(v, str):
        if not v.strip():
            raise ValueError("cmd must not be empty")
        if "\x00" in v:
            raise ValueError("cmd contains a NUL byte")
    elif not v or any("\x00" in a for a in v) or len(v) > 4096:
        raise ValueError("argv must be 1..4096 strings without NUL bytes")
    return v


def _language(v: str) -> str:
    if not LANGUAGE_RE.fullmatch(v):
        raise ValueError("language must be a kernel language such as 'python'")
    return v


# ---- sandboxes --------------------------------------------------------------------------
class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid")
    template: str = "python"
    timeout: float | str = 300.0
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    env: dict[str, str] = Field(default_factory=dict)
    vcpus: int | None = Field(None, ge=1, le=64, description="default: the workspace's "
                              "default_vcpus, else the daemon's (2)")
    memory_mib: int | None = Field(None, ge=128, le=262144, description="default: the "
                                   "workspace's default_memory_mib, else the daemon's "
                                   "(CPUOS_DEFAULT_MEMORY_MIB, 2048)")
    disk_mib: int | None = Field(None, ge=64, le=1 << 22, description=(
        "MiB the root filesystem's writable layer may hold (ENOSPC inside past it); "
        "default: the workspace's default_disk_mib, else CPUOS_DEFAULT_DISK_MIB"))
    pids: int | None = Field(None, ge=16, le=1 << 22, description=(
        "processes and threads the sandbox's commands may have; default: the "
        "workspace's default_pids, else CPUOS_DEFAULT_PIDS"))
    on_timeout: Literal["kill", "pause"] = "kill"
    idle_timeout: float | str | None = Field(None, description=(
        "pause it after this long idle: no call needing the machine, no open stream or "
        "preview connection, no CPU use inside (0: never; default: the workspace's "
        "default_idle_timeout, else CPUOS_IDLE_TIMEOUT, 10m); any such call resumes it"))
    network: str | dict[str, Any] | None = Field(None, description=(
        "egress policy: off | on | allowlist | {\"allow\": [\"pypi.org\", "
        "\"*.github.com\"]} (default: the daemon's CPUOS_DEFAULT_NETWORK)"))
    wake_on_request: bool = Field(True, description="a request to an exposed port of the "
                                  "paused sandbox resumes it")
    secrets: dict[str, Any] | None = Field(None, description=(
        "{NAME: {\"value\": \"...\", \"hosts\": [\"api.example.com\"]}}: NAME in the "
        "sandbox is a placeholder; the egress proxy puts the value in the headers of "
        "requests to those hosts only"))

    @field_validator("template")
    @classmethod
    def _t(cls, v: str) -> str:
        if not ID_RE.fullmatch(v):
            raise ValueError("template name must match ^[a-z0-9-]{1,64}$")
        return v

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float:
        return duration(v, "timeout")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("idle_timeout")
    @classmethod
    def _idle(cls, v: Any) -> float | None:
        return None if v is None else idle_duration(v)


class ExposePort(BaseModel):
    model_config = ConfigDict(extra="forbid")
    port: int = Field(ge=1, le=65535)
    public: bool | None = Field(None, description="no token needed (default: as it was, "
                                "else false)")


class SetNetwork(BaseModel):
    model_config = ConfigDict(extra="forbid")
    network: str | dict[str, Any]


class SetTimeout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float | str | None = Field(None, description="kill (or pause) it this long "
                                        "from now")
    idle_timeout: float | str | None = Field(None, description="its new idle timeout, from "
                                             "now (0: never)")

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float | None:
        return None if v is None else duration(v, "timeout")

    @field_validator("idle_timeout")
    @classmethod
    def _idle(cls, v: Any) -> float | None:
        return None if v is None else idle_duration(v)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(1, ge=1, le=16)


# ---- commands ---------------------------------------------------------------------------
class _Command(BaseModel):
    # what starting a command takes (exec, background, terminal), and its checks
    model_config = ConfigDict(extra="forbid")
    cmd: str | list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="default: the template's workdir (/work)")
    timeout: float | str | None = None

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        return check_cmd(v)

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float | None:
        return None if v is None else duration(v, "timeout")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class ExecRequest(_Command):
    cmd: str | list[str] = Field(description="a shell command line (run by bash -c) or an argv")
    stdin: str | None = Field(None, description="text fed to the command's stdin")
    stdin_b64: str | None = Field(None, description="bytes (base64) fed to stdin")
    stdin_stream: bool = Field(False, description="keep its stdin open for POST "
                               "/sandboxes/{id}/execs/{exec_id}/stdin (streamed, flow-"
                               "controlled; the started frame names the exec id)")


class StartCommand(_Command):
    cmd: str | list[str] = Field(description="a shell command line (bash -c) or an argv")
    timeout: float | str | None = Field(None, description="kill it after this long "
                                        "(default: none; the sandbox's life bounds it)")
    buffer: int = Field(1 << 20, ge=4096, le=MAX_BUFFER, description="bytes of its output "
                        "kept (stdout and stderr together; the oldest go first)")
    stdin: bool = Field(True, description="keep a pipe to its stdin (else /dev/null)")


class SignalRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    signal: str | int = Field("TERM", description="TERM, SIGINT, 9...")


class StartPty(StartCommand):
    model_config = ConfigDict(extra="forbid")
    cmd: str | list[str] = Field(["/bin/bash", "-l"], description="default: a login bash")
    cols: int = Field(80, ge=1, le=1000)
    rows: int = Field(24, ge=1, le=1000)
    buffer: int = Field(256 << 10, ge=4096, le=64 << 20, description="bytes of its "
                        "output kept for a client that attaches later")


class Resize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


class RunCode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(max_length=MAX_CODE)
    language: str = "python"
    timeout: float | str | None = Field(None, description="the cell is interrupted (SIGINT) "
                                        "after this; default 300 s")

    @field_validator("timeout")
    @classmethod
    def _to(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v, "timeout")

    @field_validator("language")
    @classmethod
    def _lang(cls, v: str) -> str:
        return _language(v)


class RestartKernel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: str = "python"

    @field_validator("language")
    @classmethod
    def _lang(cls, v: str) -> str:
        return _language(v)


# ---- the browser ------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(30.0, gt=0, le=MAX_BROWSER_TIMEOUT)


class Goto(_Body):
    url: str = Field(min_length=1, max_length=cdp.MAX_URL)


class Click(_Body):
    selector: str = Field(min_length=1, max_length=10_000)


class Fill(Click):
    text: str = Field(max_length=1 << 20)


# ---- workspaces and keys ----------------------------------------------------------------
class NewWorkspace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")
    limits: dict[str, int] = Field(default_factory=dict, description=(
        "maxima: max_sandboxes, max_vcpus, max_memory_mib, max_disk_mib and max_pids (per "
        "sandbox), "
        "max_total_vcpus and max_total_memory_mib (its running sandboxes together)"))


class SetLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: dict[str, int]


class WorkspaceSettings(BaseModel):
    """Only the settings named in the body change; null removes one (back to the
    daemon's default)."""
    model_config = ConfigDict(extra="forbid")
    default_network: str | dict[str, Any] | None = None
    spending_cap: float | None = Field(None, ge=0, description=(
        "USD per calendar month (UTC); at it, create and resume are refused (402) and "
        "running sandboxes are paused"))
    default_vcpus: int | None = Field(None, ge=1, le=64)
    default_memory_mib: int | None = Field(None, ge=128, le=262144)
    default_disk_mib: int | None = Field(None, ge=64, le=1 << 22)
    default_pids: int | None = Field(None, ge=16, le=1 << 22)
    default_idle_timeout: float | str | None = Field(None, description=(
        "idle timeout of its sandboxes that name none (0: never; unset: the daemon's "
        "CPUOS_IDLE_TIMEOUT, 10m)"))

    @field_validator("default_idle_timeout")
    @classmethod
    def _idle(cls, v: Any) -> float | None:
        return None if v is None else idle_duration(v, "default_idle_timeout")


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9 ._-]+$",
                       description="a name for the key (who or what holds it)")
