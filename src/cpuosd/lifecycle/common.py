"""What the lifecycle modules share: the live-sandbox record, bounds, small helpers."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..agentconn import AgentChannel
from ..backends.base import SandboxSpec
from ..store import SandboxRow
from .states import State

if TYPE_CHECKING:
    from .memwatch import MemoryWatch

# s a request waits for the agent of a running sandbox that is reconnecting
RECONNECT_GRACE = 5.0
# s a kill waits for another operation on the sandbox to let go (then for its teardown:
# CPUOS_KILL_TIMEOUT), and between retries of a teardown that overran
KILL_LOCK_WAIT = 3.0
KILL_RETRY_INTERVAL = 5.0


@dataclass
class Live:
    row: SandboxRow
    spec: SandboxSpec
    chan: AgentChannel
    mem: MemoryWatch | None = None  # the host's half of the agent's OOM guard


# What the Manager gives the collaborators it holds (lifecycle.reconcile, ...): its
# operations as callables, never the Manager itself.
Spawn = Callable[[Coroutine[Any, Any, Any]], object]  # Manager._spawn: a task it owns


class Kill(Protocol):  # Manager.kill
    def __call__(self, sid: str, reason: str = ..., final_state: State = ...
                 ) -> Coroutine[Any, Any, None]: ...


class SetState(Protocol):  # Manager._set_state: the one writer of states
    def __call__(self, sid: str, to: State, **fields: Any) -> None: ...


Finish = Callable[[str, State, str], None]  # Manager._finish(sid, state, reason)


class NewRow(Protocol):  # Manager._new_row: a sandbox's row, inserted
    def __call__(self, workspace_id: str, template: str, info: dict[str, Any],
                 timeout: float, metadata: dict[str, str], env: dict[str, str], vcpus: int,
                 memory_mib: int, state: State = ..., on_timeout: str = ...
                 ) -> SandboxRow: ...


class Boot(Protocol):  # Manager._boot: a sandbox started (image None) or restored
    def __call__(self, row: SandboxRow, image: Path | None, *, template_boot: bool = ...,
                 resume: bool = ...) -> Awaitable[Live]: ...


def _now() -> float:
    return time.time()


def _base_env(row: SandboxRow) -> dict[str, str]:
    """A command's environment before its own: defaults, the template's, the sandbox's."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/home/user", "USER": "user", "LANG": "C.UTF-8", "TERM": "xterm",
           "HOSTNAME": row.id}
    env.update(row.spec.template_env or {})
    env.update(row.spec.env or {})
    return env


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
