"""Typed results."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._for_model import clip

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
# what a file read accepts by default: read() holds the file in memory; download() and
# download_dir() write to the client's disk (a sandbox's own disk is 5 GiB by default).
# max_bytes=None lifts the SDK's bound (the daemon's CPUOS_MAX_READ_BYTES still holds).
READ_MAX_BYTES = 1 << 30
DOWNLOAD_MAX_BYTES = 8 << 30


class OutputBuffer:
    """Keeps at most ``cap`` bytes of a stream: the head and the tail, and says if it cut."""

    def __init__(self, cap: int = DEFAULT_MAX_OUTPUT) -> None:
        self.cap = max(0, cap)
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_len = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail.append(data)
        self.tail_len += len(data)
        limit = self.cap - self.cap // 2
        while self.tail_len - len(self.tail[0]) >= limit:
            self.tail_len -= len(self.tail.popleft())

    @property
    def _tail_keep(self) -> int:
        return min(self.tail_len, self.cap - self.cap // 2)

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + self._tail_keep

    def value(self) -> bytes:
        tail = b"".join(self.tail)
        return bytes(self.head) + tail[len(tail) - self._tail_keep:]


class _Output:
    """``stdout`` and ``stderr`` as text, of a result holding them as bytes."""

    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")


@dataclass
class ExecResult(_Output):
    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration: float
    timed_out: bool = False
    # ended at the sandbox's memory limit (exit code 137); the sandbox lives on
    oom: bool = False
    signal: int | None = None
    truncated: bool = False
    exec_id: str | None = None
    stdout_total: int = 0
    stderr_total: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def for_model(self, stdout_chars: int = 4000, stderr_chars: int = 2000) -> dict[str, Any]:
        """The result as a model should see it: ``exit_code``, ``stdout`` and ``stderr``
        (each cut to its limit: head and tail around a marker saying how much is left out,
        never a cut UTF-8 sequence), ``images`` (0: a command makes none)."""
        out: dict[str, Any] = {
            "exit_code": self.exit_code,
            "stdout": clip(self.stdout, stdout_chars,
                           already_cut=max(0, self.stdout_total - len(self.stdout_bytes))),
            "stderr": clip(self.stderr, stderr_chars,
                           already_cut=max(0, self.stderr_total - len(self.stderr_bytes))),
            "images": 0,
        }
        if self.timed_out:
            out["timed_out"] = True
        return out


@dataclass
class FileEntry:
    name: str
    path: str
    type: str  # file | dir | symlink | other
    size: int
    mode: int
    mtime: float
    target: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileEntry:
        return cls(name=d["name"], path=d["path"], type=d["type"], size=d["size"],
                   mode=d["mode"], mtime=d["mtime"], target=d.get("target"))


@dataclass
class SandboxInfo:
    id: str
    template: str
    state: str
    reason: str | None
    backend: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    deadline: float | None
    timeout_remaining: float | None
    vcpus: int | None
    memory_mib: int | None
    metadata: dict[str, str] = field(default_factory=dict)
    on_timeout: str = "kill"
    paused_at: float | None = None
    snapshot_bytes: int | None = None
    pids: int | None = None
    disk_mib: int | None = None  # the root filesystem's writable layer (ENOSPC past it)
    network: dict[str, Any] | None = None  # the egress policy (mode, allow)
    # s idle before it is paused (0: never); paused for that: reason "idle", and any call
    # that needs the machine resumes it
    idle_timeout: float | None = None
    # the node it runs or is paused on (many hosts); None on one host, and while paused
    # into the shared snapshot store
    node_id: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxInfo:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]


@dataclass
class ApiKeyInfo:
    """An API key of a workspace (``Workspace().keys()``): never the key itself, except in
    what ``create_key`` returns (``key``, shown that once). ``current``: the key asking."""

    id: str
    workspace_id: str
    label: str
    created_at: float
    revoked_at: float | None = None
    current: bool = False
    key: str | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ApiKeyInfo:
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        return cls(**kw)

    def __repr__(self) -> str:  # the key, if any, stays out of logs and tracebacks
        state = "revoked" if self.revoked else "live"
        mine = ", current" if self.current else ""
        return f"ApiKeyInfo({self.id}, {self.label!r}, {state}{mine})"


@dataclass
class TemplateInfo:
    """A template built on the daemon's host (``cpuos template ls``)."""

    name: str
    digest: str
    source: str | None = None
    rootfs: str | None = None
    size_bytes: int | None = None
    built_at: float | None = None
    build_seconds: float | None = None
    cached: bool | None = None
    packages: list[str] = field(default_factory=list)
    workdir: str | None = None
    user: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TemplateInfo:
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        return cls(**kw)


@dataclass
class CommandInfo:
    """A background command (``sbx.commands.list()``): its pid inside the sandbox is its id;
    its output is kept from ``out_start`` to ``out_end`` (offsets over stdout and stderr
    together)."""

    pid: int
    cmd: str
    running: bool
    started_at: float | None = None
    ended_at: float | None = None
    out_start: int = 0
    out_end: int = 0
    buffer: int = 0
    stdin: bool = False
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool | None = None
    killed: bool | None = None
    duration: float | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CommandInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class FileEvent:
    """A change under a watched directory (``sbx.files.watch``): ``type`` is create,
    modify, delete or rename (``from_path``: where it was); one per path per short window
    (the last change); ``overflow`` (on an event with type "overflow"): changes were
    lost, rescan."""

    type: str
    path: str
    is_dir: bool = False
    from_path: str | None = None
