"""What runs inside a gVisor sandbox without going through the API, recorded from outside
it: gVisor's runtime monitoring (seccheck trace points) with a ``remote`` sink in the daemon.

``Traced`` wraps the gVisor backend: before runsc starts or restores a sandbox, a listener
(a SOCK_SEQPACKET unix socket in the sandbox's host directory, never mounted inside) is
made for it and runsc is given ``--pod-init-config`` naming that socket. runsc (on the host)
connects, does the sink's handshake, and hands the connected socket to the Sentry, which
then sends one protobuf message per trace point: every ``execve`` (``sentry/execve``:
argv, binary, pid, uid, cwd) and every ``open``/``openat``/``creat`` (``syscall/*/exit``:
path, flags, result), which we keep when it opened a file for writing. The Sentry is the
sandbox's kernel: code inside cannot skip, forge or silence these points, and nothing of
the recording lives inside (killing or replacing the agent changes nothing).

The trace session is set up when the Sentry boots, so a restore (resume, fork, a create
from a template snapshot, the warm pool) passes the config again and the new Sentry
connects again; a daemon restarted while sandboxes run re-attaches with ``runsc trace
create --force``. Template boots are not traced (no one's sandbox).

Bounded: the Sentry never waits for us (its writes are non-blocking; what does not fit in
the socket's buffer it drops and counts, and the count comes in the header of the next
message that fits); a reader thread per sandbox reads at most RATE messages a second (a
burst of BURST) and otherwise does not read, so a flood inside costs the daemon at most
that; rows go to the audit's bounded queue. Every loss ends up in a counted ``dropped``
row (the Sentry's last count only once another message gets through).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from ..backends.base import Backend, Capabilities, SandboxSpec
from . import seccheck_pb2 as _pb
from .audit import AuditLog

log = logging.getLogger("cpuosd.trace")
# the generated module makes its classes at import (protoc's form): no static types
pb: Any = _pb

HEADER = struct.Struct("<HHI")  # header size, message type, dropped count (wire.Header)
COUNT = struct.Struct("<I")  # cpuos's header extension (size >= 12): points this stands for
LENGTH = struct.Struct("<I")  # a record's length in a batch
MSG_BATCH = 0x7C01  # cpuos's sink: a message of records (u32 length, header, point)
MAX_MESSAGE = 256 << 10  # a bigger one (a huge argv) is cut by the socket: counted, not read
RATE = 5000.0  # messages parsed per second per sandbox (beyond: counted as dropped)
BURST = 20000.0
GATHER = 0.02  # s: after a message, what else comes within this is read in the same wakeup
COALESCE = "1s"  # the Sentry's window for repeated points (cpuos's runsc, level 2)
EXEC_CONTEXT = ["time", "group_id", "parent_thread_group_id", "credentials", "cwd",
                "process_name"]
# file points carry the path resolved in the Sentry: no cwd (computing it costs a walk)
FILE_CONTEXT = ["time", "group_id", "parent_thread_group_id", "credentials", "process_name"]
CONTEXT = EXEC_CONTEXT  # (gVisor's own open points, where the cwd resolves relative paths)
O_ACCMODE, O_WRONLY, O_RDWR = 0o3, 0o1, 0o2
O_CREAT, O_TRUNC, O_APPEND = 0o100, 0o1000, 0o2000
FLAG_NAMES = ((O_CREAT, "O_CREAT"), (O_TRUNC, "O_TRUNC"), (O_APPEND, "O_APPEND"),
              (0o200, "O_EXCL"), (0o20000000, "O_TMPFILE"))
MSG_EXEC = pb.MESSAGE_SENTRY_EXEC
MSG_OPEN = pb.MESSAGE_SYSCALL_OPEN
# cpuos's file-system points (deps/runsc/patches: level 2), by syscall number: the op a
# row names, and what the message's pathname holds beside the path (fd_path)
FS_OPS: dict[int, tuple[str, str, str | None]] = {
    # sysno: (point name, op, pathname's meaning)
    76: ("truncate", "truncate", None), 82: ("rename", "rename", "from"),
    83: ("mkdir", "mkdir", None), 84: ("rmdir", "rmdir", None),
    86: ("link", "link", "from"), 87: ("unlink", "unlink", None),
    88: ("symlink", "symlink", "target"), 133: ("mknod", "mknod", None),
    258: ("mkdirat", "mkdir", None), 259: ("mknodat", "mknod", None),
    263: ("unlinkat", "unlink", None), 264: ("renameat", "rename", "from"),
    265: ("linkat", "link", "from"), 266: ("symlinkat", "symlink", "target"),
    316: ("renameat2", "rename", "from"),
}
AT_REMOVEDIR, RENAME_EXCHANGE = 0x200, 0x2
# what the agent itself does in every exec (its per-exec cgroups, cpuos_agent.cgroups):
# not the sandbox user's doing, and only root there may write
AGENT_PATHS = ("/run/cpuos-exec/", "/run/cpuos-mem/")


def session_config(endpoint: Path, cpuos_points: bool = True) -> dict[str, Any]:
    """runsc's --pod-init-config: the one trace session, its points and our sink.
    ``cpuos_points``: the runsc has cpuos's points (patch level 2): file-system changes,
    opens filtered to writes in the Sentry, coalescing in its sink; else gVisor's own open
    points (every open is sent; reads are dropped here)."""
    execve = {"name": "sentry/execve", "context_fields": EXEC_CONTEXT}
    if not cpuos_points:
        opens = [{"name": f"syscall/{s}/exit", "context_fields": CONTEXT,
                  **({"optional_fields": ["fd_path"]} if s != "open" else {})}
                 for s in ("open", "openat", "creat")]
        sink: dict[str, Any] = {"endpoint": str(endpoint), "retries": 0}
        return {"trace_session": {"name": "Default", "points": [execve, *opens],
                                  "sinks": [{"name": "remote", "config": sink}]}}
    points = [execve,
              *[{"name": f"syscall/{s}/exit", "context_fields": FILE_CONTEXT,
                 "optional_fields": ["cpuos_writes"]} for s in ("open", "openat", "creat")],
              *[{"name": f"syscall/{name}/exit", "context_fields": FILE_CONTEXT}
                for name in ["openat2", *(v[0] for v in FS_OPS.values())]]]
    sink = {"endpoint": str(endpoint), "retries": 0, "cpuos_coalesce": COALESCE}
    return {"trace_session": {"name": "Default", "points": points,
                              "sinks": [{"name": "remote", "config": sink}]}}


def flag_names(flags: int) -> list[str]:
    acc = flags & O_ACCMODE
    out = ["O_WRONLY" if acc == O_WRONLY else "O_RDWR" if acc == O_RDWR else "O_RDONLY"]
    return out + [n for bit, n in FLAG_NAMES if flags & bit == bit]


# opened for writing all the time and never a file's content: not kept
DEVICES = frozenset({"/dev/null", "/dev/tty", "/dev/urandom", "/dev/random", "/dev/zero",
                     "/dev/full", "/dev/ptmx"})


def is_write(flags: int) -> bool:
    return bool(flags & O_ACCMODE in (O_WRONLY, O_RDWR) or flags & (O_CREAT | O_TRUNC))


def _ctx(c: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": c.thread_group_id, "ppid": c.parent_thread_group_id,
                           "uid": c.credentials.real_uid, "euid": c.credentials.effective_uid}
    if c.process_name:
        out["process"] = c.process_name
    return out


def decode(mtype: int, payload: bytes, count: int = 1, cpuos_points: bool = True
           ) -> tuple[str, dict[str, Any]] | None:
    """One trace message as (kind, detail), or None for one not kept (an open for reading
    or one that failed; the agent's own cgroups). ``count`` > 1: the message stands for
    that many identical points (coalesced by the Sentry). ``cpuos_points``: the session
    has cpuos's points (session_config). Raises on a malformed message (the caller counts
    it)."""
    got = _decode(mtype, payload, cpuos_points)
    if got is not None and count > 1:
        got[1]["count"] = count
    return got


def _decode(mtype: int, payload: bytes, cpuos_points: bool
            ) -> tuple[str, dict[str, Any]] | None:
    if mtype == MSG_EXEC:
        m = pb.ExecveInfo.FromString(payload)
        c = m.context_data
        return "command", {
            "source": "runtime", "argv": list(m.argv), "binary": m.binary_path or m.execfn,
            "cwd": c.cwd, "env": sorted({e.partition("=")[0] for e in m.env})[:256],
            **_ctx(c), "time_ns": c.time_ns}
    if mtype != MSG_OPEN:
        return None
    o = pb.Open.FromString(payload)
    if o.HasField("exit") and o.exit.result < 0:
        return None
    c = o.context_data
    fs = FS_OPS.get(o.sysno)
    if fs is not None:  # cpuos's points: the path resolved in the Sentry
        _, op, other = fs
        path = o.fd_path
        if op == "unlink" and o.flags & AT_REMOVEDIR:
            op = "rmdir"
        if path.startswith(AGENT_PATHS) and c.credentials.real_uid == 0:
            return None
        detail: dict[str, Any] = {"source": "runtime", "op": op, "path": path}
        if other is not None:
            detail[other] = o.pathname
        if op == "rename" and o.flags & RENAME_EXCHANGE:
            detail["exchange"] = True
        if op in ("mkdir", "mknod"):
            detail["mode"] = oct(o.mode)
        return "file_write", {**detail, **_ctx(c), "time_ns": c.time_ns}
    if not is_write(o.flags):
        return None
    if cpuos_points and o.fd_path.startswith("/"):
        path = o.fd_path  # the file opened, resolved in the Sentry from its new fd
    else:  # gVisor's own points: the name as given, joined to the dirfd's path or the cwd
        path = o.pathname
        if path and not path.startswith("/"):
            base = o.fd_path if o.fd_path.startswith("/") else c.cwd
            path = posixpath.normpath(posixpath.join(base or "/", path))
    if path in DEVICES or path.startswith("/dev/pts/") or (
            path.startswith(AGENT_PATHS) and c.credentials.real_uid == 0):
        return None
    detail = {"source": "runtime", "op": "open", "path": path, "flags": flag_names(o.flags),
              "fd": o.exit.result}
    if o.sysno == 437:
        detail["syscall"] = "openat2"
    if o.pathname and o.pathname != path:
        detail["name"] = o.pathname  # how the process named it (a link, /proc/self/fd/N...)
    return "file_write", {**detail, **_ctx(c), "time_ns": c.time_ns}


class Sink:
    """One sandbox's listener and reader (a thread of its own)."""

    def __init__(self, sid: str, path: Path, audit: AuditLog, cpuos_points: bool = True
                 ) -> None:
        self.sid, self.path, self.audit = sid, path, audit
        self.cpuos_points = cpuos_points
        self.connections = 0  # Sentries that connected (a restore is a new one)
        self.messages = 0  # messages read (a batch is one)
        self.points = 0  # points recorded (a coalesced one counts as many as it stands for)
        self.wakeups = 0  # times the reader woke up to read (several messages each)
        self._stop = threading.Event()
        self._conn: socket.socket | None = None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lsock.bind(str(path))
        os.chmod(path, 0o600)
        self._lsock.listen(4)
        self._lsock.settimeout(0.5)
        self._thread = threading.Thread(target=self._run, name=f"trace-{sid}", daemon=True)
        self._thread.start()

    def close(self, wait: float = 0.0) -> None:
        """Stop listening and reading (the thread ends by itself, promptly: the event loop
        never waits for it unless ``wait``)."""
        self._stop.set()
        for sock in (self._conn, self._lsock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept or recv
        with contextlib.suppress(OSError):
            self.path.unlink()
        if wait:
            self._thread.join(wait)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._lsock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                self._conn = conn
                try:
                    self._serve(conn)
                except Exception:
                    log.exception("trace sink of %s failed", self.sid)
                finally:
                    self._conn = None
                    conn.close()
        finally:
            self._lsock.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        hello = conn.recv(10240)  # runsc's Handshake (the version it speaks)
        theirs = pb.Handshake.FromString(hello)
        conn.sendall(pb.Handshake(version=1).SerializeToString())
        self.connections += 1
        log.info("trace session of %s connected (sink version %d)", self.sid, theirs.version)
        # No timeout: an idle sandbox costs no wakeup here; close() (shutdown) or the
        # Sentry's end (EOF) wakes the blocked recv.
        conn.settimeout(None)
        tokens, last = BURST, time.monotonic()
        self._seen_dropped = 0  # the Sentry's count in the last header read
        self._lost = self._malformed = 0  # not yet in a dropped row (one a second at most)
        noted = time.monotonic()
        block = True
        while not self._stop.is_set():
            now = time.monotonic()
            if (self._lost or self._malformed) and now - noted >= 1.0:
                self._note()
                noted = now
            tokens = min(BURST, tokens + (now - last) * RATE)
            last = now
            if tokens < 1:
                # over the rate: stop reading for a while; the socket's buffer fills and the
                # Sentry drops (and counts) what does not fit, at no cost to the daemon
                self._stop.wait(min(0.2, (1 - tokens) / RATE))
                continue
            try:
                if block:  # wait for the next message
                    data, _, flags, _ = conn.recvmsg(MAX_MESSAGE)
                    self.wakeups += 1
                else:
                    data, _, flags, _ = conn.recvmsg(MAX_MESSAGE, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                # all read: what comes next within GATHER is read in one wakeup (fewer
                # wakeups of this thread under a stream of points); with losses not yet
                # noted (at most one dropped row a second) it keeps looking every GATHER
                # instead of blocking, so they are noted within the second
                block = not (self._lost or self._malformed)
                self._stop.wait(GATHER)
                continue
            except OSError:
                break
            if not data:
                break  # the Sentry is gone (sandbox stopped, checkpointed, killed)
            block = False
            tokens -= self._handle(data, flags)
        self._note()
        log.info("trace session of %s ended", self.sid)

    def _handle(self, data: bytes, flags: int) -> int:
        """One message from the socket (a batch of records, cpuos's sink, or one point);
        how many points it held."""
        self.messages += 1
        if len(data) < HEADER.size or flags & socket.MSG_TRUNC:
            self._malformed += 1
            return 1
        hsize, mtype, dropped = HEADER.unpack_from(data)
        if mtype != MSG_BATCH:
            self._point(data)
            return 1
        n, off = 0, hsize
        while off + LENGTH.size <= len(data):
            (size,) = LENGTH.unpack_from(data, off)
            off += LENGTH.size
            if size > len(data) - off:
                self._malformed += 1
                break
            self._point(data[off:off + size])
            off += size
            n += 1
        self._losses(dropped)
        return max(1, n)

    def _losses(self, dropped: int) -> None:
        """The Sentry's count of points it dropped, as a header carries it (it wraps at
        2^32; records of one batch may carry it slightly out of order: only a rise
        counts)."""
        diff = (dropped - self._seen_dropped) % (1 << 32)
        if 0 < diff < (1 << 31):
            self._lost += diff
            self._seen_dropped = dropped

    def _point(self, data: bytes) -> None:
        """One point: header (with the count of cpuos's extension) and message."""
        if len(data) < HEADER.size:
            self._malformed += 1
            return
        hsize, mtype, dropped = HEADER.unpack_from(data)
        self._losses(dropped)
        count = 1
        if hsize >= HEADER.size + COUNT.size and len(data) >= hsize:
            count = max(1, COUNT.unpack_from(data, HEADER.size)[0])
        try:
            got = decode(mtype, data[hsize:], count, self.cpuos_points) \
                if hsize >= HEADER.size else None
        except Exception:
            self._malformed += 1
            return
        if got is not None:
            self.points += count
            self.audit.record(self.sid, got[0], got[1])

    def _note(self) -> None:
        lost, malformed = self._lost, self._malformed
        self._lost = self._malformed = 0
        self.audit.note_dropped(self.sid, lost, "gVisor's sink (the socket's buffer was full)")
        self.audit.note_dropped(self.sid, malformed, "malformed or too large")


class Traced:
    """Wraps a gVisor backend: every sandbox it starts or restores is traced into ``audit``
    (the lifecycle calls the same methods as before)."""

    def __init__(self, inner: Backend, audit: AuditLog, sandboxes_dir: Path) -> None:
        self.inner, self.audit, self.sandboxes_dir = inner, audit, sandboxes_dir
        self.capabilities: Capabilities = dataclasses.replace(inner.capabilities)
        self.image_kind = inner.image_kind
        self.sinks: dict[str, Sink] = {}
        self._adopted = False
        info = getattr(inner, "info", None)  # the gVisor backend's Runsc
        self.cpuos_points = bool(getattr(info, "audit_points", False))

    def __getattr__(self, name: str) -> Any:  # what the wrapper does not change
        return getattr(self.inner, name)

    def runtime(self) -> dict[str, str]:
        return {**self.inner.runtime(), "audit": "runtime monitoring (seccheck)"}

    def _config_path(self, sid: str) -> Path:
        return self.sandboxes_dir / sid / "trace.json"

    def _prepare(self, spec: SandboxSpec) -> None:
        if spec.template_boot:
            return
        spec.dir.mkdir(parents=True, exist_ok=True)
        old = self.sinks.pop(spec.id, None)
        if old is not None:
            old.close()
        sock = spec.dir / "trace.sock"
        self.sinks[spec.id] = Sink(spec.id, sock, self.audit, self.cpuos_points)
        cfg = self._config_path(spec.id)
        cfg.write_text(json.dumps(session_config(sock, self.cpuos_points)))
        spec.trace_config = cfg

    def _drop(self, sid: str) -> None:
        sink = self.sinks.pop(sid, None)
        if sink is not None:
            sink.close()

    async def start(self, spec: SandboxSpec) -> None:
        self._prepare(spec)
        try:
            await self.inner.start(spec)
        except BaseException:
            self._drop(spec.id)
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        self._prepare(spec)
        try:
            await self.inner.restore(spec, image_dir)
        except BaseException:
            self._drop(spec.id)
            raise

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        try:
            await self.inner.checkpoint(sandbox_id, image_dir)
        finally:  # the Sentry has stopped; a restore makes a new listener
            self._drop(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        try:
            await self.inner.kill(sandbox_id)
        finally:
            self._drop(sandbox_id)

    async def running(self) -> dict[str, str]:
        live = await self.inner.running()
        if not self._adopted:  # a restarted daemon: sessions of running sandboxes re-attach
            self._adopted = True
            for sid, status in live.items():
                if status == "running" and self._config_path(sid).exists():
                    await self._reattach(sid)
        return live

    async def _reattach(self, sid: str) -> None:
        from .. import procs

        d = self.sandboxes_dir / sid
        sock = d / "trace.sock"
        self._drop(sid)
        self.sinks[sid] = Sink(sid, sock, self.audit,
                               "cpuos_coalesce" in self._config_path(sid).read_text())
        flags = getattr(self.inner, "_global_flags", None)
        if flags is None:
            return
        try:
            rc, _, err = await procs.run([*flags(), "trace", "create", "--force",
                                          f"--config={self._config_path(sid)}", sid],
                                         timeout=30)
        except TimeoutError:
            rc, err = -1, b"timed out"
        if rc != 0:
            log.warning("trace session of %s not re-attached: %s", sid,
                        err.decode(errors="replace")[-300:])
        else:
            log.info("trace session of %s re-attached", sid)

    async def close(self) -> None:
        for sid in list(self.sinks):
            self._drop(sid)
        await self.inner.close()
