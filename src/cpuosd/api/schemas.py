"""What the API answers, described for its OpenAPI document (``/openapi.json``), from which
the TypeScript SDK's types are generated (sdk/js). The routes build their answers as dicts;
these models only document them (tests/unit/test_api_schemas.py checks the real answers
against them), so a route's answer is never filtered or re-validated on its way out.

The exec stream's and framed file reads' frame headers are here too: they travel inside
``application/x-cpuos-frames`` bodies (cpuos_agent.protocol), which OpenAPI cannot
describe, so they are listed as components of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field


class Sandbox(BaseModel):
    id: str
    workspace: str = Field(description="the id of the workspace it belongs to")
    template: str
    state: str = Field(description="creating | running | pausing | paused | resuming | "
                       "killing | killed | error | pooled")
    reason: str | None
    backend: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    deadline: float | None
    timeout_remaining: float | None
    vcpus: int | None
    memory_mib: int | None
    pids: int | None
    disk_mib: int | None = Field(description="the writable layer's size (ENOSPC past it)")
    network: dict[str, Any] | None = Field(description="the egress policy (mode, allow)")
    metadata: dict[str, str]
    on_timeout: Literal["kill", "pause"]
    paused_at: float | None
    snapshot_bytes: int | None
    idle_timeout: float = Field(description="s idle before it is paused (0: never); a "
                                "sandbox paused for that has reason 'idle' and any call "
                                "needing the machine resumes it")
    node_id: str | None = Field(description="the node it runs on or is paused on (many "
                                "hosts, docs/DEPLOY.md); null on one host, and while "
                                "paused into the shared snapshot store")


class SandboxList(BaseModel):
    sandboxes: list[Sandbox]


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    target: str | None = None


class FileList(BaseModel):
    entries: list[FileEntry]


class Removed(BaseModel):
    removed: str


class Port(BaseModel):
    port: int
    public: bool
    token: str | None
    created_at: float | None
    url: str = Field(description="path form: <preview>/sandboxes/<id>/ports/<port>/")
    host_url: str = Field(description="host form: http://<port>-<id>.<domain>:<port>/")


class PortList(BaseModel):
    ports: list[Port]


class Unexposed(BaseModel):
    unexposed: int


class UsageFigures(BaseModel):
    running_seconds: float
    vcpu_seconds: float
    memory_gib_seconds: float
    paused_seconds: float
    idle_paused_seconds: float = Field(description="of paused_seconds: paused for "
                                       "idleness (idle_timeout)")
    snapshot_gib_seconds: float
    cost: float = Field(description="USD at the daemon's prices")


class SandboxUsage(UsageFigures):
    id: str


class SpendingCap(BaseModel):
    cap: float | None = Field(description="USD a calendar month (UTC); null: none")
    month_spent: float
    reached: bool


class UsageDay(UsageFigures):
    date: str = Field(description="the UTC day, YYYY-MM-DD")
    since: float
    until: float


class Usage(BaseModel):
    workspace: str
    since: float
    until: float
    prices: dict[str, float] = Field(description="vcpu_hour, gib_hour, snapshot_gib_hour")
    currency: str
    total: UsageFigures
    sandboxes: list[SandboxUsage]
    spending_cap: SpendingCap
    days: list[UsageDay] | None = Field(None, description="with by=day: the totals of each "
                                        "UTC day between since and until")


class Metrics(BaseModel):
    """What the host measures of a sandbox now (the fields its backend and state allow)."""

    id: str
    state: str
    time: float
    vcpus: int | None
    memory_limit_bytes: int
    pids_limit: int | None
    disk_limit_bytes: int
    cpu_seconds: float | None = None
    cpu_percent_avg: float | None = None
    memory_bytes: int | None = None
    pids: int | None = None
    disk_used_bytes: int | None = None
    net_tx_bytes: int | None = None
    net_rx_bytes: int | None = None
    snapshot_bytes: int | None = None


class MetricsList(BaseModel):
    time: float
    sandboxes: list[Metrics]


class ErrorDetail(BaseModel):
    code: str = Field(description="one of cpuos._errors.ERROR_CODES")
    message: str
    details: dict[str, Any]


class ErrorBody(BaseModel):
    error: ErrorDetail


# ---- frame headers (application/x-cpuos-frames) --------------------------------------
class ExecStartedFrame(BaseModel):
    t: Literal["started"]
    exec_id: str


class ExecOutFrame(BaseModel):
    """The payload is the raw bytes the command wrote to ``fd``."""

    t: Literal["out"]
    fd: Literal[1, 2]


class ExecExitFrame(BaseModel):
    t: Literal["exit"]
    exit_code: int = Field(description="-1..255; 128 + n for a signal n")
    signal: int | None
    timed_out: bool
    killed: bool
    oom: bool = Field(description="ended at the sandbox's memory limit (exit code 137)")
    duration: float


class StreamErrorFrame(BaseModel):
    """Ends an exec stream or a framed file read that failed after its response began."""

    t: Literal["error"]
    code: str
    message: str
    size: int | None = Field(None, description="file reads: the bytes sent before it")


class FileDataFrame(BaseModel):
    """The payload is the next bytes of the file."""

    t: Literal["data"]


class FileEofFrame(BaseModel):
    t: Literal["eof"]
    size: int = Field(description="the bytes sent in all")


class ApiKey(BaseModel):
    """An API key of a workspace: never the key itself, except ``key`` in the answer that
    made it (shown once; it is stored hashed)."""

    id: str
    workspace_id: str
    label: str
    created_at: float
    revoked_at: float | None = Field(description="null while it is live")
    current: bool = Field(description="the key that asked")
    key: str | None = Field(None, description="only when just made")
    requests_ended: int | None = Field(None, description="revocation: its requests in "
                                       "flight that were ended (streams, terminals)")


class ApiKeyList(BaseModel):
    keys: list[ApiKey]


class WorkspaceRecord(BaseModel):
    id: str
    name: str
    created_at: float
    limits: dict[str, int]
    settings: dict[str, Any]
    deleted_at: float | None
    keys: int = Field(description="live keys")
    sandboxes: int = Field(description="sandboxes with something on the host")


class WorkspaceList(BaseModel):
    workspaces: list[WorkspaceRecord]


class WorkspaceDeleted(BaseModel):
    id: str
    name: str
    deleted_at: float | None
    keys_revoked: int
    requests_ended: int
    sandboxes_killed: list[str]


FRAMES: tuple[type[BaseModel], ...] = (ExecStartedFrame, ExecOutFrame, ExecExitFrame,
                                       StreamErrorFrame, FileDataFrame, FileEofFrame)

# (method, path) -> the model of its 200/201 answer
ANSWERS: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/sandboxes"): Sandbox,
    ("get", "/sandboxes"): SandboxList,
    ("get", "/sandboxes/{sid}"): Sandbox,
    ("delete", "/sandboxes/{sid}"): Sandbox,
    ("post", "/sandboxes/{sid}/pause"): Sandbox,
    ("post", "/sandboxes/{sid}/resume"): Sandbox,
    ("post", "/sandboxes/{sid}/timeout"): Sandbox,
    ("post", "/sandboxes/{sid}/network"): Sandbox,
    ("post", "/sandboxes/{sid}/fork"): SandboxList,
    ("put", "/sandboxes/{sid}/files"): FileEntry,
    ("delete", "/sandboxes/{sid}/files"): Removed,
    ("get", "/sandboxes/{sid}/files/list"): FileList,
    ("get", "/sandboxes/{sid}/files/stat"): FileEntry,
    ("post", "/sandboxes/{sid}/files/mkdir"): FileEntry,
    ("post", "/sandboxes/{sid}/ports"): Port,
    ("get", "/sandboxes/{sid}/ports"): PortList,
    ("delete", "/sandboxes/{sid}/ports/{port}"): Unexposed,
    ("get", "/usage"): Usage,
    ("get", "/metrics"): MetricsList,
    ("get", "/sandboxes/{sid}/metrics"): Metrics,
    ("get", "/workspace/keys"): ApiKeyList,
    ("post", "/workspace/keys"): ApiKey,
    ("delete", "/workspace/keys/{key_id}"): ApiKey,
    ("get", "/workspaces/{wid}/keys"): ApiKeyList,
    ("post", "/workspaces/{wid}/keys"): ApiKey,
    ("delete", "/workspaces/{wid}/keys/{key_id}"): ApiKey,
    ("get", "/workspaces"): WorkspaceList,
    ("delete", "/workspaces/{wid}"): WorkspaceDeleted,
}


def document(app: FastAPI) -> None:
    """Add the answers' and frames' schemas to the app's OpenAPI document."""
    base: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = base()
        from pydantic.json_schema import models_json_schema

        models: list[type[BaseModel]] = [*ANSWERS.values(), *FRAMES, ErrorBody]
        _, top = models_json_schema([(m, "serialization") for m in models],
                                    ref_template="#/components/schemas/{model}")
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(top.get("$defs", {}))
        for (method, path), model in ANSWERS.items():
            op = doc.get("paths", {}).get(path, {}).get(method)
            if op is None:
                continue
            for status, resp in op.get("responses", {}).items():
                if status.startswith("2"):
                    resp["content"] = {"application/json": {"schema": {
                        "$ref": f"#/components/schemas/{model.__name__}"}}}
            op["responses"].setdefault("default", {
                "description": "an error",
                "content": {"application/json": {"schema": {
                    "$ref": "#/components/schemas/ErrorBody"}}}})
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
