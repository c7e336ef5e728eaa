"""cpuos-agent: the process inside every sandbox (PID 1, unprivileged).

Stdlib only. It reaches the host through ``CPUOS_AGENT_SOCKET``: a unix socket it
connects out to (gVisor: a host directory bind-mounted at /run/cpuos), or a character
device (microVM: the guest side of a virtio-serial port). On each host connection it says
hello, then serves requests multiplexed on that one connection: exec (streamed output,
exit status, timeout, kill of the whole process tree), file operations, background
commands, watches, dials: each kind of request (``protocol.Kind``) goes to its handler
(``HANDLERS``: one module per service). If the connection drops it kills the commands it
was running for it and reconnects.

The host never trusts anything this program sends.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeAlias

from . import bg as bg_mod
from . import control, dial, files, privs, terminal, watch
from . import exec as exec_mod
from . import protocol as P
from .bg import Background, Reader
from .cgroups import Cgroups
from .conn import Conn
from .dial import Dial
from .exec import MAX_BG_KEPT, Exec
from .files import _unlink_quiet
from .identity import drop_inheritable_caps, not_dumpable, read_key
from .memguard import MemGuard, one_arena
from .protocol import ErrorCode, Kind
from .reaper import Reaper
from .service import errcode
from .spawner import Spawner
from .transport import Closed, Quiesce, Transport, transport_for

SOCKET_PATH = os.environ.get("CPUOS_AGENT_SOCKET", "/run/cpuos/agent.sock")

# a request's handler: the agent, the connection, the stream id, the header, the payload
Handler: TypeAlias = Callable[["Agent", Conn, int, P.Header, bytes], None]


class Agent:
    """``spawner`` and ``cgroups``: root mode's (see ``main``); None: commands are started
    by the agent itself and tracked by a process-tree scan."""

    def __init__(self, key: str | None = None, spawner: Spawner | None = None,
                 cgroups: Cgroups | None = None) -> None:
        self.key = key if key is not None else read_key()
        self.reaper = Reaper()
        self.spawner, self.cgroups = spawner, cgroups
        if spawner is not None:
            spawner.attach(self.reaper, cgroups, lambda: bool(self.execs) or any(
                b.result is None for b in list(self.bg.values())))
        self.execs: dict[int, Exec] = {}
        self.writes: dict[int, tuple[int, str, str]] = {}
        self.dials: dict[int, Dial] = {}
        # background commands by pid (they outlive connections); on the current connection:
        # the streams reading one's output, and those writing to one's stdin
        self.bg: dict[int, Background] = {}
        self.readers: dict[int, Reader] = {}
        self.stdin_to: dict[int, Exec] = {}
        self.watches: dict[int, watch.Watch] = {}
        # gVisor: the sandbox's OOM killer (memguard.py); the host sends the limit
        self.memguard = MemGuard(cgroups, self._running, lambda: any(
            not e.background for e in list(self.execs.values()))) if (
            cgroups is not None and cgroups.kind != "v2" and cgroups.mem_root) else None

    def add_bg(self, bg: Background) -> None:
        self.bg[bg.pid] = bg  # an ended one whose pid was reused is forgotten
        ended = sorted((b.ended_at or 0.0, pid) for pid, b in self.bg.items()
                       if b.result is not None)
        for _, pid in ended[: max(0, len(ended) - MAX_BG_KEPT)]:
            self.bg.pop(pid, None)

    def _running(self) -> list[Exec]:
        """Every command running: foreground execs and background processes."""
        out = {id(e): e for e in list(self.execs.values())}
        for b in list(self.bg.values()):
            if b.result is None:
                out[id(b.ex)] = b.ex
        return list(out.values())

    # ---- connection lifecycle -------------------------------------------------------
    def serve_forever(self, transport: Transport | None = None) -> None:
        transport = transport or transport_for(SOCKET_PATH)
        while True:
            conn = Conn(transport.connect())
            quiesced = False
            try:
                # uid: the one it acts as (the commands'); ruid 0 in root mode (privs.py)
                # tracking: how an exec's processes are found for a timeout or a kill
                conn.send({"t": Kind.HELLO, "version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                           "uid": os.geteuid(), "ruid": os.getuid(),
                           "transport": transport.kind, "key": self.key,
                           "tracking": f"cgroup-{self.cgroups.kind}" if self.cgroups
                           else "tree-scan"})
                self._serve(conn)
            except Quiesce:
                quiesced = True
            except (Closed, P.ProtocolError, OSError):
                pass
            finally:
                conn.shutdown()
                if self.memguard is not None:  # the host's watch was this session's
                    self.memguard.host(False, False)
                for ex in list(self.execs.values()):
                    if not ex.background:
                        ex.kill("disconnected")
                for d in list(self.dials.values()):
                    d.close()
                for rd in list(self.readers.values()):
                    rd.cancel()
                self.readers.clear()
                for w in list(self.watches.values()):
                    w.cancel()
                self.watches.clear()
                for ssid, ex in list(self.stdin_to.items()):
                    ex.drop_stdin(ssid)
                self.stdin_to.clear()
                for fd, tmp, _ in self.writes.values():
                    os.close(fd)
                    _unlink_quiet(tmp)
                self.writes.clear()
            transport.after_session(conn.link, quiesced)

    def _serve(self, conn: Conn) -> None:
        while True:
            fr = P.read_frame_sync(conn.rfile)
            if fr is None:
                return
            h, payload = fr
            t = h["t"]
            sid = h.get("id")
            if not isinstance(sid, int):
                sid = 0
            try:
                self._dispatch(conn, t, sid, h, payload)
            except (Closed, Quiesce):
                raise
            except OSError as e:
                conn.send({"t": Kind.ERR, "id": sid, "code": errcode(e),
                           "message": f"{e.strerror or e}"})
            except Exception as e:  # a bad request must never take the agent down
                conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.INTERNAL,
                           "message": f"{type(e).__name__}: {e}"})

    def _dispatch(self, conn: Conn, t: str, sid: int, h: P.Header, payload: bytes) -> None:
        handler = HANDLERS.get(t)  # (a Kind is its string: looked up by the wire's)
        if handler is None:
            conn.send({"t": Kind.ERR, "id": sid, "code": ErrorCode.INVALID,
                       "message": f"unknown {t!r}"})
        else:
            handler(self, conn, sid, h, payload)


# What a request's kind is handled by: one module per service, each listing its own.
SERVICES = (control, exec_mod, bg_mod, terminal, files, watch, dial)
HANDLERS: dict[str, Handler] = {k: fn for svc in SERVICES for k, fn in svc.HANDLERS.items()}


def main(spawner: Spawner | None = None) -> None:
    """Start-up, in this order: signals shielded; in root mode (``privs``) the spawner is
    forked (before any thread, before the key is read: ``__main__`` does it before
    importing this module, else it is done here), the cgroup tree mounted, and the agent
    drops to the user's effective ids; then it reads its key and becomes non-dumpable."""
    one_arena()  # (before any thread of the agent's)
    privs.shield_signals()
    not_dumpable()
    os.umask(0o022)
    sys.stdout = sys.stderr  # nothing of ours goes to a guest-visible stdout
    cgroups: Cgroups | None = None
    if privs.root_mode():
        if spawner is None:
            spawner = Spawner()
            spawner.fork()
        cgroups = Cgroups.setup()
        key = read_key()
        privs.drop_to_user()
    else:
        key = read_key()
    not_dumpable()
    drop_inheritable_caps()
    Agent(key, spawner, cgroups).serve_forever()
